"""The site's training under its study: what a site contributes to a round.

The agent asks a hook, before anything else, which DP mechanism this round would run
(`planned_segments`, so the ledger can refuse or record it write-ahead), then for the
update itself. `DpTrainingHook` trains with Opacus DP-SGD on the site's data (the
transport benchmarks and tests run a deterministic double: `bench.transport_site`).
"""

from __future__ import annotations

import datetime as dt
import importlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from common.core.codec import TensorSpec
from common.core.config import SiteSettings
from common.core.errors import ConfigError, DataError, RoundFailed
from common.privacy.accountant import Segment
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import Mechanism
from common.rounds.announcement import RoundPlan
from common.study import GlobalStatistics, Study, study_sha256
from site_agent.held_out import held_out_histogram
from site_agent.intermediaries import intermediaries_for, train_intermediaries, unit_groups
from site_agent.site_dataset import (
    SiteDataset,
    TableDataset,
    UnitSplit,
    open_site_dataset,
)
from site_agent.site_model import build_site_model, check_layout, layout_of, model_name
from site_agent.training_plan import (
    dp_sgd_budget,
    fit_batch_size,
    joined_grad_sample_choice,
    local_optimizer,
    requested_batch_size,
    round_noise_multiplier,
    site_training_config,
)
from site_agent.unit_split import site_split_key

if TYPE_CHECKING:
    from common.models import Task
    from common.releases.statistics import TableLike
    from common.study import Study
    from site_agent.data import StudyTable
    from site_agent.grad_sample_mode import GradSampleChoice

log = logging.getLogger("medfed.site")


@dataclass(frozen=True)
class LocalUpdate:
    delta: np.ndarray  # float32, new - global (already DP-noised when DP is on)
    num_samples: int
    histogram: np.ndarray  # int64, 2 * announced bins: GLOBAL model scores on held-out data
    seconds: float
    patients: int = 0
    loss: float | None = None  # mean local training loss (None: no training this round)
    # Exact records trained on, for this site's own log only (never sent: the FedAvg
    # weight is `num_samples`, a DP count when DP is on).
    records: int | None = None
    # Hospital-level DP with intermediaries: one delta per
    # disjoint unit of patients, each to be clipped alone; `delta` is their sum.
    units: tuple[np.ndarray, ...] = ()


class TrainingHook(Protocol):
    privacy_unit: str
    device: str

    def planned_segments(
        self, plan: RoundPlan, *, evaluation: Sequence[Mechanism] = ()
    ) -> list[Segment]: ...

    def train(self, plan: RoundPlan, global_flat: np.ndarray) -> LocalUpdate: ...

    def join_study(self, study: Study | None, policy: Any) -> None: ...

    def statistics_release(self) -> np.ndarray: ...

    def set_statistics(self, statistics: GlobalStatistics) -> None: ...

    @property
    def table(self) -> TableLike | None:
        """The joined study's table (every row of the site's file), what an approved
        query is answered on; None for an image folder or before joining."""


def check_training_split(
    study: Study, dataset: SiteDataset, settings: SiteSettings, *, path: Path
) -> None:
    """The cohort rule (`site_agent.data.check_cohort_size`) on the units DP-SGD will
    actually train on, when a site joins `study`: the held-out split varies around its
    expected size (each unit is held out with probability data.holdout_fraction), so a
    site that passed on the expected count could otherwise stop at its first training
    round and abort that round for every site. Local: nothing is sent. Nothing to check
    where no DP-SGD runs (hospital-level DP with record_level "none")."""
    from site_agent.data import check_cohort_size

    if study.privacy.unit == "hospital":
        unit = study.privacy.record_level
        if unit == "none":
            return
    else:
        unit = "patient" if dataset.has_patients else "record"
    units = dataset.training_units(unit=unit)
    fraction = settings.data.holdout_fraction
    try:
        check_cohort_size(units, delta=settings.privacy.delta, unit=unit, file=str(path))
    except DataError as exc:
        raise DataError(
            f"{exc.message} in this site's training split ({units} {unit}s are left once "
            f"data.holdout_fraction {fraction:g} holds some out for evaluation, by this "
            f"site's split key): add {unit}s or lower data.holdout_fraction",
            file=str(path),
        ) from None


