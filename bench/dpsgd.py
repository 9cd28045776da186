"""`medfed bench dpsgd`: what DP-SGD costs over non-private training, side by side.

One epoch of (a) non-private SGD, (b) DP-SGD with Opacus ghost clipping and (c) DP-SGD
with Opacus per-sample-gradient hooks, on the demo MLP and the demo site data
(the largest synthetic demo hospital, record-level privacy so that Opacus' paths are
what is measured). The three are timed in turn, epoch after epoch, in one process,
so machine load affects them alike; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from typing import Any

import numpy as np

DEMO_SITE = "urban_academic"
MODES = ("nonprivate", "ghost", "hooks")


def run(
    *, epochs: int = 5, batch_size: int = 256, threads: int = 1, seed: int = 0
) -> dict[str, Any]:
    """Median seconds per epoch of each mode and the DP/non-private ratios."""
    # Imported here, not at module level: every `medfed` command registers the bench
    # subcommands, and torch + Opacus would add seconds and ~300 MB to each process.
    import torch

    from site_agent.data import prepare_site_split
    from site_agent.models import TabularMLP, flatten_parameters
    from site_agent.synthetic import FEATURES, generate_cohort
    from site_agent.trainer import LocalTrainer, TrainingConfig

    torch.set_num_threads(threads)
    cohort = generate_cohort([DEMO_SITE], seed=seed)
    train, _, _ = prepare_site_split(cohort[DEMO_SITE], seed=seed)
    trainers = {}
    for mode in MODES:
        config = TrainingConfig(
            batch_size=batch_size,
            max_physical_batch_size=max(batch_size * 2, 1024),
            local_epochs=1,
            lr=0.5,
            dp=mode != "nonprivate",
            privacy_unit="record",
            grad_sample_mode="hooks" if mode == "hooks" else "ghost",
            device="cpu",
        )
        torch.manual_seed(seed)
        trainers[mode] = LocalTrainer(lambda: TabularMLP(len(FEATURES)), train, config, seed=seed)
    start = flatten_parameters(trainers["nonprivate"].model)
    with warnings.catch_warnings():
        # Opacus' full backward hooks warn when inputs need no grad (they never do here).
        warnings.simplefilter("ignore", UserWarning)
        for trainer in trainers.values():  # warm-up: first-call allocations, lazy init
            trainer.train_round(start)
        seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(epochs):
            for mode, trainer in trainers.items():
                seconds[mode].append(trainer.train_round(start).seconds)
    median = {mode: statistics.median(values) for mode, values in seconds.items()}
    return {
        "records": len(train),
        "batch_size": batch_size,
        "steps_per_epoch": trainers["ghost"].steps_per_epoch,
        "threads": threads,
        "epochs": epochs,
        "nonprivate_seconds": median["nonprivate"],
        "ghost_seconds": median["ghost"],
        "hooks_seconds": median["hooks"],
        "ghost_ratio": median["ghost"] / median["nonprivate"],
        "hooks_ratio": median["hooks"] / median["nonprivate"],
        "ghost_mode_used": trainers["ghost"].grad_sample_mode,
    }


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs per mode")
    parser.add_argument("--batch-size", type=int, default=256, help="expected logical batch")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="last line is a JSON object")


def main_from_args(args: argparse.Namespace) -> int:
    result = run(
        epochs=args.epochs, batch_size=args.batch_size, threads=args.threads, seed=args.seed
    )
    print(
        f"DP-SGD on the demo MLP, {result['records']} records, batch {result['batch_size']}, "
        f"{result['steps_per_epoch']} steps/epoch, {result['threads']} thread(s), "
        f"median of {result['epochs']} epochs"
    )
    for mode in MODES:
        line = f"  {mode:<11} {result[f'{mode}_seconds'] * 1e3:9.1f} ms/epoch"
        if mode != "nonprivate":
            line += f"   {result[f'{mode}_ratio']:.2f}x non-private"
        print(line)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if not isinstance(v, np.generic)}))
    return 0


def register(bench_subparsers: Any) -> None:
    """Add ``dpsgd`` to ``medfed bench``."""
    parser = bench_subparsers.add_parser("dpsgd", help="DP-SGD vs non-private training cost")
    _add_arguments(parser)
    parser.set_defaults(func=main_from_args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="medfed bench dpsgd", description=__doc__)
    _add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
