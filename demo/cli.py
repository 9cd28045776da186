"""`medfed demo`: the command line (tabular by default, ``--task imaging``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from common.core.errors import ConfigError
from common.models import model_names
from demo.imaging import IMAGING_DEFAULTS, ImagingTask
from demo.options import DemoOptions, validate_options
from demo.run import Demo


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run a whole federation on this machine and print the privacy/utility table",
    )
    d = DemoOptions()
    parser.add_argument("--out", type=Path, default=d.out, help="output folder (demo-run)")
    parser.add_argument("--data", type=Path, help="folder with one CSV per site (stem = site)")
    parser.add_argument("--label-column", default=d.label_column)
    parser.add_argument("--patient-column", default=None,
                        help="patient id column (patient-level DP); default for the "
                        "synthetic cohort: patient_id")
    parser.add_argument("--sites", type=int, default=d.sites)
    parser.add_argument("--rounds", type=int, default=d.rounds)
    parser.add_argument("--patients-per-site", type=int, default=d.patients_per_site)
    parser.add_argument("--budget-epsilon", type=float, default=d.budget_epsilon)
    parser.add_argument("--delta", type=float, default=d.delta)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--kill-round", type=int, default=d.kill_round,
                        help="round in which one site is killed (0: none)")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--privacy-unit", choices=["auto", "hospital"], default="auto",
                        help="hospital: each site's whole update clipped to "
                        "--update-clip-norm and noised in the SecAgg ring (DDGauss)")
    parser.add_argument("--update-clip-norm", type=float, default=d.update_clip_norm)
    parser.add_argument("--intermediaries", type=_intermediaries, default=d.intermediaries,
                        help="hospital-level DP: v disjoint patient groups per hospital, "
                        "each clipped alone, or 'auto': v chosen every round by the rule "
                        "of Jiang et al. 2023. Default 1: the budget caps "
                        "the hospital-level epsilon; v > 1 or auto make it v-fold")
    parser.add_argument("--no-audit", dest="audit", action="store_false",
                        help="skip the membership-inference audit (about 10 s on 2 cores)")
    imaging = parser.add_argument_group("imaging (--task imaging)")
    imaging.add_argument("--task", choices=["tabular", "imaging"], default="tabular",
                         help="tabular: the sepsis cohort (default); imaging: five hospitals' "
                         "synthetic image folders (PNG and DICOM) with an images study")
    imaging.add_argument("--model", default="cnn",
                         help="images study model: " + ", ".join(model_names("images")))
    imaging.add_argument("--image-size", type=int, default=28)
    imaging.add_argument("--device", default="auto",
                         help="auto (cuda when present), cpu, cuda or cuda:N")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.task == "imaging":
        return _main_imaging(args)
    return exit_status(Demo(tabular_options(args)).run())


def exit_status(report: dict[str, Any]) -> int:
    """`medfed demo`'s exit status: 0 when the federation reported a final AUC."""
    return 0 if report["final"].get("auc") is not None else 1


def tabular_options(args: argparse.Namespace) -> DemoOptions:
    """The tabular demo's options from its command line, checked."""
    patient_column = args.patient_column
    if args.data is None and patient_column is None:
        patient_column = "patient_id"
    options = DemoOptions(
        out=args.out,
        sites=args.sites,
        rounds=args.rounds,
        patients_per_site=args.patients_per_site,
        seed=args.seed,
        budget_epsilon=args.budget_epsilon,
        delta=args.delta,
        kill_round=args.kill_round,
        data=args.data,
        label_column=args.label_column,
        patient_column=patient_column,
        quiet=args.quiet,
        privacy_unit=args.privacy_unit,
        update_clip_norm=args.update_clip_norm,
        intermediaries=args.intermediaries,
        audit=args.audit,
    )
    validate_options(options)
    return options


def _main_imaging(args: argparse.Namespace) -> int:
    """`--task imaging` (demo.imaging): flags left at the tabular defaults take the
    imaging defaults instead."""
    if args.data is not None:
        raise ConfigError("--data", "--task imaging runs on the synthetic imaging cohort")
    defaults = DemoOptions()
    chosen = {
        name: value if getattr(args, name, getattr(defaults, name)) == getattr(defaults, name)
        else getattr(args, name)
        for name, value in IMAGING_DEFAULTS.items()
    }
    options = DemoOptions(
        out=args.out, sites=args.sites, seed=args.seed, budget_epsilon=args.budget_epsilon,
        kill_round=args.kill_round, label_column="label", patient_column="patient_id",
        quiet=args.quiet, **chosen,
    )
    validate_options(options)
    task = ImagingTask(model=args.model, image_size=args.image_size, device=args.device)
    return exit_status(Demo(options, task=task).run())


def _intermediaries(text: str) -> int | str:
    """--intermediaries: a positive integer or "auto"."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value

