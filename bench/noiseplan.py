"""`medfed bench noiseplan`: cost of a site planning its next round's noise.

`plan_round_noise` searches the smallest sigma whose composed epsilon meets the budget
(and the per-round cap), each probe a whole-history composition with the ledger's
accountant. The benchmark times the scenarios the site meets (a fresh ledger, a capped
one-round plan, a ledger with history) and counts the compositions each needed; the
plan and composition caches are cleared before every repeat, so the search itself is what is timed.

Wall and CPU time are both printed: the development VM is shared, so wall time
inflates under load while CPU time stays near the unloaded figure. Run it on two trees
(``PYTHONPATH=<tree> python -m bench.noiseplan``) to compare searches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from common.privacy import accountant as acc
from common.privacy.mechanisms import Mechanism, Segment

SCENARIOS: dict[str, dict[str, Any]] = {
    "fresh, 10 rounds": {"history": [], "remaining_rounds": 10,
                         "max_epsilon_per_round": None},
    "fresh, 1 round, cap 0.5": {"history": [], "remaining_rounds": 1,
                                "max_epsilon_per_round": 0.5},
    "4 rounds spent, 6 left": {"history": [Segment(1.1, 0.05, 20)] * 4,
                               "remaining_rounds": 6, "max_epsilon_per_round": None},
}


def _counting(calls: list[int]) -> Callable[..., float]:
    original: Callable[..., float] = acc.compose_epsilon

    def counted(mechanisms: list[Mechanism], **kwargs: Any) -> float:
        calls[0] += 1
        return original(mechanisms, **kwargs)

    return counted


def run_scenario(name: str, *, accountant: str, repeats: int) -> dict[str, Any]:
    """Median wall/CPU seconds and compositions of `repeats` uncached plans."""
    scenario = SCENARIOS[name]
    walls, cpus, counts = [], [], []
    sigma = 0.0
    for _ in range(repeats):
        clear = getattr(acc, "clear_composition_caches", None)
        if clear is not None:
            clear()  # plans, memoised compositions and RDP curves
        cache = getattr(acc, "_ROUND_PLANS", None)
        if cache is not None:
            cache.clear()
        calls = [0]
        original = acc.compose_epsilon
        acc.compose_epsilon = _counting(calls)  # type: ignore[assignment]
        try:
            start, start_cpu = time.perf_counter(), time.process_time()
            plan = acc.plan_round_noise(
                budget_epsilon=8.0, delta=1e-5, sample_rate=0.05, steps_per_round=20,
                accountant=accountant, **scenario,
            )
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - start_cpu)
        finally:
            acc.compose_epsilon = original  # type: ignore[assignment]
        counts.append(calls[0])
        sigma = plan.noise_multiplier
    return {"scenario": name, "accountant": accountant, "noise_multiplier": sigma,
            "compositions": statistics.median(counts), "wall_seconds": statistics.median(walls),
            "cpu_seconds": statistics.median(cpus)}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--accountant", choices=acc.ACCOUNTANTS, default="prv")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="also print one JSON line")


def main_from_args(args: argparse.Namespace) -> int:
    # Warm the imports (Opacus, torch) outside the timings.
    acc.compose_epsilon([Segment(1.0, 0.05, 20)], delta=1e-5, accountant=args.accountant)
    results = [run_scenario(name, accountant=args.accountant, repeats=args.repeats)
               for name in SCENARIOS]
    print(f"plan_round_noise, budget 8, delta 1e-5, q 0.05, 20 steps/round, "
          f"{args.accountant.upper()}, median of {args.repeats}")
    for r in results:
        print(f"  {r['scenario']:<26} sigma {r['noise_multiplier']:.4f}  "
              f"{r['compositions']:>4.0f} compositions  {r['wall_seconds']:7.2f} s wall "
              f"{r['cpu_seconds']:7.2f} s cpu")
    if args.json:
        print(json.dumps({"results": results}))
    return 0


def register(bench_subparsers: Any) -> None:
    """Add ``noiseplan`` to ``medfed bench``."""
    parser = bench_subparsers.add_parser("noiseplan", help="site noise-planning cost")
    _add_arguments(parser)
    parser.set_defaults(func=main_from_args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="medfed bench noiseplan", description=__doc__)
    _add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
