"""`medfed privacy ...` and `medfed ledger ...`: commands for privacy officers.

``medfed privacy epsilon`` composes a whole history of DP-SGD segments (so two halves
give the same epsilon as the whole), ``medfed privacy plan`` calibrates the noise
multiplier once for a planned schedule, ``medfed ledger show|verify`` read a site's
ledger without changing it.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.privacy.accountant import ACCOUNTANTS, Segment, account, plan_noise_multiplier
from common.privacy.ledger import read_ledger, verify_ledger

PRIVACY_COMMAND_GROUP = "medfed.privacy_commands"


def parse_segment(text: str) -> Segment:
    """``SIGMA:Q:STEPS`` -> Segment; errors name the argument and the bad part."""
    parts = text.split(":")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(
            f"segment {text!r} must be SIGMA:Q:STEPS (e.g. 1.0:0.01:500)"
        )
    sigma_text, rate_text, steps_text = parts
    try:
        sigma = float(sigma_text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"segment {text!r}: SIGMA {sigma_text!r} is not a number"
        ) from None
    try:
        rate = float(rate_text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"segment {text!r}: Q {rate_text!r} is not a number"
        ) from None
    try:
        steps = int(steps_text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"segment {text!r}: STEPS {steps_text!r} is not an integer"
        ) from None
    try:
        return Segment(sigma, rate, steps)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"segment {text!r}: {exc}") from None


def _print_json(value: Any) -> None:
    print(json.dumps(value, sort_keys=True))


def _cmd_epsilon(args: argparse.Namespace) -> int:
    report = account(args.segments, delta=args.delta, accountant=args.accountant)
    output: dict[str, Any] = {
        "epsilon": report.epsilon,
        "delta": report.delta,
        "accountant": report.accountant,
    }
    if report.fell_back:
        output["requested_accountant"] = report.requested_accountant
        output["note"] = report.fallback_reason
    _print_json(output)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    sigma = plan_noise_multiplier(
        target_epsilon=args.target_epsilon,
        delta=args.delta,
        sample_rate=args.sample_rate,
        steps=args.steps,
        accountant=args.accountant,
    )
    _print_json({"noise_multiplier": sigma})
    return 0


def register_privacy(subparsers: Any) -> None:
    """Entry point ``privacy``: adds `medfed privacy epsilon|plan`."""
    parser = subparsers.add_parser(
        "privacy", help="compose DP-SGD histories into (epsilon, delta); plan noise"
    )
    commands = parser.add_subparsers(dest="privacy_command", metavar="SUBCOMMAND")
    commands.required = True

    epsilon = commands.add_parser(
        "epsilon",
        help="epsilon of the composition of ALL segments (never a sum of epsilons)",
    )
    epsilon.add_argument("--delta", type=float, required=True, help="target delta")
    epsilon.add_argument("--accountant", choices=ACCOUNTANTS, default="prv")
    epsilon.add_argument(
        "segments",
        metavar="SIGMA:Q:STEPS",
        nargs="+",
        type=parse_segment,
        help="noise multiplier, Poisson sample rate, number of steps",
    )
    epsilon.set_defaults(func=_cmd_epsilon)

    plan = commands.add_parser(
        "plan", help="noise multiplier meeting a target epsilon for the whole schedule"
    )
    plan.add_argument("--target-epsilon", type=float, required=True)
    plan.add_argument("--delta", type=float, required=True)
    plan.add_argument("--sample-rate", type=float, required=True)
    plan.add_argument("--steps", type=int, required=True, help="ALL local steps of ALL rounds")
    plan.add_argument("--accountant", choices=ACCOUNTANTS, default="prv")
    plan.set_defaults(func=_cmd_plan)
    # Plug-ins (e.g. `audit` from site_agent.audit): `common` never imports site_agent.
    for plugin in sorted(entry_points(group=PRIVACY_COMMAND_GROUP), key=lambda e: e.name):
        plugin.load()(commands)


def _ledger_summary(path: Path) -> dict[str, Any]:
    header, entries = read_ledger(path)
    rows = []
    previous = 0.0
    for entry in entries:
        rows.append(
            {
                "seq": entry.seq,
                "round": entry.round,
                "segments": [list(s.as_tuple()) for s in entry.segments],
                "steps": sum(s.steps for s in entry.segments),
                # Increase of the COMPOSED epsilon, not a stand-alone per-round epsilon
                # (those must never be summed).
                "epsilon_increase": entry.epsilon_after - previous,
                "epsilon_after": entry.epsilon_after,
                "accountant_used": entry.accountant_used,
                "created_at": entry.created_at,
                "status": entry.status,
                "entry_hash": entry.entry_hash,
            }
        )
        previous = entry.epsilon_after
    spent = entries[-1].epsilon_after if entries else 0.0
    return {
        "ledger": str(path),
        "site_id": header.site_id,
        "privacy_unit": header.privacy_unit,
        "budget_epsilon": header.budget_epsilon,
        "delta": header.delta,
        "accountant": header.accountant,
        "spent_epsilon": spent,
        "remaining_epsilon": max(0.0, header.budget_epsilon - spent),
        "entries": rows,
        "head_hash": header.head_hash,
    }


def _cmd_ledger_show(args: argparse.Namespace) -> int:
    summary = _ledger_summary(Path(args.ledger))
    if args.json:
        _print_json(summary)
        return 0
    unit = summary["privacy_unit"]
    print(f"ledger        {summary['ledger']}")
    print(f"site          {summary['site_id']}")
    print(f"privacy unit  {unit} ({'patient-level' if unit == 'patient' else 'record-level'} DP)")
    print(
        f"budget        epsilon={summary['budget_epsilon']:g} at delta={summary['delta']:g} "
        f"({summary['accountant']} accountant)"
    )
    print(
        f"spent         {summary['spent_epsilon']:.4f}   "
        f"remaining {summary['remaining_epsilon']:.4f}"
    )
    print(f"head hash     {summary['head_hash']}")
    print()
    print(f"{'seq':>4} {'round':>6} {'steps':>7} {'+epsilon':>9} {'epsilon':>9}  created_at")
    for row in summary["entries"]:
        print(
            f"{row['seq']:>4} {row['round']:>6} {row['steps']:>7} "
            f"{row['epsilon_increase']:>9.4f} {row['epsilon_after']:>9.4f}  {row['created_at']}"
        )
    return 0


def _cmd_ledger_verify(args: argparse.Namespace) -> int:
    report = verify_ledger(args.ledger, recompose=not args.hashes_only)
    if report.ok:
        checked = "hash chain and epsilons" if report.epsilons_recomposed else "hash chain"
        print(
            f"ledger {report.path}: OK ({report.entries_checked} entries; {checked} verified; "
            f"head {report.head_hash})"
        )
        return 0
    print(f"ledger {report.path}: INTEGRITY FAILURE", file=sys.stderr)
    print(f"first problem: {report.problems[0]}", file=sys.stderr)
    for problem in report.problems[1:]:
        print(f"  also: {problem}", file=sys.stderr)
    return 1


def register_ledger(subparsers: Any) -> None:
    """Entry point ``ledger``: adds `medfed ledger show|verify`."""
    parser = subparsers.add_parser("ledger", help="read and verify a site's privacy ledger")
    commands = parser.add_subparsers(dest="ledger_command", metavar="SUBCOMMAND")
    commands.required = True

    show = commands.add_parser("show", help="per-round and cumulative epsilon, budget left")
    show.add_argument("--ledger", required=True, help="path of the site's ledger file")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.set_defaults(func=_cmd_ledger_show)

    verify = commands.add_parser(
        "verify", help="check the hash chain and recompose every epsilon (exit 1 if broken)"
    )
    verify.add_argument("--ledger", required=True, help="path of the site's ledger file")
    verify.add_argument(
        "--hashes-only", action="store_true", help="skip recomposing epsilons (faster)"
    )
    verify.set_defaults(func=_cmd_ledger_verify)


def main(argv: list[str] | None = None) -> int:
    """Standalone `python -m common.privacy.cli privacy|ledger ...`.

    Same behaviour as `medfed privacy|ledger ...` (one error line, exit 2, for expected
    failures) without loading the other packages' commands.
    """
    from common.cli import main_with

    return main_with([register_privacy, register_ledger], argv)


if __name__ == "__main__":
    sys.exit(main())
