"""The study a coordinator runs (`coordinator serve --study study.toml`): its settings,
its initial model, its federated DP statistics and its model bundles, all under STATE.

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
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.bundle import (
    GroupGuarantee,
    ModelBundle,
    PrivacyCard,
    SecAggCard,
    SitePrivacy,
    Threshold,
    architecture_from_study,
    parameters_from_flat,
    threshold_from_histogram,
    write_bundle,
)
from common.codec import TensorSpec
from common.config import CoordinatorSettings, TrainingPlanSection
from common.errors import ConfigError, StateError
from common.privacy.federation import SiteBudget as BudgetRow
from common.study import (
    GlobalStatistics,
    Study,
    check_statistics,
    load_study,
    statistics_bytes,
    statistics_from_bytes,
    study_bytes,
    study_sha256,
)

log = logging.getLogger("medfed.coordinator")

INITIAL_MODEL_SEED = 0
"""The initial weights are public: every coordinator builds the same ones for a study."""

FINAL_MODEL = "final.safetensors"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
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
    def open(cls, path: Path, state: Path) -> StudyRun:
        """Load `path`; pin it to `state` (refusing another study on the same state) and
        load statistics already released for it."""
        study = load_study(path)
        run = cls(study=study, state=state)
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
            record = json.loads(saved.read_text())
            statistics = statistics_from_bytes(record["statistics"].encode())
            check_statistics(study, statistics)
            run.statistics = statistics
            run.statistics_round = int(record["round"])
        return run

    def settings(self, settings: CoordinatorSettings) -> CoordinatorSettings:
        """The coordinator's settings with the study's model and training settings."""
        from common.evaluation import announced_histogram_bins

        training = self.study.training
        # K one-vs-rest blocks for a multi-class study (site_agent.hooks.evaluate).
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
        """The study's untrained network, flattened in `named_parameters` order."""
        from site_agent.models import flatten_parameters
        from site_agent.predict import initial_model

        model = initial_model(self.study, seed=INITIAL_MODEL_SEED)
        layout = tuple(
            TensorSpec(name, "<f4", tuple(int(d) for d in p.shape))
            for name, p in model.named_parameters()
        )
        return layout, flatten_parameters(model).astype(np.float32)

    def save_statistics(self, statistics: GlobalStatistics, round_number: int) -> None:
        check_statistics(self.study, statistics)
        record = {"round": round_number, "statistics": statistics_bytes(statistics).decode()}
        _atomic_write(self.state / "statistics.json", json.dumps(record).encode())
        self.statistics = statistics
        self.statistics_round = round_number

    def bundle(
        self,
        *,
        round_number: int,
        layout: tuple[TensorSpec, ...],
        flat: np.ndarray,
        settings: CoordinatorSettings,
        budgets: list[BudgetRow],
        final: bool,
        secagg: tuple[int, int] = (0, 0),
        hospital_epsilons: Mapping[str, tuple[float, float]] | None = None,
    ) -> Path:
        """Write the bundle of the global model after `round_number` (and, when `final`,
        STATE/model/final.safetensors); returns its path."""
        if self.statistics is None:
            raise StateError("no statistics yet: a bundle needs the global preprocessing")
        bins = settings.aggregation.histogram_bins
        if self.study.study.task != "binary":
            threshold = Threshold(value=None, method="argmax")
        elif self.last_histogram is not None and self.last_histogram.sum() > 0:
            threshold = threshold_from_histogram(self.last_histogram, bins=bins)
        else:
            threshold = Threshold(value=0.5, method="fixed")
        agg = settings.aggregation
        hospital_card = hospital_card_parts(self.study, hospital_epsilons or {})
        card = PrivacyCard(
            unit=self.study.privacy.unit,
            accountant="per-site ledger",
            mechanisms=hospital_card_parts_mechanisms(self.study) or (
                "sampled-gaussian (DP-SGD, per-unit clipping)",
                "distributed-discrete-gaussian (federated statistics, once per study)",
            ),
            group_guarantees=hospital_card[0],
            rounds=round_number,
            sites=tuple(
                SitePrivacy(site=row.site_id, epsilon=row.spent_epsilon, delta=row.delta)
                for row in budgets
            ),
            secagg=SecAggCard(
                threshold=max(1, secagg[0]),
                neighbours=secagg[1] or None,
                max_colluding_sites=agg.max_colluding_sites,
                ring_bits=32,
                clip=agg.clip,
            ) if agg.secure_aggregation else None,
            statistics_release=self.statistics.source,
            notes=("SecAgg+ threshold and neighbours of the last round (neighbours none: "
                   "complete graph)", *hospital_card[1]),
        )
        bundle = ModelBundle(
            study=self.study,
            architecture=architecture_from_study(self.study),
            statistics=self.statistics,
            threshold=threshold,
            card=card,
            parameters=parameters_from_flat([(s.name, s.shape) for s in layout], flat),
            round=round_number,
            final=final,
        )
        self.model_dir.mkdir(parents=True, exist_ok=True)
        path = self.model_dir / f"round-{round_number:06d}.safetensors"
        write_bundle(path, bundle)
        if final:
            write_bundle(self.final_path, bundle)
            log.info("final model stored at %s", self.final_path)
        return path


def hospital_card_parts_mechanisms(study: Study) -> tuple[str, ...]:
    """The card's mechanisms under hospital-level DP (empty for record/patient)."""
    if study.privacy.unit != "hospital":
        return ()
    return (
        "distributed-discrete-gaussian (hospital-level: each site's whole update clipped "
        "to L2 <= S and noised by the sites in the SecAgg+ ring; Kairouz, Liu & Steinke "
        "2021)",
        "distributed-discrete-gaussian (federated statistics, once per study)",
    )


def hospital_card_parts(
    study: Study, epsilons: Mapping[str, tuple[float, float]]
) -> tuple[tuple[GroupGuarantee, ...], tuple[str, ...]]:
    """(group guarantees, notes) naming the two guarantees of a hospital-level study:
    `sites[].epsilon` composes every release (a per-patient bound); the hospital-level
    epsilon covers the model updates only."""
    if study.privacy.unit != "hospital":
        return (), ()
    from common.privacy.hospital import study_terms

    terms = study_terms(study)
    guarantees = tuple(
        GroupGuarantee(
            unit="hospital", epsilon=epsilon, delta=delta,
            note=(f"site {site}: model updates only (clip S = {terms.clip:g}, noise "
                  f"multiplier {terms.noise_multiplier:.3g}"
                  + (f", {terms.intermediaries} intermediaries: {terms.intermediaries}-fold "
                     "group privacy of the per-intermediary guarantee"
                     if terms.intermediaries > 1 else "")
                  + "); statistics, evaluation histograms and the cohort count are "
                  "bounded per patient"),
        )
        for site, (epsilon, delta) in sorted(epsilons.items())
    )
    notes = (
        "hospital-level DP: the group guarantees (unit hospital) cover the MODEL UPDATES "
        "ONLY; sites[].epsilon composes every release and is the per-patient guarantee",
    )
    return guarantees, notes
