"""`medfed privacy ...`: planning and composing commands for privacy officers
(`medfed ledger ...` lives in `common.commands.ledger`).

``medfed privacy epsilon`` composes a whole history of mechanisms (so two halves give the
same epsilon as the whole), ``medfed privacy plan`` calibrates the noise multiplier once
for a planned schedule, ``medfed privacy plan-round`` plans the next round from what a
ledger already spent. `main` runs both command groups standalone.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from common.commands.cli import main_with
from common.commands.ledger import print_json, register_ledger
from common.core.errors import ConfigError, ValidationError
from common.core.parsing import parse_json
from common.privacy.accountant import (
    ACCOUNTANTS,
    Segment,
    account,
    plan_noise_multiplier,
    plan_round_noise,
)
from common.privacy.ledger import (
    read_ledger,
)
from common.privacy.mechanisms import (
    DistributedDiscreteGaussian,
    Gaussian,
    Mechanism,
    mechanism_from_json_dict,
)

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


def _numbers(text: str, parts: list[str], names: list[str]) -> list[float]:
    values = []
    for part, name in zip(parts, names[: len(parts)], strict=True):
        try:
            values.append(float(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"mechanism {text!r}: {name} {part!r} is not a number"
            ) from None
    return values


def _whole(text: str, value: float, name: str) -> int:
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"mechanism {text!r}: {name} must be an integer")
    return int(value)


def parse_mechanism(text: str) -> Mechanism:
    """One mechanism of a history, in any of these forms (errors name the bad part):

    * ``SIGMA:Q:STEPS`` (or ``sampled_gaussian:SIGMA:Q:STEPS``): DP-SGD steps;
    * ``gaussian:NOISE_STD:L2_SENSITIVITY[:COUNT]``: Gaussian releases (absolute std);
    * ``ddgauss:VARIANCE_PER_SITE:CONTRIBUTORS:L2_SENSITIVITY:DIMENSION[:L1_SENSITIVITY]``
      (ring units): one distributed discrete Gaussian release;
    * the ledger's tagged JSON, e.g. ``{"kind": "gaussian", ...}``.
    """
    if text.lstrip().startswith("{"):
        try:
            return mechanism_from_json_dict(parse_json(text))
        except (ValidationError, ConfigError) as exc:
            raise argparse.ArgumentTypeError(f"mechanism {text!r}: {exc}") from None
    parts = text.split(":")
    kind = parts[0]
    try:
        if kind == "gaussian":
            if len(parts) not in (3, 4):
                raise argparse.ArgumentTypeError(
                    f"mechanism {text!r} must be gaussian:NOISE_STD:L2_SENSITIVITY[:COUNT]"
                )
            values = _numbers(text, parts[1:], ["NOISE_STD", "L2_SENSITIVITY", "COUNT"])
            count = _whole(text, values[2], "COUNT") if len(values) == 3 else 1
            return Gaussian(values[0], values[1], count)
        if kind in ("ddgauss", "distributed_discrete_gaussian"):
            if len(parts) not in (5, 6):
                raise argparse.ArgumentTypeError(
                    f"mechanism {text!r} must be ddgauss:VARIANCE_PER_SITE:CONTRIBUTORS:"
                    "L2_SENSITIVITY:DIMENSION[:L1_SENSITIVITY]"
                )
            values = _numbers(
                text,
                parts[1:],
                ["VARIANCE_PER_SITE", "CONTRIBUTORS", "L2_SENSITIVITY", "DIMENSION",
                 "L1_SENSITIVITY"],
            )
            return DistributedDiscreteGaussian(
                noise_variance_per_site=values[0],
                contributors=_whole(text, values[1], "CONTRIBUTORS"),
                l2_sensitivity=values[2],
                dimension=_whole(text, values[3], "DIMENSION"),
                l1_sensitivity=values[4] if len(values) == 5 else None,
            )
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"mechanism {text!r}: {exc}") from None
    if kind == "sampled_gaussian":
        return parse_segment(":".join(parts[1:]))
    return parse_segment(text)





def _cmd_epsilon(args: argparse.Namespace) -> int:
    report = account(args.mechanisms, delta=args.delta, accountant=args.accountant)
    output: dict[str, Any] = {
        "epsilon": report.epsilon,
        "delta": report.delta,
        "accountant": report.accountant,
    }
    if report.fell_back:
        output["requested_accountant"] = report.requested_accountant
        output["note"] = report.fallback_reason
    print_json(output)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    sigma = plan_noise_multiplier(
        target_epsilon=args.target_epsilon,
        delta=args.delta,
        sample_rate=args.sample_rate,
        steps=args.steps,
        accountant=args.accountant,
    )
    print_json({"noise_multiplier": sigma})
    return 0


def _cmd_plan_round(args: argparse.Namespace) -> int:
    history: list[Mechanism] = list(args.mechanisms)
    budget, delta, accountant = args.budget_epsilon, args.delta, args.accountant
    if args.ledger is not None:
        header, entries = read_ledger(Path(args.ledger))
        history.extend(m for entry in entries for m in entry.mechanisms)
        budget = budget if budget is not None else header.budget_epsilon
        delta = delta if delta is not None else header.delta
        accountant = accountant if accountant is not None else header.accountant
    if budget is None or delta is None:
        raise ConfigError("budget_epsilon", "give --ledger, or --budget-epsilon and --delta")
    plan = plan_round_noise(
        history=history,
        budget_epsilon=budget,
        delta=delta,
        sample_rate=args.sample_rate,
        steps_per_round=args.steps_per_round,
        remaining_rounds=args.remaining_rounds,
        max_epsilon_per_round=args.max_epsilon_per_round,
        accountant=accountant or "prv",
    )
    print_json(
        {
            "noise_multiplier": plan.noise_multiplier,
            "epsilon_spent": plan.epsilon_spent,
            "epsilon_after_round": plan.epsilon_after_round,
            "epsilon_after_plan": plan.epsilon_after_plan,
            "round_epsilon": plan.round_epsilon,
            "binding": plan.binding,
        }
    )
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
        "mechanisms",
        metavar="MECHANISM",
        nargs="+",
        type=parse_mechanism,
        help="SIGMA:Q:STEPS (DP-SGD), gaussian:NOISE_STD:L2_SENSITIVITY[:COUNT], "
        "ddgauss:VARIANCE_PER_SITE:CONTRIBUTORS:L2_SENSITIVITY:DIMENSION[:L1_SENSITIVITY] "
        "(ring units), or a ledger's tagged JSON object",
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
    # A role image ships only its own packages (the coordinator image has no site_agent/):
    # a plug-in whose package is absent adds no command; any other import error is raised.
    for plugin in sorted(entry_points(group=PRIVACY_COMMAND_GROUP), key=lambda e: e.name):
        try:
            register = plugin.load()
        except ModuleNotFoundError as exc:
            if exc.name != plugin.value.split(":", 1)[0].split(".", 1)[0]:
                raise
            continue
        register(commands)

    plan_round = commands.add_parser(
        "plan-round",
        help="noise multiplier for the next round from what a ledger already spent "
        "(eps(ledger + round) - eps(ledger) <= cap; remaining rounds fit the budget)",
    )
    plan_round.add_argument("--ledger", help="the site's ledger (its history, budget, delta)")
    plan_round.add_argument("--budget-epsilon", type=float)
    plan_round.add_argument("--delta", type=float)
    plan_round.add_argument("--accountant", choices=ACCOUNTANTS)
    plan_round.add_argument("--sample-rate", type=float, required=True)
    plan_round.add_argument("--steps-per-round", type=int, required=True)
    plan_round.add_argument("--remaining-rounds", type=int, required=True,
                            help="the site's own plan, not the coordinator's announcement")
    plan_round.add_argument("--max-epsilon-per-round", type=float)
    plan_round.add_argument("mechanisms", metavar="MECHANISM", nargs="*", type=parse_mechanism,
                            help="extra history (same forms as `privacy epsilon`)")
    plan_round.set_defaults(func=_cmd_plan_round)


def main(argv: list[str] | None = None) -> int:
    """Standalone `python -m common.commands.privacy privacy|ledger ...`.

    Same behaviour as `medfed privacy|ledger ...` (one error line, exit 2, for expected
    failures) without loading the other packages' commands.
    """
    return main_with([register_privacy, register_ledger], argv)


if __name__ == "__main__":
    sys.exit(main())
