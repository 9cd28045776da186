"""Checkpoint retention: only the newest `checkpoints.keep` files stay on disk, and the
one the state database resumes from is never deleted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.instrumented import flat_model
from common.core.config import CoordinatorSettings, load_settings
from common.core.modelfile import flat_layout
from coordinator.checkpoints import load_model, prune_checkpoints, write_checkpoint
from coordinator.optimizers import build_optimizer
from coordinator.store import CoordinatorStore


def _settings(tmp_path: Path, **extra: object) -> CoordinatorSettings:
    return load_settings(
        CoordinatorSettings,
        overrides={"pki": tmp_path, "state": tmp_path, **extra},
    )


def _complete_rounds(tmp_path: Path, store: CoordinatorStore, rounds: range, *,
                     keep: int, record: bool = True) -> None:
    settings = _settings(tmp_path)
    optimizer = build_optimizer(settings.optimizer)
    for number in rounds:
        flat = np.full(4, float(number), dtype=np.float32)
        ckpt = write_checkpoint(tmp_path, number, layout=flat_layout(4), flat=flat,
                                optimizer_name="fedavg", optimizer=optimizer)
        if record:
            store.begin_round(number, ["a", "b"], now=float(number))
            store.finish_round(number, status="completed", now=float(number), checkpoint=ckpt)
        latest = store.latest_checkpoint()
        prune_checkpoints(tmp_path, keep=keep,
                          protected=None if latest is None else latest.path)


def _on_disk(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "checkpoints").iterdir())


def test_default_keeps_three(tmp_path: Path) -> None:
    assert _settings(tmp_path).checkpoints.keep == 3
    assert _settings(tmp_path, checkpoints={"keep": 5}).checkpoints.keep == 5


def test_only_the_newest_files_stay_and_the_model_resumes(tmp_path: Path) -> None:
    store = CoordinatorStore(f"sqlite:///{tmp_path / 'coordinator.db'}")
    try:
        _complete_rounds(tmp_path, store, range(1, 8), keep=3)
        assert _on_disk(tmp_path) == ["round-000005.mfm", "round-000006.mfm",
                                      "round-000007.mfm"]
        settings = _settings(tmp_path)
        _, flat = load_model(store, build_optimizer(settings.optimizer), state=tmp_path,
                             initial=flat_model(4))
        assert flat.tolist() == [7.0] * 4
    finally:
        store.close()


def test_the_checkpoint_the_store_resumes_from_is_never_deleted(tmp_path: Path) -> None:
    store = CoordinatorStore(f"sqlite:///{tmp_path / 'coordinator.db'}")
    try:
        _complete_rounds(tmp_path, store, range(1, 3), keep=1)
        assert _on_disk(tmp_path) == ["round-000002.mfm"]
        # Files newer than the latest record (written, then the coordinator died before
        # recording them) push round 2 out of the newest `keep`, yet it stays.
        _complete_rounds(tmp_path, store, range(3, 6), keep=1, record=False)
        assert _on_disk(tmp_path) == ["round-000002.mfm", "round-000005.mfm"]
        settings = _settings(tmp_path)
        _, flat = load_model(store, build_optimizer(settings.optimizer), state=tmp_path,
                             initial=flat_model(4))
        assert flat.tolist() == [2.0] * 4
    finally:
        store.close()


def test_other_files_in_the_folder_are_left_alone(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "operator-copy.mfm").write_bytes(b"x")
    (folder / "round-000001.mfm.tmp").write_bytes(b"x")
    assert prune_checkpoints(tmp_path, keep=1, protected=None) == []
    assert _on_disk(tmp_path) == ["operator-copy.mfm", "round-000001.mfm.tmp"]


def test_a_restart_from_another_working_directory_finds_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started as `--state coord-state` in one folder, restarted from another with the
    state folder's absolute path: the recorded checkpoint is relative to the state
    folder, not to the first process's working directory."""
    first_cwd = tmp_path / "ops"
    (first_cwd / "coord-state").mkdir(parents=True)
    monkeypatch.chdir(first_cwd)
    state = Path("coord-state")
    store = CoordinatorStore(f"sqlite:///{state / 'coordinator.db'}")
    try:
        settings = _settings(state)
        ckpt = write_checkpoint(state, 1, layout=flat_layout(4),
                                flat=np.full(4, 1.5, dtype=np.float32),
                                optimizer_name="fedavg",
                                optimizer=build_optimizer(settings.optimizer))
        store.begin_round(1, ["a", "b"], now=1.0)
        store.finish_round(1, status="completed", now=1.0, checkpoint=ckpt)
    finally:
        store.close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    absolute = first_cwd / "coord-state"
    reopened = CoordinatorStore(f"sqlite:///{absolute / 'coordinator.db'}")
    try:
        recorded = reopened.latest_checkpoint()
        assert recorded is not None
        assert recorded.path == Path("checkpoints/round-000001.mfm")
        settings = _settings(absolute)
        _, flat = load_model(reopened, build_optimizer(settings.optimizer), state=absolute,
                             initial=flat_model(4))
        assert flat.tolist() == [1.5] * 4
    finally:
        reopened.close()
