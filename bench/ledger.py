"""`medfed bench ledger`: a site's privacy bookkeeping per round, old path vs new.

Every round a DP site plans its noise from its ledger (`plan_round_noise`) and then
runs the write-ahead: `preview` of the round's training with its evaluation, and two
`reserve`s (training, then evaluation), each composing the whole history
(`common.privacy.layered.charged`, exactly what `PrivacyLedger` calls; the SQLite
write and the signature are not timed). The benchmark replays a demo-like site for
``--rounds`` rounds, twice in one process:

* old: the search starts at sigma = 1 every round and every composition is done from
  scratch (no memoised compositions, no cached RDP curves), as before they existed;
* new: the shipped path (warm start at the last sigma, memoised compositions).

It prints the CPU seconds of planning + write-ahead at rounds 1, 10 and the last, and
the epsilon each path charged after its last round, beside a fresh composition of the
new path's history with every cache cleared (it must be equal).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from common.privacy import accountant as acc
from common.privacy import prv
from common.privacy.layered import charged
from common.privacy.mechanisms import Gaussian, Mechanism, Segment
from site_agent.dp_release import evaluation_mechanism

DELTA = 1e-5
BUDGET = 8.0


def _evaluation(enabled: bool) -> list[Mechanism]:
    if not enabled:
        return []
    return [evaluation_mechanism(noise_std=10.0, n_noise=2, bins=20)]


def replay(*, rounds: int, stop_after: int, old: bool, accountant: str, evaluation: bool,
           sample_rate: float, steps: int) -> dict[str, Any]:
    """Replay the first `stop_after` rounds of a `rounds`-round study; CPU seconds per
    round and the last charge."""
    acc.clear_composition_caches()
    saved = (acc._REPORT_CACHE_SIZE, acc._sampled_gaussian_rdp_step, prv._rdp_curve)
    if old:
        acc._REPORT_CACHE_SIZE = 0  # every composition from scratch
        acc._sampled_gaussian_rdp_step = saved[1].__wrapped__  # type: ignore[assignment]
        prv._rdp_curve = saved[2].__wrapped__  # type: ignore[assignment]
    try:
        per_round = _evaluation(evaluation)
        pairs: list[tuple[str, tuple[Mechanism, ...]]] = [("count", (Gaussian(10.0, 1.0),))]
        cpu: list[float] = []
        sigmas: list[float] = []
        charge = 0.0
        for done in range(stop_after):
            start = time.process_time()
            plan = acc.plan_round_noise(
                history=[m for _, ms in pairs for m in ms], budget_epsilon=BUDGET,
                delta=DELTA, sample_rate=sample_rate, steps_per_round=steps,
                remaining_rounds=rounds - done, max_epsilon_per_round=None,
                accountant=accountant, per_round=per_round, reserved=per_round,
                warm_start=not old,
            )
            training = ("training", (Segment(plan.noise_multiplier, sample_rate, steps),))
            also = [("evaluation", tuple(per_round))] if per_round else []
            charged([*pairs, training, *also], delta=DELTA, accountant=accountant)  # preview
            charge = charged([*pairs, training], delta=DELTA, accountant=accountant).epsilon
            pairs.append(training)
            if also:
                charge = charged([*pairs, *also], delta=DELTA, accountant=accountant).epsilon
                pairs.extend(also)
            cpu.append(time.process_time() - start)
            sigmas.append(plan.noise_multiplier)
    finally:
        (acc._REPORT_CACHE_SIZE, acc._sampled_gaussian_rdp_step,  # type: ignore[assignment]
         prv._rdp_curve) = saved
    acc.clear_composition_caches()
    fresh = charged(pairs, delta=DELTA, accountant=accountant).epsilon
    return {"cpu_seconds": cpu, "sigmas": sigmas, "charged": charge, "fresh": fresh,
            "distinct_sigmas": len(set(sigmas))}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--old-rounds", type=int, default=None,
                        help="replay only the first N rounds of the old path (default "
                             "all: it is O(rounds^2), tens of minutes at 50)")
    parser.add_argument("--accountant", choices=acc.ACCOUNTANTS, default="prv")
    parser.add_argument("--no-evaluation", action="store_true",
                        help="no DP evaluation per round (the history stays in PRV/PLD; "
                             "with evaluation it holds a DDGauss and composes in RDP)")
    parser.add_argument("--sample-rate", type=float, default=0.02)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", action="store_true", help="also print one JSON line")


def main_from_args(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        print("--rounds must be >= 1", file=sys.stderr)
        return 2
    acc.compose_epsilon([Segment(1.0, 0.05, 20)], delta=DELTA, accountant=args.accountant)
    common = {"accountant": args.accountant, "evaluation": not args.no_evaluation,
              "sample_rate": args.sample_rate, "steps": args.steps}
    old_rounds = min(args.old_rounds or args.rounds, args.rounds)
    old = replay(rounds=args.rounds, stop_after=old_rounds, old=True, **common)
    new = replay(rounds=args.rounds, stop_after=args.rounds, old=False, **common)
    print(f"ledger bookkeeping per round: plan + preview + 2 reserves, budget {BUDGET:g}, "
          f"delta {DELTA:g}, q {args.sample_rate:g}, {args.steps} steps/round, "
          f"{args.accountant.upper()}, evaluation {'on' if common['evaluation'] else 'off'}")
    for r in sorted({1, 10, args.rounds}):
        if r > args.rounds:
            continue
        before = f"{old['cpu_seconds'][r - 1]:8.3f}" if r <= old_rounds else "       -"
        print(f"  round {r:>3}: old {before} cpu-s   new {new['cpu_seconds'][r - 1]:8.3f} cpu-s")
    print(f"  rounds 1-{old_rounds}: old {sum(old['cpu_seconds']):.2f} cpu-s, new "
          f"{sum(new['cpu_seconds'][:old_rounds]):.2f}; all {args.rounds} rounds new "
          f"{sum(new['cpu_seconds']):.2f} cpu-s")
    print(f"  distinct sigmas: old {old['distinct_sigmas']}, new {new['distinct_sigmas']}")
    print(f"  epsilon charged after round {old_rounds} (old): {old['charged']:.6f}; "
          f"after round {args.rounds} (new): {new['charged']:.6f}, fresh composition of "
          f"the new history {new['fresh']:.6f}")
    if args.json:
        print(json.dumps({"old": old, "new": new}))
    return 0


def register(bench_subparsers: Any) -> None:
    """Add ``ledger`` to ``medfed bench``."""
    parser = bench_subparsers.add_parser("ledger", help="per-round privacy bookkeeping cost")
    _add_arguments(parser)
    parser.set_defaults(func=main_from_args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="medfed bench ledger", description=__doc__)
    _add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
