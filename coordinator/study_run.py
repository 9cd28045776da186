"""The study a coordinator runs (`coordinator serve --study study.toml`): its settings,
its initial model and its federated DP statistics, all under STATE (its model bundles:
coordinator/bundles.py).

The study file gives the model and the training settings; the coordinator's own config
keeps operational settings. STATE/study.json pins the study to the state: a coordinator
restarted on the same state with a different study refuses to start (sites have spent
budget on this one). STATE/statistics.json holds the global preprocessing statistics once
the statistics round produced them; STATE/model/round-NNNNNN.safetensors one bundle per
completed training round and STATE/model/final.safetensors the study's final model.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.core.codec import TensorSpec
from common.core.config import CoordinatorSettings, TrainingPlanSection
from common.core.errors import ConfigError, StateError, ValidationError
from common.core.fileio import atomic_write
from common.core.parsing import parse_json
from common.models import network_code_installed
from common.models.initial_file import INITIAL_MODEL_SEED, read_initial_model
from common.releases.evaluation_edges import announced_histogram_bins
from common.study import (
    GlobalStatistics,
    Study,
    check_statistics,
    intermediaries_warning,
    load_study,
    statistics_bytes,
    statistics_from_bytes,
    study_bytes,
    study_sha256,
)

log = logging.getLogger("medfed.coordinator")

FINAL_MODEL = "final.safetensors"


def _atomic_write(path: Path, data: bytes) -> None:
    try:
        atomic_write(path, data)
    except OSError as exc:
        raise StateError(f"cannot write {path}: {exc.strerror}") from None


@dataclass
class StudyRun:
    """One study on one coordinator state folder."""

    study: Study
    state: Path
    statistics: GlobalStatistics | None = None
    statistics_round: int = 0
    last_histogram: np.ndarray | None = None
    last_edges: tuple[np.ndarray, ...] = ()  # the bucket edges of last_histogram
    # The noise indication of last_histogram (NoisyHistogram.metrics), for the bundle.
    last_evaluation: dict[str, float] = field(default_factory=dict)
    # `--initial-model`: the untrained network `medfed model init` wrote (verified at
    # open), for a coordinator without torch; None: built here.
    initial_file: Path | None = None

    @property
    def canonical(self) -> bytes:
        return study_bytes(self.study)

    @property
    def sha256(self) -> str:
        return study_sha256(self.study)

    @property
    def statistics_bytes(self) -> bytes:
        return b"" if self.statistics is None else statistics_bytes(self.statistics)

    @property
    def model_dir(self) -> Path:
        return self.state / "model"

    @property
    def final_path(self) -> Path:
        return self.model_dir / FINAL_MODEL

    @classmethod
    def open(cls, path: Path, state: Path, *, initial_model: Path | None = None) -> StudyRun:
        """Load `path`; pin it to `state` (refusing another study on the same state) and
        load statistics already released for it. `initial_model` (a file `medfed model
        init` wrote) is verified against the study now, so a wrong one stops the start."""
        study = load_study(path)
        warning = intermediaries_warning(study.privacy)
        if warning is not None:  # hospital-level epsilon v-fold: said at start-up
            log.warning(warning, extra={"event": "hospital_intermediaries_warning"})
        run = cls(study=study, state=state, initial_file=initial_model)
        if initial_model is not None:
            read_initial_model(initial_model, study)
        state.mkdir(parents=True, exist_ok=True, mode=0o700)
        pinned = state / "study.json"
        if pinned.exists():
            recorded = hashlib.sha256(pinned.read_bytes()).hexdigest()
            if recorded != run.sha256:
                raise ConfigError(
                    "study",
                    f"{path} (sha256 {run.sha256[:12]}...) is not the study this state "
                    f"folder runs ({pinned}, sha256 {recorded[:12]}...): use a new --state "
                    "for a new study",
                )
        else:
            _atomic_write(pinned, run.canonical)
        saved = state / "statistics.json"
        if saved.exists():
            try:
                record = parse_json(saved.read_bytes())
                statistics = statistics_from_bytes(str(record["statistics"]).encode())
                statistics_round = int(record["round"])
            except (OSError, ValidationError, KeyError, TypeError, ValueError) as exc:
                raise StateError(
                    f"{saved} is unreadable ({exc}): it holds the study's released global "
                    "statistics (the sites release them once per study); restore it from a "
                    "backup of this state folder") from None
            check_statistics(study, statistics)
            run.statistics = statistics
            run.statistics_round = statistics_round
        return run

    def settings(self, settings: CoordinatorSettings) -> CoordinatorSettings:
        """The coordinator's settings with the study's model and training settings."""
        training = self.study.training
        # K one-vs-rest blocks for a multi-class study (site_agent.held_out.held_out_histogram).
        bins, classes = announced_histogram_bins(
            self.study.privacy.evaluation.histogram_bins,
            num_classes=len(self.study.study.classes),
        )
        return settings.model_copy(
            update={
                "rounds": self.study.study.rounds,
                "training": TrainingPlanSection(
                    local_epochs=training.local_epochs,
                    learning_rate=training.learning_rate,
                    fedprox_mu=training.fedprox_mu,
                    final_evaluation=training.final_evaluation,
                ),
                "optimizer": settings.optimizer.model_copy(
                    update={"name": training.server_optimizer,
                            "server_lr": training.server_learning_rate}
                ),
                "aggregation": settings.aggregation.model_copy(
                    update={"histogram_bins": bins, "histogram_classes": classes}
                ),
            }
        )

    def initial_model(self) -> tuple[tuple[TensorSpec, ...], np.ndarray]:
        """The study's untrained network, flattened in `named_parameters` order: read
        from `initial_file`, else built here (which needs torch)."""
        if self.initial_file is not None:
            layout, flat = read_initial_model(self.initial_file, self.study)
            log.info("round 1 starts from %s (%d parameters)", self.initial_file, flat.size,
                     extra={"event": "initial_model_file"})
            return layout, flat
        if not network_code_installed():
            raise ConfigError(
                "initial_model",
                "this coordinator has no torch to build the study's untrained network: "
                "make it where torch is installed (the site image, a workstation) with "
                "`medfed model init --study STUDY --out initial-model.safetensors` and "
                "start the coordinator with --initial-model initial-model.safetensors",
            )
        # torch: builds the network; loaded only when it is built here.
        from common.models.build import initial_model

        # torch: flattens the network; loaded only when it is built here.
        from common.models.layout import wire_model

        return wire_model(initial_model(self.study, seed=INITIAL_MODEL_SEED))

    def save_statistics(self, statistics: GlobalStatistics, round_number: int) -> None:
        check_statistics(self.study, statistics)
        record = {"round": round_number, "statistics": statistics_bytes(statistics).decode()}
        _atomic_write(self.state / "statistics.json", json.dumps(record).encode())
        self.statistics = statistics
        self.statistics_round = round_number
