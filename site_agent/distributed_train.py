"""Multi-GPU (or multi-process CPU) private training at ONE hospital, via torchrun.

    torchrun --nproc-per-node 4 -m site_agent.distributed_train --out run/ [--csv site.csv]
    torchrun --nproc-per-node 4 -m site_agent.distributed_train --out run/ \
        --study study.toml --data IMAGE_FOLDER     # an images study's model and folder

Every process loads the site's training data and trains on its shard with Opacus'
DPDDP (see `LocalTrainer._build_distributed`): per-sample clipping on every rank,
noise on rank 0 only, gradients summed across ranks. The privacy accounting is that of
one process with the same data and batch size: same q, same steps, same sigma.

Writes ``rank<r>.npy`` (final weights of each rank, float32) and, from rank 0,
``result.json`` (segments, noise multiplier, mode, world size).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from common.core.errors import ConfigError
from common.models.build import build_for_study
from common.models.layout import flatten_parameters
from common.models.tables.mlp import TabularMLP
from common.study import Study, load_study
from site_agent.data import SiteData, load_site_data, prepare_site_split
from site_agent.imaging import ImageDataset, image_spec_for_study, load_image_folder
from site_agent.synthetic import FEATURES, SCHEMA, generate_cohort
from site_agent.trainer import LocalTrainer
from site_agent.training_config import TrainingConfig
from site_agent.unit_split import site_split_key, split_by_patient


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="site_agent.distributed_train", description=__doc__)
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--csv", type=Path, help="site CSV (synthetic schema); default: demo")
    parser.add_argument("--site", default="urban_academic", help="synthetic site to generate")
    parser.add_argument("--patients", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--target-epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--accountant", default="prv", choices=["prv", "rdp"])
    parser.add_argument("--grad-sample-mode", default="ghost", choices=["ghost", "hooks"])
    parser.add_argument("--study", type=Path, help="images study: its model and image spec")
    parser.add_argument("--data", type=Path, help="the study's image folder (labels.csv)")
    parser.add_argument("--state", type=Path, default=None,
                        help="folder of the site's split key (default: --out), as `site run`")
    return parser


def config_from_args(
    args: argparse.Namespace, *, device: str, study: Study | None = None
) -> TrainingConfig:
    """The TrainingConfig this launcher uses (also used by tests for the 1-process twin)."""
    return TrainingConfig(
        task=study.study.task if study is not None else "binary",
        num_classes=len(study.study.classes) if study is not None else 2,
        batch_size=args.batch_size,
        lr=args.lr,
        target_epsilon=args.target_epsilon,
        delta=args.delta,
        planned_rounds=args.rounds,
        accountant=args.accountant,
        privacy_unit="record",
        grad_sample_mode=args.grad_sample_mode,
        device=device,
    )


def _split_key(args: argparse.Namespace) -> bytes:
    """The site's split key (`unit_split.site_split_key`): every rank reads the same one."""
    return site_split_key(args.state if args.state is not None else args.out)


def _site_data_and_model(
    args: argparse.Namespace, study: Study | None
) -> tuple[SiteData | ImageDataset, Callable[[], torch.nn.Module]]:
    """The training split and the model factory: an images study's folder and network
    (the same registry as `site run`), else the tabular MLP on the site's CSV."""
    if study is not None:
        if study.data.kind != "images" or args.data is None:
            raise ConfigError("--study", "give an images study and its folder (--data)")
        images = load_image_folder(args.data, image_spec_for_study(study))
        image_train, _ = split_by_patient(images, held_out_fraction=0.2, key=_split_key(args))

        def study_model() -> torch.nn.Module:
            torch.manual_seed(args.seed)
            return build_for_study(study)

        return image_train, study_model
    if args.csv is not None:
        data = load_site_data(args.csv, SCHEMA, delta=args.delta)
    else:
        data = generate_cohort([args.site], seed=args.seed, patients_per_site=args.patients)[
            args.site
        ]
    train, _, _ = prepare_site_split(data, key=_split_key(args))

    def mlp() -> torch.nn.Module:
        torch.manual_seed(args.seed)
        return TabularMLP(len(FEATURES))

    return train, mlp


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(1)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    try:
        rank = dist.get_rank()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local_rank}" if use_cuda else "cpu"
        if use_cuda:
            torch.cuda.set_device(local_rank)
        study = load_study(args.study) if args.study is not None else None
        train, model_factory = _site_data_and_model(args, study)
        trainer = LocalTrainer(
            model_factory, train, config_from_args(args, device=device, study=study),
            seed=args.seed,
        )
        weights = flatten_parameters(trainer.model)
        segments = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(args.rounds):
                result = trainer.train_round(weights)
                weights = weights + result.delta_flat
                segments.extend(result.segments)
        args.out.mkdir(parents=True, exist_ok=True)
        np.save(args.out / f"rank{rank}.npy", weights.astype(np.float32))
        if rank == 0:
            summary = {
                "world_size": trainer.world_size,
                "grad_sample_mode": trainer.grad_sample_mode,
                "noise_multiplier": trainer.noise_multiplier,
                "sample_rate": trainer.sample_rate,
                "segments": [s.as_tuple() for s in segments],
            }
            (args.out / "result.json").write_text(json.dumps(summary), encoding="utf-8")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