class DpTrainingHook:
    """Opacus DP-SGD (or non-private, for baselines) on this site's own data.

    It trains only under a study (the coordinator sends it at enrolment); nothing is
    read before `join_study`: the site's file is checked against the study there, before
    any key or update is sent, and encoded with the federation's global statistics once
    the statistics release produced them (`set_statistics`). A coordinator serving no
    study is refused at enrolment (`join_study(None)`), as is one serving a study other
    than the one this site approved (`site_agent.study_gate`, at enrolment).

    The trainer, and so the noise multiplier, is built at the first round from the
    announced planned rounds and local epochs, with this site's budget as its target
    epsilon: calibrated once for the whole planned schedule (docs/privacy.md, "2. How
    noise is calibrated"); with a ledger attached the site re-plans its noise every round
    from what it has spent.
    """

    def __init__(self, settings: SiteSettings, *, dp: bool) -> None:
        from site_agent.device import select_device

        # torch and Opacus load now, not in the first round's noise planning, where the
        # import would compete with the key phases for the interpreter.
        importlib.import_module("site_agent.trainer")

        self.settings = settings
        self.dp = dp
        self.device = str(select_device(settings.training.device))
        if dp and settings.training.seed is not None:
            # Whoever knows the configuration can regenerate the noise and subtract it.
            log.warning(
                "training.seed is set: the DP noise is reproducible and protects nothing "
                "(tests only; leave it unset in production)"
            )
        self.study: Study | None = None
        # The site's data under the joined study (`site_agent.site_dataset`), and its
        # split by unit once made (a table's needs the global statistics).
        self.dataset: SiteDataset | None = None
        self.statistics: GlobalStatistics | None = None
        self.train_data: Any = None
        self.holdout: Any = None
        self.n_features: int | None = None
        self.patients = 0
        self.joined = False
        self.privacy_unit = "none" if not dp else "pending"
        self.hospital = False
        self.task: Task = "binary"
        self.num_classes = 2
        # One-vs-rest blocks in the evaluation histogram: the ledger's sensitivity.
        self.histogram_classes = 1
        self._layout: tuple[TensorSpec, ...] | None = None
        self.model_name = model_name(None)
        self._trainer: object | None = None
        self._trainer_key: tuple[int, int] | None = None
        # `auto`'s record-level DP path, chosen at join when the dataset `measure_at_join`.
        self._dp_path: GradSampleChoice | None = None
        # Set by `attach_ledger`; then q, steps, weights and gauges come from
        # the DP count and the noise from the site's own plan over its ledger.
        self.ledger: PrivacyLedger | None = None
        self._ledger_state: Path | None = None
        self.released_units: int | None = None
        self._planned: dict[int, float] = {}

    # ------------------------------------------------------------------ joining
    def join_study(self, study: Study | None, policy: Any) -> None:
        """Check this site's data against `study` (DataError / PrivacyError before
        anything is sent); the agent let it through only as the study this site approved
        (`site_agent.study_gate`). Without a study, a ConfigError saying what to pass:
        this site trains only a study."""
        if study is None:
            raise ConfigError(
                "study",
                "the coordinator serves no study, and a site trains only under one: start "
                "the coordinator with `coordinator serve --study study.toml` (drafted with "
                "`medfed study init`); each site approves it (`medfed site approve "
                "study.toml`) and joins it with --data FILE",
            )
        if self.study is not None and study_sha256(self.study) == study_sha256(study):
            return
        from site_agent.datacheck import check_site_can_join

        path = self.settings.data.path
        if path is None:
            raise ConfigError(
                "data.path", "the coordinator runs a study: name this site's file with --data"
            )
        report = check_site_can_join(study, policy, path)
        dataset = open_site_dataset(study, self.settings, path=path, dp=self.dp)
        if self.dp:
            check_training_split(study, dataset, self.settings, path=path)
        self._use_study(study)
        self.statistics = None
        self.train_data = None
        self._trainer = None
        self.joined = True
        self._dp_path = None
        self.dataset = dataset
        if self.dp:
            self.privacy_unit = (
                "hospital" if self.hospital else "patient" if dataset.has_patients else "record"
            )
        if not dataset.needs_statistics:
            # Pixels need no global statistics: the folder trains as soon as it is checked.
            self._use_split(dataset.split(None))
        # The study's model, built and DP-checked here (ModuleValidator names the layer
        # and the fix) before this site sends any key or update.
        model = self.model()
        self._layout = layout_of(model)
        if dataset.measure_at_join and self.dp_sgd and "patient" not in (
                self.privacy_unit, self.record_level):
            # Record-level DP-SGD's path, measured now (once per study), not in a round.
            self._dp_path = joined_grad_sample_choice(
                self.settings, study, model=model, record_shape=tuple(self.train_data.shape),
                device=self.device)
        log.info(
            "study %s joined: %d records, %s patients, missing values %s", study.study.name,
            report.records, report.patients, {k: v for k, v in report.missing.items() if v},
            extra={"event": "study_joined", "records": report.records},
        )

    @property
    def table(self) -> StudyTable | None:
        """Every row of the site's file as read under the joined study, what a federated
        query is answered on (`common.releases.analytics`); None for an image folder or before
        the site joined a study."""
        return self.dataset.table if isinstance(self.dataset, TableDataset) else None

    def statistics_release(self) -> np.ndarray:
        """This site's noiseless integer contribution to the study's statistics release
        (`statistics_contribution`; the agent adds the noise)."""
        if self.dataset is None:
            raise RoundFailed("a statistics round needs a study this site joined")
        return self.dataset.statistics_contribution()

    def set_statistics(self, statistics: GlobalStatistics) -> None:
        """Split this site's records once the federation's global statistics encode them
        (a dataset that `needs_statistics`; a folder was split when it was joined)."""
        if self.dataset is None or self.statistics == statistics:
            return
        if self.dataset.needs_statistics:
            self._use_split(self.dataset.split(statistics))
        self.statistics = statistics

    def _use_study(self, study: Study) -> None:
        """Task, classes and model name from the study this site trains."""
        self.study = study
        # Hospital-level DP: the whole update is clipped and noised in the
        # ring (site_agent.hospital); DP-SGD runs beneath only with privacy.record_level.
        self.hospital = study.privacy.unit == "hospital"
        self.task = study.study.task
        self.num_classes = len(study.study.classes)
        self.histogram_classes = self.num_classes if self.num_classes > 2 else 1
        self.model_name = model_name(study)
        self._layout = None

    def _use_split(self, split: UnitSplit) -> None:
        """Train on `split` from the next round (the DP count re-released on it)."""
        self.train_data, self.holdout = split.train, split.holdout
        self.n_features, self.patients = split.in_features, split.patients
        self._trainer = None
        if self.ledger is not None and self._ledger_state is not None:
            self.attach_ledger(self.ledger, state=self._ledger_state)

    def _ready(self) -> Study:
        """The joined study, once this site's records are split for it."""
        if self.study is None:
            raise RoundFailed("no study joined")
        if self.train_data is None:
            raise RoundFailed(
                "no global statistics yet: the study's statistics release comes first"
            )
        return self.study

    @property
    def record_level(self) -> str:
        """DP-SGD beneath hospital-level DP: the study's privacy.record_level ("none",
        "record" or "patient"); "none" outside hospital mode (DP-SGD is then the unit's)."""
        if not (self.hospital and self.dp and self.study is not None):
            return "none"
        return self.study.privacy.record_level

    @property
    def dp_sgd(self) -> bool:
        """Whether local training runs Opacus DP-SGD (patient-level: site_agent.patient_dp)."""
        return self.dp and (not self.hospital or self.record_level != "none")

    @property
    def grad_sample_choice(self) -> Any:
        """The record-level DP path (`GradSampleChoice`): the trainer's, or before the
        first trainer the one `auto` measured when the study was joined; None for
        patient-level and non-private training."""
        return getattr(self._trainer, "grad_sample_choice", None) or self._dp_path

    @property
    def units(self) -> int:
        """This site's privacy units (never leaves the site; see `released_units`)."""
        if self.privacy_unit == "patient" or (
            self.hospital and self.record_level != "record"
            and getattr(self.train_data, "patient_ids", None) is not None
        ):
            return int(self.train_data.num_patients)
        return len(self.train_data)

    def attach_ledger(self, ledger: PrivacyLedger, *, state: Path) -> None:
        """Release (once, persisted) the DP count of units and plan noise on `ledger`.

        Under a study the training units are known once the global statistics arrived
        (`set_statistics` calls this again then)."""
        from site_agent.dp_release import release_cohort_count

        self.ledger = ledger
        self._ledger_state = state
        if not self.dp or self.train_data is None:
            return
        # Every site spends the study's count_epsilon (checked against this site's limit,
        # privacy.count_epsilon, when it joined).
        if self.study is None:
            raise RoundFailed("no study joined")
        epsilon = self.study.privacy.count_epsilon
        count = release_cohort_count(
            ledger, units=self.units, epsilon=epsilon, state=state, now=dt.datetime.now(dt.UTC),
        )
        self.released_units = count.noisy_count

    def model(self) -> Any:
        """A fresh network of the model this site trains (`build_site_model`)."""
        return build_site_model(self.study, self.settings, in_features=self.n_features)

    def layout(self) -> tuple[TensorSpec, ...]:
        if self._layout is None:
            self._layout = layout_of(self.model())
        return self._layout

    def trainer_for(self, plan: RoundPlan) -> Any:
        from site_agent.trainer import LocalTrainer

        study = self._ready()
        planned = self.ledger is not None and self.released_units is not None
        # With a ledger the noise is re-planned every round (`planned_segments`), so the
        # announced planned_rounds no longer shapes the trainer.
        key = (1 if planned else plan.planned_rounds, max(plan.local_epochs, 1))
        if self._trainer is None or self._trainer_key != key:
            config = site_training_config(
                self.settings, plan, local_epochs=key[1],
                batch_size=fit_batch_size(
                    requested_batch_size(study),
                    units=self.released_units if self.released_units is not None
                    else self.units,
                ),
                optimizer=local_optimizer(study),
                target_epsilon=self._dp_sgd_budget(self.settings.privacy.budget_epsilon),
                dp=self.dp_sgd,
                privacy_unit="patient" if "patient" in (self.privacy_unit, self.record_level)
                else ("record" if self.dp_sgd else "auto"),
                task=self.task, num_classes=self.num_classes,
                released_units=self.released_units, planned=planned,
            )
            seed = self.settings.training.seed
            if seed is None:
                # Sampling and noise seeds from the OS CSPRNG, so nobody can predict the
                # DP noise from the configuration (torch's generators hold 64 bits).
                seed = int.from_bytes(os.urandom(8), "big") >> 1
            self._trainer = LocalTrainer(self.model, self.train_data, config, seed=seed,
                                         grad_sample_choice=self._dp_path)
            self._trainer_key = key
        return self._trainer

    def planned_segments(
        self, plan: RoundPlan, *, evaluation: Sequence[Mechanism] = ()
    ) -> list[Segment]:
        """This round's DP-SGD mechanisms, its noise planned from the ledger with
        `evaluation` (the round's DP evaluation release) reserved in every round left."""
        if plan.local_epochs == 0 or not self.dp_sgd:
            return []
        trainer = self.trainer_for(plan)
        if self.ledger is not None and self.released_units is not None:
            sigma = self._planned.get(plan.round_number)
            if sigma is None:
                sigma = round_noise_multiplier(
                    self.ledger, settings=self.settings, plan=plan,
                    sample_rate=trainer.sample_rate, steps_per_epoch=trainer.steps_per_epoch,
                    evaluation=evaluation, study=self.study, record_level=self.record_level,
                )
                self._planned = {plan.round_number: sigma}
            trainer.set_noise_multiplier(sigma)
        segments: list[Segment] = trainer.planned_segments(plan.local_epochs)
        return segments

    def _dp_sgd_budget(self, budget: float) -> float:
        """DP-SGD's target for this site's `budget` (`dp_sgd_budget`)."""
        return dp_sgd_budget(budget, record_level=self.record_level, study=self.study)

    def train(self, plan: RoundPlan, global_flat: np.ndarray) -> LocalUpdate:
        self._ready()
        check_layout(self.layout(), plan.layout)
        started = time.perf_counter()
        # Evaluate the GLOBAL model on held-out data before training: its score
        # histogram rides along in the secure sum (the federation's ROC, not ours).
        histogram = self.evaluate(plan, global_flat)
        released = self.released_units if self.released_units is not None else None
        patients = released if released is not None else self.patients
        if plan.local_epochs == 0:
            delta = np.zeros_like(global_flat, dtype=np.float32)
            return LocalUpdate(delta, 0, histogram, time.perf_counter() - started, patients)
        if self.hospital and self.intermediaries_for(plan) > 1:
            return self._train_units(plan, global_flat, histogram, started, patients)
        result = self.trainer_for(plan).train_round(
            global_flat,
            local_epochs=plan.local_epochs,
            lr=plan.learning_rate,
            fedprox_mu=plan.fedprox_mu,
        )
        return LocalUpdate(
            result.delta_flat,
            # The FedAvg weight: the DP count, never the exact number of records.
            released if released is not None else result.num_samples,
            histogram,
            time.perf_counter() - started,
            patients,
            loss=result.mean_loss,
            records=result.num_samples,
        )


    @property
    def intermediaries(self) -> int:
        """v of the study's fixed `privacy.intermediaries` (1 under "auto" before a
        round announces one: `intermediaries_for`)."""
        if self.study is None or not self.hospital:
            return 1
        v = self.study.privacy.intermediaries
        return v if isinstance(v, int) else 1

    def intermediaries_for(self, plan: RoundPlan) -> int:
        """v this hospital trains in `plan`'s round (`intermediaries.intermediaries_for`)."""
        return intermediaries_for(
            self.study, plan, hospital=self.hospital, released_units=self.released_units
        )

    def unit_groups(self, v: int) -> list[np.ndarray]:
        """Record indices of v disjoint intermediaries of the training split, fixed by the
        site's secret split key (`intermediaries.unit_groups`)."""
        return unit_groups(self.train_data, v=v, site_key=site_split_key(self.settings.state))

    def _train_units(self, plan: RoundPlan, global_flat: np.ndarray, histogram: np.ndarray,
                     started: float, patients: int) -> LocalUpdate:
        """Hospital-level DP with intermediaries: each unit trains from the global model
        on its own patients (`train_intermediaries`); the agent clips and rounds each
        delta alone (site_agent.hospital)."""
        base = self.trainer_for(plan)
        deltas, losses, records = train_intermediaries(
            self.unit_groups(self.intermediaries_for(plan)), data=self.train_data,
            model_factory=self.model, base_config=base.config,
            requested_batch_size=requested_batch_size(self._ready()),
            plan=plan, global_flat=global_flat,
        )
        total = np.sum(deltas, axis=0).astype(np.float32)
        return LocalUpdate(
            total, len(deltas), histogram, time.perf_counter() - started, patients,
            loss=float(np.mean(losses)) if losses else None, records=records,
            units=tuple(deltas),
        )

    def evaluate(self, plan: RoundPlan, global_flat: np.ndarray) -> np.ndarray:
        """Held-out score histogram of the global model (`held_out_histogram`), one score
        per privacy unit under patient- or hospital-level privacy."""
        from common.models.layout import load_flat_parameters

        probe = self.model()
        load_flat_parameters(probe, global_flat)
        probe.to(self.device)
        return held_out_histogram(
            probe, self.holdout, plan,
            per_unit=self.privacy_unit in ("patient", "hospital"),
            device=self.device, task=self.task, num_classes=self.num_classes,
        )
