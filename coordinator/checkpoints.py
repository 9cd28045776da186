"""The global model on disk: loading the latest good checkpoint at start-up, writing one
per completed round (keeping only the newest few), and the model's wire bytes."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from common.core.codec import TensorSpec, digest, flat_to_bytes
from common.core.errors import ConfigError, StateError
from common.core.modelfile import ModelFile, read_model_file, write_model_file
from coordinator.optimizers import ServerOptimizer
from coordinator.store import Checkpoint, CoordinatorStore

log = logging.getLogger("medfed.coordinator")

InitialModel = Callable[[], tuple[tuple[TensorSpec, ...], np.ndarray]]
"""Builds the model round 1 starts from: the study's untrained network, or the flat
model a transport test plugs in by code (`bench.instrumented --model-dim`)."""


def load_model(
    store: CoordinatorStore,
    optimizer: ServerOptimizer,
    *,
    state: Path,
    initial: InitialModel | None = None,
) -> tuple[tuple[TensorSpec, ...], np.ndarray]:
    """Latest good checkpoint if there is one (restoring `optimizer`'s state), else the
    initial model (`initial`). A checkpoint's recorded path is relative to the state
    folder `state` (rows written by older versions hold an absolute path, which is read
    as it is)."""
    ckpt = store.latest_checkpoint()
    if ckpt is not None:
        path = state / ckpt.path
        saved = read_model_file(path)
        if digest(flat_to_bytes(saved.flat, saved.layout)).hex() != ckpt.sha256:
            raise StateError(f"checkpoint {path} does not match its recorded digest")
        optimizer.load_state_dict(dict(saved.extras))
        log.info("resuming from checkpoint of round %d", ckpt.round_number)
        return saved.layout, saved.flat
    if initial is None:
        raise ConfigError("study", "no study: serve one with --study study.toml")
    return initial()


def model_payload(layout: tuple[TensorSpec, ...], flat: np.ndarray) -> bytes | memoryview:
    """The model's wire bytes: a zero-copy view when the layout is all float32 LE."""
    if (
        all(spec.dtype == "<f4" for spec in layout)
        and flat.dtype == np.dtype("<f4")
        and flat.ndim == 1
        and flat.flags.c_contiguous
        and flat.size == sum(spec.elements for spec in layout)
    ):
        return flat.data.cast("B")
    return flat_to_bytes(flat, layout)


def write_checkpoint(
    state_dir: Path,
    round_number: int,
    *,
    layout: tuple[TensorSpec, ...],
    flat: np.ndarray,
    optimizer_name: str,
    optimizer: ServerOptimizer,
) -> Checkpoint:
    """Write the model after `round_number`; the caller records it in the store. The
    checkpoint's path is relative to `state_dir`, so a coordinator restarted from another
    working directory, or with the state folder mounted elsewhere, still finds it."""
    relative = Path("checkpoints") / f"round-{round_number:06d}.mfm"
    (state_dir / relative.parent).mkdir(parents=True, exist_ok=True)
    write_model_file(
        state_dir / relative,
        ModelFile(layout, flat, {"round": round_number, "optimizer": optimizer_name},
                  optimizer.state_dict()),
    )
    return Checkpoint(round_number, relative, digest(model_payload(layout, flat)).hex())


_CHECKPOINT_NAME = re.compile(r"^round-(\d{6,})\.mfm$")


def prune_checkpoints(state_dir: Path, *, keep: int, protected: Path | None) -> list[Path]:
    """Delete all but the newest `keep` checkpoint files, never `protected` (the one the
    store's latest record points to, relative to `state_dir`: the one a restart resumes
    from); a long study
    would otherwise fill the disk with one model per round. Returns what was deleted."""
    ckpt_dir = state_dir / "checkpoints"
    if keep < 1 or not ckpt_dir.is_dir():
        return []
    numbered: list[tuple[int, Path]] = []
    for path in ckpt_dir.iterdir():
        match = _CHECKPOINT_NAME.match(path.name)
        if match is not None and path.is_file():
            numbered.append((int(match.group(1)), path))
    numbered.sort()
    keep_resolved = None if protected is None else (state_dir / protected).resolve()
    deleted: list[Path] = []
    for _, path in numbered[: max(0, len(numbered) - keep)]:
        if keep_resolved is not None and path.resolve() == keep_resolved:
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        deleted.append(path)
    if deleted:
        log.debug("deleted %d old checkpoint(s), keeping the newest %d", len(deleted), keep)
    return deleted
