"""Training hooks: what a site contributes to a round.

The agent asks a hook, before anything else, which DP mechanism this round would run
(`planned_segments`, so the ledger can refuse or record it write-ahead), then for the
update itself. `DeterministicTestHook` is for tests and benchmarks of the transport;
`DpTrainingHook` trains with Opacus DP-SGD on the site's data.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from common.codec import TensorSpec
from common.config import SiteSettings
from common.errors import ConfigError, RoundFailed
from common.privacy.accountant import Segment
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import Mechanism
from common.round import RoundPlan
from common.study import GlobalStatistics, Study, study_sha256

if TYPE_CHECKING:
    from common.models import Task
    from common.study import Study

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
    # Hospital-level DP with intermediaries (issue 13, section 2): one delta per
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


class DeterministicTestHook:
    """TEST ONLY: an update derived from (site, round), no data, no privacy cost.

    Lets transport and fault tests check the coordinator's unmasked sum exactly.
    """

    privacy_unit = "none"
    device = "cpu"

    def __init__(self, site_id: str, *, scale: float = 0.5, samples: int = 100,
                 train_seconds: float = 0.0) -> None:
        self.site_id = site_id
        self.scale = scale
        self.samples = samples
        # Liveness tests freeze or cut off a site while it "trains": give them a window.
        self.train_seconds = train_seconds
        self.study: Study | None = None

    def join_study(self, study: Study | None, policy: Any) -> None:
        self.study = study

    def statistics_release(self) -> np.ndarray:
        from common.statistics import statistics_length

        if self.study is None:
            raise RoundFailed("a statistics round needs a study")
        return np.zeros(statistics_length(self.study), dtype=np.int64)

    def set_statistics(self, statistics: GlobalStatistics) -> None:
        return None

    def planned_segments(
        self, plan: RoundPlan, *, evaluation: Sequence[Mechanism] = ()
    ) -> list[Segment]:
        return []

    def train(self, plan: RoundPlan, global_flat: np.ndarray) -> LocalUpdate:
        if self.train_seconds:
            time.sleep(self.train_seconds)
        seed = hashlib.sha256(f"{self.site_id}/{plan.round_number}".encode()).digest()
        gen = np.random.Generator(np.random.PCG64(int.from_bytes(seed[:8], "big")))
        # Drawn as float32 and scaled in place: one model-sized vector, like a real
        # trainer's update (a float64 draw would add two models to the site's peak).
        delta = gen.random(global_flat.size, dtype=np.float32)
        delta *= np.float32(2 * self.scale)
        delta -= np.float32(self.scale)
        hist = gen.integers(0, 5, size=2 * plan.histogram_bins).astype(np.int64)
        return LocalUpdate(delta, self.samples, hist, 0.0)


class DpTrainingHook:
    """Opacus DP-SGD (or non-private, for baselines) on this site's own data.

    With a study (the coordinator sends it at enrolment), nothing is read before
    `join_study`: the site's file is checked against the study there, before any key or
    update is sent, and encoded with the federation's global statistics once the
    statistics release produced them (`set_statistics`). Without a study (transport
    tests, the legacy demo), `join_study(None)` loads the file under the site config's
    schema, or the synthetic cohort when the site asked for it explicitly.

    The trainer, and so the noise multiplier, is built at the first round from the
    announced planned rounds and local epochs, with this site's budget as its target
    epsilon: calibrated once for the whole planned schedule (DESIGN.md "Privacy"); with
    a ledger attached the site re-plans its noise every round from what it has spent.
    """

    def __init__(self, settings: SiteSettings, *, dp: bool, study: Study | None = None) -> None:
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
        # A study file of the site's own (`study_file`): used when the coordinator sends
        # none (the legacy path), e.g. an images study under `coordinator --config`.
        self.local_study = study if study is not None else load_site_study(settings)
        self.table: Any = None
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
        self.model_name = model_name(self.local_study, settings)
        self._image_units = 0
        self._trainer: object | None = None
        self._trainer_key: tuple[int, int] | None = None
        # Issue 10: set by `attach_ledger`; then q, steps, weights and gauges come from
        # the DP count and the noise from the site's own plan over its ledger.
        self.ledger: PrivacyLedger | None = None
        self._ledger_state: Path | None = None
        self.released_units: int | None = None
        self._planned: dict[int, float] = {}

    # ------------------------------------------------------------------ joining
    def join_study(self, study: Study | None, policy: Any) -> None:
        """Check this site's data against `study` (DataError / PrivacyError before
        anything is sent), or load it the legacy way when there is no study."""
        if study is None:
            if not self.joined:
                self._load_legacy()
            return
        if self.study is not None and study_sha256(self.study) == study_sha256(study):
            return
        from site_agent.data import load_study_table
        from site_agent.datacheck import check_site_can_join

        path = self.settings.data.path
        if path is None:
            raise ConfigError(
                "data.path", "the coordinator runs a study: name this site's file with --data"
            )
        report = check_site_can_join(study, policy, path)
        self._use_study(study)
        self.statistics = None
        self.train_data = None
        self._trainer = None
        self.joined = True
        if study.data.kind == "images":
            # Pixels need no global statistics: the folder trains as soon as it is checked.
            self._set_images(load_configured_data(self.settings, study))
        else:
            self.table = load_study_table(path, study)
            if self.dp:
                self.privacy_unit = (
                    "hospital" if self.hospital
                    else "patient" if self.table.patient_ids is not None else "record"
                )
        # The study's model, built and DP-checked here (ModuleValidator names the layer
        # and the fix) before this site sends any key or update.
        self._layout = _layout_of(self.model())
        log.info(
            "study %s joined: %d records, %s patients, missing values %s", study.study.name,
            report.records, report.patients, {k: v for k, v in report.missing.items() if v},
            extra={"event": "study_joined", "records": report.records},
        )

    def statistics_release(self) -> np.ndarray:
        """This site's noiseless integer contribution to the study's statistics release
        (common/statistics.py; the agent adds the noise)."""
        from common.crypto.random import numpy_generator, system_random
        from common.statistics import encode_release

        if self.study is not None and self.study.data.kind == "images":
            from common.statistics import statistics_length

            # An images study has no features: its release is the unit count alone.
            units = np.zeros(statistics_length(self.study), dtype=np.int64)
            units[0] = self._image_units
            return units
        if self.study is None or self.table is None:
            raise RoundFailed("a statistics round needs a study this site joined")
        gen = numpy_generator(system_random)
        return encode_release(self.table, self.study, uniform=lambda n: gen.random(n))

    def set_statistics(self, statistics: GlobalStatistics) -> None:
        """Encode this site's records with the federation's global statistics."""
        from site_agent.data import Preprocessor, check_cohort_size, split_by_patient

        if self.study is None or self.statistics == statistics:
            return
        if self.study.data.kind == "images":
            self.statistics = statistics  # pixels are scaled by fixed rules (imaging.py)
            return
        pre = Preprocessor(self.study, statistics)
        data = pre.site_data(self.table)
        if self.dp:
            unit = "patient" if data.patient_ids is not None else "record"
            check_cohort_size(data.num_patients, delta=self.settings.privacy.delta, unit=unit,
                              file=str(self.settings.data.path))
        imputed = pre.imputations(self.table)
        if imputed:
            log.info("imputed with the global statistics: %s", imputed)
        self.train_data, self.holdout = split_by_patient(
            data, held_out_fraction=self.settings.data.holdout_fraction,
            seed=self.settings.data.split_seed,
        )
        self.statistics = statistics
        self.n_features = int(data.features.shape[1])
        self.patients = self.train_data.num_patients if data.patient_ids is not None else 0
        self._trainer = None
        if self.ledger is not None and self._ledger_state is not None:
            self.attach_ledger(self.ledger, state=self._ledger_state)

    def _load_legacy(self) -> None:
        from site_agent.data import prepare_site_split
        from site_agent.imaging import ImageDataset

        settings = self.settings
        if self.local_study is not None:
            self._use_study(self.local_study)
        data = load_configured_data(settings, self.local_study)
        if isinstance(data, ImageDataset):
            self._set_images(data)
        else:
            self.train_data, self.holdout, _ = prepare_site_split(
                data, held_out_fraction=settings.data.holdout_fraction,
                seed=settings.data.split_seed,
            )
            has_patients = data.patient_ids is not None
            unit = settings.privacy.privacy_unit
            if not self.dp:
                self.privacy_unit = "none"
            elif unit == "auto":
                self.privacy_unit = "patient" if has_patients else "record"
            else:
                self.privacy_unit = unit
            # Hospital-level DP by the site's own setting or study file: no DP-SGD beneath.
            self.hospital = self.hospital or self.privacy_unit == "hospital"
            if self.hospital and self.dp:
                self.privacy_unit = "hospital"
            self.n_features = int(data.features.shape[1])
            self.patients = self.train_data.num_patients if has_patients else 0
        self.joined = True
        if self.privacy_unit == "record":
            log.warning(
                "record-level DP: no patient column, so each encounter (not each patient) "
                "is the privacy unit"
            )
        # Built once now: an unknown, disallowed or DP-incompatible model stops the site
        # at start-up with the layer and the fix named (ModuleValidator), not mid-round.
        self._layout = _layout_of(self.model())

    def _use_study(self, study: Study) -> None:
        """Task, classes and model name from the study this site trains."""
        self.study = study
        # Hospital-level DP (issue 13): the whole update is clipped and noised in the
        # ring (site_agent.hospital); DP-SGD runs beneath only with privacy.record_level.
        self.hospital = study.privacy.unit == "hospital"
        self.task = study.study.task
        self.num_classes = len(study.study.classes)
        self.histogram_classes = self.num_classes if self.num_classes > 2 else 1
        self.model_name = model_name(study, self.settings)
        self._layout = None

    def _set_images(self, data: Any) -> None:
        """An images study's folder: patient-level split, as `split_by_patient` for tables."""
        from site_agent.imaging import split_images

        settings = self.settings
        self.train_data, self.holdout = split_images(
            data, held_out_fraction=settings.data.holdout_fraction, seed=settings.data.split_seed
        )
        has_patients = data.patient_ids is not None
        self._image_units = data.num_patients
        unit = settings.privacy.privacy_unit
        if not self.dp:
            self.privacy_unit = "none"
        elif unit == "auto":
            self.privacy_unit = "patient" if has_patients else "record"
        else:
            self.privacy_unit = unit
        if self.hospital and self.dp:
            self.privacy_unit = "hospital"
        self.patients = self.train_data.num_patients if has_patients else 0
        self.n_features = None
        if self.ledger is not None and self._ledger_state is not None:
            self.attach_ledger(self.ledger, state=self._ledger_state)

    def _ready(self) -> None:
        if self.train_data is None:
            raise RoundFailed(
                "no global statistics yet: the study's statistics release comes first"
                if self.study is not None else "site data not loaded"
            )

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
        """The trainer's record-level DP path (`GradSampleChoice`), None before the
        first trainer or for patient-level and non-private training."""
        return getattr(self._trainer, "grad_sample_choice", None)

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
        # Under a study every site spends the study's count_epsilon (checked against this
        # site's limit, privacy.count_epsilon, when it joined); without one, its own.
        epsilon = (self.settings.privacy.count_epsilon if self.study is None
                   else self.study.privacy.count_epsilon)
        count = release_cohort_count(
            ledger, units=self.units, epsilon=epsilon, state=state, now=dt.datetime.now(dt.UTC),
        )
        self.released_units = count.noisy_count

    def model(self) -> Any:
        from common.models import ModelSpec
        from common.models.build import build_for_study, build_model

        if self.study is None:
            return build_model(
                ModelSpec(name=self.settings.training.model), in_features=self.n_features
            )
        return build_for_study(
            self.study,
            in_features=self.n_features,
            allowed_model_factories=self.settings.policy.allowed_model_factories,
        )

    def layout(self) -> tuple[TensorSpec, ...]:
        if self._layout is None:
            self._layout = _layout_of(self.model())
        return self._layout

    def trainer_for(self, plan: RoundPlan) -> Any:
        from site_agent.trainer import LocalTrainer
        from site_agent.training_config import TrainingConfig

        self._ready()
        planned = self.ledger is not None and self.released_units is not None
        # With a ledger the noise is re-planned every round (`planned_segments`), so the
        # announced planned_rounds no longer shapes the trainer.
        key = (1 if planned else plan.planned_rounds, max(plan.local_epochs, 1))
        if self._trainer is None or self._trainer_key != key:
            cfg = self.settings
            config = TrainingConfig(
                batch_size=fit_batch_size(
                    self.requested_batch_size,
                    units=self.released_units if self.released_units is not None
                    else self.units,
                ),
                max_physical_batch_size=cfg.training.max_physical_batch_size,
                local_epochs=key[1],
                lr=plan.learning_rate,
                optimizer=self.local_optimizer,
                max_grad_norm=cfg.privacy.max_grad_norm,
                target_epsilon=self._dp_sgd_budget(cfg.privacy.budget_epsilon),
                delta=cfg.privacy.delta,
                planned_rounds=plan.planned_rounds,
                fedprox_mu=plan.fedprox_mu,
                accountant=cfg.privacy.accountant,
                dp=self.dp_sgd,
                privacy_unit="patient" if "patient" in (self.privacy_unit, self.record_level)
                else ("record" if self.dp_sgd else "auto"),
                grad_sample_mode=cfg.training.grad_sample_mode,
                device=cfg.training.device,
                task=self.task,
                num_classes=self.num_classes,
                released_units=self.released_units,
                noise_multiplier=1.0 if planned else None,  # re-planned before each round
            )
            seed = cfg.training.seed
            if seed is None:
                # Sampling and noise seeds from the OS CSPRNG, so nobody can predict the
                # DP noise from the configuration (torch's generators hold 64 bits).
                seed = int.from_bytes(os.urandom(8), "big") >> 1
            self._trainer = LocalTrainer(self.model, self.train_data, config, seed=seed)
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
                from site_agent.dp_release import plan_training_noise

                sigma = plan_training_noise(
                    self.ledger, policy=self.settings.policy,
                    announced_rounds=plan.planned_rounds, sample_rate=trainer.sample_rate,
                    steps_per_round=plan.local_epochs * trainer.steps_per_epoch,
                    evaluation=evaluation,
                    study_rounds=None if self.study is None else self.study.study.rounds,
                    **self._layered_plan(),
                ).noise_multiplier
                self._planned = {plan.round_number: sigma}
            trainer.set_noise_multiplier(sigma)
        segments: list[Segment] = trainer.planned_segments(plan.local_epochs)
        return segments

    @property
    def requested_batch_size(self) -> int:
        """The expected logical batch: the study's (the contract every site trains by),
        or without a study the site's own setting."""
        if self.study is not None:
            return self.study.training.batch_size
        return self.settings.training.batch_size

    @property
    def local_optimizer(self) -> Literal["sgd", "adam"]:
        """The local optimizer: the study's, or without a study the site's own setting."""
        if self.study is not None:
            return self.study.training.local_optimizer
        return self.settings.training.optimizer

    def _dp_sgd_budget(self, budget: float) -> float:
        """DP-SGD's target: the site's budget, or beneath hospital-level DP the study's
        record_epsilon when smaller (the site's own budget still caps it)."""
        if self.record_level == "none" or self.study is None:
            return budget
        record = self.study.privacy.record_epsilon
        return budget if record is None else min(budget, record)

    def _layered_plan(self) -> dict[str, Any]:
        """Beneath hospital-level DP, DP-SGD's noise is planned on the ledger's DP-SGD path
        (common.privacy.layered: DDGauss rounds above DP-SGD are post-processing) for
        record_epsilon; otherwise on the whole ledger for its budget (no overrides)."""
        if self.record_level == "none" or self.ledger is None:
            return {}
        from common.privacy.layered import dpsgd_path

        pairs = [(e.purpose, e.mechanisms) for e in self.ledger.entries()]
        return {"history": dpsgd_path(pairs),
                "budget_epsilon": self._dp_sgd_budget(self.ledger.budget_epsilon)}

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
        """v this hospital trains in `plan`'s round: the study's fixed v, or under "auto"
        the announced v (issue 13, section 2), lowered to what the site's DP patient
        count splits into groups of `MIN_PATIENTS_PER_INTERMEDIARY` (post-processing of
        that release: the choice, visible in the summed weight, reveals nothing new)."""
        if self.study is None or not self.hospital:
            return 1
        if isinstance(self.study.privacy.intermediaries, int):
            return self.study.privacy.intermediaries
        from common.privacy.hospital import MIN_PATIENTS_PER_INTERMEDIARY

        v = max(plan.intermediaries, 1)
        if self.released_units is not None:
            v = min(v, max(self.released_units // MIN_PATIENTS_PER_INTERMEDIARY, 1))
        return v

    def unit_groups(self, v: int) -> list[np.ndarray]:
        """Record indices of v disjoint intermediaries: whole patients (without a patient
        column each record, keyed by its content: `record_unit_keys`), each in the group
        a keyed hash of its id alone gives (`intermediary_of`), fixed for the study by the
        split seed.

        Why a hash and not a shuffle: the per-patient figure charges a patient 2S per
        round (common.privacy.layered `replaced`), which holds only if adding or removing
        one patient moves its own unit and no other; a permutation of all patients
        reshuffles nearly everyone when one is added (up to 2 v S). A group may come out
        empty (rare at >= `MIN_PATIENTS_PER_INTERMEDIARY` patients per unit):
        `_train_units` then sends a zero update for it."""
        ids = getattr(self.train_data, "patient_ids", None)
        keys = ids if ids is not None else record_unit_keys(self.train_data)
        return assign_intermediaries(keys, v=v, split_seed=self.settings.data.split_seed)

    def _train_units(self, plan: RoundPlan, global_flat: np.ndarray, histogram: np.ndarray,
                     started: float, patients: int) -> LocalUpdate:
        """Hospital-level DP with intermediaries (issue 13, section 2; Jiang et al.,
        MICCAI 2023): each unit trains from the global model on its own patients; the
        agent clips and rounds each delta alone (site_agent.hospital)."""
        import dataclasses as dc

        from site_agent.trainer import LocalTrainer

        base = self.trainer_for(plan)
        deltas: list[np.ndarray] = []
        losses: list[float] = []
        records = 0
        for index in self.unit_groups(self.intermediaries_for(plan)):
            if index.size == 0:
                # An empty intermediary (`unit_groups`) still counts as one unit: a zero
                # update (norm 0), so the weight stays v and reveals nothing about it.
                deltas.append(np.zeros_like(global_flat, dtype=np.float32))
                continue
            subset = self.train_data.subset(index)
            config = dc.replace(
                base.config, released_units=None,
                batch_size=fit_batch_size(self.requested_batch_size, units=len(subset)),
            )
            seed = int.from_bytes(os.urandom(8), "big") >> 1
            result = LocalTrainer(self.model, subset, config, seed=seed).train_round(
                global_flat, local_epochs=plan.local_epochs, lr=plan.learning_rate,
                fedprox_mu=plan.fedprox_mu,
            )
            deltas.append(np.array(result.delta_flat, dtype=np.float32))
            if result.mean_loss is not None:
                losses.append(result.mean_loss)
            records += result.num_samples
        total = np.sum(deltas, axis=0).astype(np.float32)
        return LocalUpdate(
            total, len(deltas), histogram, time.perf_counter() - started, patients,
            loss=float(np.mean(losses)) if losses else None, records=records,
            units=tuple(deltas),
        )

    def evaluate(self, plan: RoundPlan, global_flat: np.ndarray) -> np.ndarray:
        """Held-out score histogram of the global model: 2 * bins counts for a binary
        study, K one-vs-rest blocks of 2 * (bins / K) for K classes (the announced bins
        cover all blocks: `common.evaluation.bins_per_class`), counted with the round's
        announced bucket edges (`common.evaluation.round_edges`, checked there)."""
        from common.evaluation import (
            multiclass_score_histogram,
            round_edges,
            score_histogram,
        )
        from common.models.layout import load_flat_parameters
        from site_agent.dp_release import one_per_unit
        from site_agent.imaging import ImageDataset
        from site_agent.trainer import predict_scores

        probe = self.model()
        load_flat_parameters(probe, global_flat)
        probe.to(self.device)
        # One score per privacy unit (a random encounter of each held-out patient): each
        # unit moves one count, the sensitivity the agent's histogram noise is planned for.
        pick = one_per_unit(
            self.holdout.patient_ids if self.privacy_unit in ("patient", "hospital") else None,
            size=len(self.holdout),
        )
        if isinstance(self.holdout, ImageDataset):
            inputs: Any = self.holdout.subset(pick)
        else:
            inputs = self.holdout.features[pick]
        labels = self.holdout.labels[pick]
        scores = predict_scores(probe, inputs, device=self.device, task=self.task, batch_size=256)
        if self.task == "binary":
            (edges,) = round_edges(plan.histogram_edges, bins=plan.histogram_bins)
            return score_histogram(scores, labels, edges=edges)
        blocks = round_edges(
            plan.histogram_edges, bins=plan.histogram_bins, blocks=self.num_classes)
        return multiclass_score_histogram(scores, labels, edges=blocks)



INTERMEDIARY_DOMAIN = b"medfed/v1/intermediary"


def intermediary_key(split_seed: int) -> bytes:
    """The BLAKE2b key of the patient -> intermediary hash: fixed by the site's split
    seed for the study (not secret from the site; it keeps groups stable across rounds)."""
    return hashlib.blake2b(INTERMEDIARY_DOMAIN + int(split_seed).to_bytes(16, "big", signed=True),
                           digest_size=32).digest()


def canonical_unit_id(unit: object) -> bytes:
    """Bytes of a patient id (or record index) that do not depend on its dtype: integers
    (Python, NumPy, integral floats) as their decimal digits, text as UTF-8, so the same
    id hashes alike whether a file's column was read as numbers or as strings."""
    if isinstance(unit, bytes | bytearray):
        return bytes(unit)
    if isinstance(unit, np.generic):
        unit = unit.item()
    if isinstance(unit, bool):
        unit = int(unit)
    if isinstance(unit, float) and unit.is_integer():
        unit = int(unit)
    return str(unit).encode("utf-8")


def assign_intermediaries(keys: np.ndarray, *, v: int, split_seed: int) -> list[np.ndarray]:
    """Record indices of each of v intermediaries, given one unit id per record (a
    patient id, or `record_unit_keys`): every record of a unit in the group
    `intermediary_of` gives its id. ConfigError when there are fewer units than v."""
    unique, inverse = np.unique(np.asarray(keys), return_inverse=True)
    if unique.size < v:
        raise ConfigError("privacy.intermediaries",
                          f"{v} intermediaries but only {unique.size} units at this site")
    key = intermediary_key(split_seed)
    group_of_unit = np.fromiter((intermediary_of(u, key=key, v=v) for u in unique),
                                dtype=np.int64, count=unique.size)
    group = group_of_unit[inverse.reshape(-1)]
    return [np.flatnonzero(group == k) for k in range(v)]


def record_unit_keys(data: Any) -> np.ndarray:
    """Unit ids of a dataset without a patient column, one per record, that depend on the
    record alone (never on its position, which shifts for every later record when one is
    added or removed): a digest of a tabular record's encoded features and label, or an
    image's file path. Identical records share a key (and so a unit), which keeps the
    property that one record added or removed moves only its own unit."""
    entries = getattr(data, "entries", None)
    if entries is not None:  # images: the file, not its place in the listing
        return np.array([str(entry.path) for entry in entries], dtype=object)
    features = np.ascontiguousarray(data.features)
    labels = np.ascontiguousarray(data.labels)
    keys = np.empty(len(features), dtype=object)
    for i in range(len(features)):
        digest = hashlib.blake2b(features[i].tobytes(), digest_size=16)
        digest.update(labels[i].tobytes())
        keys[i] = digest.digest()
    return keys


def intermediary_of(unit: object, *, key: bytes, v: int) -> int:
    """The intermediary (0..v-1) of one patient: BLAKE2b-64 of its id under `key`, mod v.
    A function of the id alone, so one patient added or removed changes only its own
    unit (the 2S per-patient bound; `DpTrainingHook.unit_groups`)."""
    digest = hashlib.blake2b(canonical_unit_id(unit), key=key, digest_size=8).digest()
    return int.from_bytes(digest, "big") % v


def load_site_study(settings: SiteSettings) -> Study | None:
    """The study in the site's own ``study_file``, if it names one."""
    from common.study import load_study

    if settings.study_file is None:
        return None
    return load_study(settings.study_file)


def model_name(study: Study | None, settings: SiteSettings) -> str:
    """What the site trains, for logs and reports: a registry name or the factory."""
    if study is None:
        return settings.training.model
    return study.model.custom or study.model.name or "mlp"


def fit_batch_size(requested: int, *, units: int) -> int:
    """The expected batch, capped at a quarter of the privacy units a site has (a small
    site still gets several steps per epoch, and sampling rate q stays below 1)."""
    return max(1, min(requested, units // 4))


def load_configured_data(settings: SiteSettings, study: Study | None = None) -> Any:
    """This site's records: its image folder for an images study, its file with the
    declared schema, or its slice of the embedded synthetic cohort."""
    from site_agent.data import DatasetSchema, load_site_data
    from site_agent.synthetic import FEATURES, generate_cohort

    data_cfg = settings.data
    if study is not None and study.data.kind == "images":
        from site_agent.imaging import image_spec_for_study, load_image_folder

        if data_cfg.path is None:
            raise ConfigError("data.path", "an images study needs --data FOLDER (with labels.csv)")
        return load_image_folder(data_cfg.path, image_spec_for_study(study))
    if data_cfg.synthetic:
        # Only when asked for explicitly (--synthetic): a site's own file is never
        # replaced by the embedded cohort.
        return generate_cohort(
            [settings.site],
            seed=data_cfg.synthetic_cohort_seed or 0,
            patients_per_site=data_cfg.synthetic_patients,
        )[settings.site]
    if data_cfg.path is None:
        raise ConfigError(
            "data.path", "name this site's data file (--data FILE), or ask for the built-in "
            "demo cohort explicitly with --synthetic"
        )
    features = data_cfg.features or list(FEATURES)
    schema = DatasetSchema(
        features=features,
        label=data_cfg.label_column,
        patient_id=data_cfg.patient_column,
        nan_policy=data_cfg.nan_policy,
    )
    return load_site_data(data_cfg.path, schema)


def check_layout(expected: tuple[TensorSpec, ...], announced: tuple[TensorSpec, ...]) -> None:
    """The coordinator's model must be the architecture this site trains."""
    if tuple(expected) != tuple(announced):
        raise ConfigError(
            "model", "the coordinator's model layout does not match this site's model"
        )


def _layout_of(model: Any) -> tuple[TensorSpec, ...]:
    """The model's wire layout (`common.models.layout`, which imports torch)."""
    from common.models.layout import model_layout

    return model_layout(model)
