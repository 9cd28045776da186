"""`medfed privacy audit`'s command line: its arguments only, so that `medfed privacy`
(and `python -m common.commands.privacy ledger ...`, which registers every privacy command)
starts without importing torch and Opacus; the audit itself (site_agent/audit.py) is
imported when the command runs."""

from __future__ import annotations

import argparse
import math
from typing import Any

from site_agent.audit_settings import DEFAULT_CANARIES, DEFAULT_EPOCHS


def _cmd_audit(args: argparse.Namespace) -> int:
    # The audit trains with torch and Opacus: loaded only when the command runs.
    from site_agent.audit import run_audit_command

    return run_audit_command(args)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def register(commands: Any) -> None:
    """Adds `audit` under `medfed privacy` (plug-in group ``medfed.privacy_commands``)."""
    parser = commands.add_parser(
        "audit",
        help="train locally with canaries, attack them, report an epsilon lower bound",
    )
    parser.add_argument("--data", required=True, help="CSV or Parquet file of records")
    parser.add_argument("--label-column", default=None, help="required without --study")
    parser.add_argument("--patient-column", default=None, help="patient-level DP if given")
    parser.add_argument(
        "--study",
        default=None,
        help="study file: train its features, encoding, model and privacy settings",
    )
    parser.add_argument(
        "--statistics",
        default=None,
        help="with --study: the federation's preprocessing statistics (JSON); default: "
        "a noiseless release of this file, kept local",
    )
    privacy = parser.add_mutually_exclusive_group()
    privacy.add_argument(
        "--epsilon",
        type=_positive_float,
        default=None,
        help="target epsilon of the audited DP-SGD training (default: the study's, else 8)",
    )
    privacy.add_argument("--no-dp", action="store_true", help="audit non-private training")
    parser.add_argument(
        "--delta", type=_positive_float, default=None, help="default: the study's, else 1e-5"
    )
    parser.add_argument("--canaries", type=int, default=DEFAULT_CANARIES)
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="fixed seed (tests only: makes the DP noise reproducible)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    parser.set_defaults(func=_cmd_audit)


def main(argv: list[str] | None = None) -> int:
    """`python -m site_agent.audit ...` = `medfed privacy audit ...`."""
    from common.commands.cli import run_parsed

    parser = argparse.ArgumentParser(prog="medfed privacy")
    commands = parser.add_subparsers(dest="privacy_command", required=True)
    register(commands)
    return run_parsed(parser.parse_args(["audit", *(argv or [])]))
