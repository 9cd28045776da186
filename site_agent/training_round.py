"""One model round (training, or the study's final evaluation) as a site takes part:
keys first while the model downloads and the noise is planned in a worker thread, then
the ledger's write-ahead entries, training, encoding by the round's egress manifest,
and the upload through SecAgg+ (`phases`). What it logs per round is what an ML
engineer asks for: data used, local loss and its trend, privacy spent.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from common.core.codec import all_finite
from common.core.config import SiteSettings
from common.core.errors import RoundFailed
from common.crypto.random import numpy_generator, system_random
from common.privacy.accountant import Segment
from common.privacy.mechanisms import Mechanism
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.releases import egress
from common.releases.convergence import describe_loss_trend
from common.rounds.announcement import RoundPlan, VerifiedRound
from common.study import GlobalStatistics, check_served_weights
from site_agent import dp_release
from site_agent import hospital as hospital_round
from site_agent.connection import Heartbeats
from site_agent.membership import Membership, utcnow
from site_agent.metrics import SiteMetrics
from site_agent.phases import SecAggPhases
from site_agent.releases import EvaluationRelease, refuse_recorded_round
from site_agent.round_timeline import RoundTimeline
from site_agent.site_training import LocalUpdate, TrainingHook
from site_agent.transfers import ModelDownload

log = logging.getLogger("medfed.site")


def round_of(number: int, planned: int, *, evaluation: bool = False) -> str:
    """``round number 4 (training; the study plans 3 training rounds)``.

    The number is the coordinator's round number, as `medfed status` shows it beside
    "training round k of N": it also counts the statistics round, aborted rounds and
    earlier studies. A site cannot know k (it may have sat rounds out, and nothing it
    holds marks where the study's training began), so it never writes "k of N"."""
    kind = "final evaluation" if evaluation else "training"
    rounds = "training round" if planned == 1 else "training rounds"
    return f"round number {number} ({kind}; the study plans {planned} {rounds})"


def proc_status_bytes(key: str) -> int:
    """A `kB` field of this process's /proc/self/status (VmRSS, VmHWM) in bytes; 0 where
    there is no procfs. For the memory figures `bench round` reports."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def encode_update(rnd: VerifiedRound, update: LocalUpdate) -> np.ndarray:
    """The upload, built from the round's egress manifest (common.releases.egress): the
    segments listed there and nothing else.

    A trained update holding NaN or infinity is sent as zero (logged here, at the site):
    it is a function of the DP-SGD steps' noised outputs and the public model, so zero is
    post-processing of them, and a site whose training overflowed still uploads like
    every other, never a dropout the coordinator could read as a fact about its data."""
    n_sites = len(rnd.params.participants) if rnd.params else 2
    manifest = rnd.announcement.manifest()
    if update.delta.size != manifest.slice_of(egress.MODEL_UPDATE).stop:
        raise RoundFailed("update does not match the model size")
    delta = update.delta
    if not all_finite(delta):
        log.warning("round %d: the trained update holds NaN or infinity (the global model "
                    "overflowed on this site's records): sending a zero update", rnd.number,
                    extra={"event": "update_not_finite", "round_number": rnd.number})
        delta = np.zeros(delta.shape, dtype=np.float32)
    weight = min(int(update.num_samples), rnd.announcement.weight_cap)
    # Scale by n_k / cap so FedAvg's weights come out of the secure sum; in place
    # when the hook handed over a writeable delta (no model-sized copy).
    factor = np.float32(weight / rnd.announcement.weight_cap)
    if delta.flags.writeable and delta.dtype in (np.float32, np.float64):
        scaled = np.multiply(delta, factor, out=delta)
    else:
        scaled = delta * factor
    return manifest.encode(
        {
            egress.MODEL_UPDATE: scaled,
            egress.WEIGHT: [weight],
            egress.EVALUATION_HISTOGRAM: np.asarray(update.histogram, dtype=np.int64),
        },
        clip=rnd.announcement.clip,
        bits=rnd.announcement.quantization_bits,
        n_sites=n_sites,
        rng=numpy_generator(system_random),
    )


class TrainingRound:
    """Takes part in model rounds, one at a time; keeps this process's local losses
    (their trend is logged each round and at the study's end; nothing leaves)."""

    def __init__(self, settings: SiteSettings, hook: TrainingHook, *, membership: Membership,
                 phases: SecAggPhases, metrics: SiteMetrics) -> None:
        self.settings = settings
        self.hook = hook
        self.membership = membership
        self.phases = phases
        self.metrics = metrics
        self.evaluation = EvaluationRelease(settings, hook, membership)
        # Noise calibration runs here, concurrently with the key phases (one at a time:
        # a hook's trainer is not shared between threads).
        self._planner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="noise-plan")
        self._pending_statistics: GlobalStatistics | None = None
        self.losses: list[float] = []
        self.rounds_done = 0
        self.timeline = RoundTimeline()  # the round in flight's (bench round reads it)
        self._rss_before_download = 0

    def statistics_arrived(self, stats: GlobalStatistics) -> None:
        """The study's released statistics: the records are encoded with them in the
        next round's planning thread (seconds, tens on a loaded machine), beside the key
        phases, never before them."""
        self._pending_statistics = stats

    def run(self, stub: pb_grpc.FederationStub, rnd: VerifiedRound, *,
            heard_at: float | None = None) -> None:
        """Take part in `rnd`, heard of at `heard_at` (perf_counter; default now)."""
        heard_at = time.perf_counter() if heard_at is None else heard_at
        self.timeline = RoundTimeline(heard_at)
        plan = rnd.plan
        what = "evaluation only" if plan.local_epochs == 0 else (
            f"{plan.local_epochs} local epoch(s)")
        log.info("%s: selected with %d sites (%s)",
                 round_of(rnd.number, plan.planned_rounds, evaluation=plan.local_epochs == 0),
                 len(rnd.announcement.participants), what,
                 extra={"event": "round_selected", "round_number": rnd.number,
                        "planned_rounds": plan.planned_rounds})
        hospital_round.require_hospital_round(
            rnd, hospital_mode=bool(getattr(self.hook, "hospital", False)))
        evaluation = self.evaluation.mechanisms(rnd)
        refuse_recorded_round(self.membership.ledger, rnd)
        with Heartbeats(stub, rnd.number, rnd.heartbeat_seconds) as heartbeats:
            update = self._contribute(stub, rnd, evaluation=evaluation, heard_at=heard_at,
                                      heartbeats=heartbeats)
        self.rounds_done += 1
        self.metrics.rounds.labels(outcome="completed").inc()
        self._log_done(rnd, update, extra={
            # Memory of the round's model-sized work (bench round reads these): the
            # process peak against its RSS just before the download.
            "rss_before_download_bytes": self._rss_before_download,
            "peak_rss_bytes": proc_status_bytes("VmHWM"),
            **self.timeline.fields(),
        })

    def _plan_noise(self, plan: RoundPlan, evaluation: list[Mechanism]) -> list[Segment]:
        """The planning thread's job: encode the records with the federation's global
        statistics when a new release arrived, then plan this round's noise (its DP
        evaluation release reserved in every round left)."""
        pending, self._pending_statistics = self._pending_statistics, None
        if pending is not None:
            self.hook.set_statistics(pending)
        return list(self.hook.planned_segments(plan, evaluation=evaluation))

    def _reserve(self, rnd: VerifiedRound, segments: list[Mechanism],
                 evaluation: list[Mechanism]) -> None:
        """Training and evaluation on the ledger (two entries) before training starts;
        BudgetExhausted (nothing written) when they do not fit together."""
        ledger = self.membership.ledger
        if ledger is None or not (segments or evaluation):
            return
        # A round with DP-SGD beneath hospital-level DP is charged per record.
        ledger.require(rnd.number, segments, also=[
            (dp_release.PURPOSE_EVALUATION, evaluation)] if evaluation else [])
        if segments:
            # Write-ahead: the spend is on disk before any update can leave the site.
            ledger.reserve(rnd.number, segments, now=utcnow())
        if evaluation:
            ledger.reserve(rnd.number, evaluation, now=utcnow(),
                           purpose=dp_release.PURPOSE_EVALUATION)
        self.membership.budget_pb()

    def _contribute(self, stub: pb_grpc.FederationStub, rnd: VerifiedRound, *,
                    evaluation: list[Mechanism], heard_at: float,
                    heartbeats: Heartbeats) -> LocalUpdate:
        timeline = self.timeline
        client = self.phases.client(rnd) if rnd.announcement.secure_aggregation else None
        self._rss_before_download = proc_status_bytes("VmRSS")
        download: ModelDownload | None = None
        try:
            # Keys first (two short barriers, the model downloading meanwhile), then
            # train: uploads then overlap other sites' training, as in plain FedAvg.
            advertisement = client.advertise_keys() if client is not None else None
            # Noise calibration can take tens of seconds on a loaded machine: it starts
            # once our keys exist and runs while they are exchanged (keys reveal nothing
            # about the data), so the key phases never wait for it; training does.
            planning = self._planner.submit(self._plan_noise, rnd.plan, evaluation)
            download = ModelDownload(stub, rnd, timeline)
            keys = (
                self.phases.exchange_keys(stub, rnd, client, advertisement,
                                          heard_at=heard_at, timeline=timeline)
                if client is not None and advertisement is not None else None
            )
            # The model downloads while the keys are exchanged (two barriers that
            # wait on the slowest site): neither delays the other.
            global_flat = download.result()
            # The study's public bound on the served weights, before any ledger entry or
            # training: a model that large could overflow float32 on chosen records.
            check_served_weights(global_flat, self.membership.study,
                                 what=f"the global model of round {rnd.number}")
            timeline.mark("keys_and_model")
            log.debug("round %d: keys exchanged, model downloaded", rnd.number)
            segments: list[Mechanism] = list(planning.result())
            planned_hospital = None
            if rnd.announcement.is_hospital:
                # Hospital-level DP: the DDGauss round joins the training entry, so it
                # too is on the ledger before training starts.
                planned_hospital = hospital_round.plan_round(
                    rnd, study=self.membership.study, policy=self.settings.policy)
                if self.membership.ledger is not None:
                    # No single round above the per-round cap, before anything is reserved.
                    hospital_round.check_round_cap(
                        self.membership.ledger, planned_hospital, number=rnd.number,
                        study=self.membership.study, policy=self.settings.policy)
                segments = [*segments, planned_hospital.mechanism]
            self._reserve(rnd, segments, evaluation)
            if evaluation:
                # The round's evaluation entry (its noise, parameters only) reaches the
                # coordinator's replica before our histogram does, so the round's sum is
                # read with the noise the sites announced, never an estimate.
                self.membership.replicate(stub)
            log.info("round %d: training", rnd.number,
                     extra={"event": "training_started", "round_number": rnd.number})
            started = time.perf_counter()
            update = self.evaluation.private(rnd, self.hook.train(rnd.plan, global_flat),
                                             evaluated=bool(evaluation))
            timeline.mark("trained")
            # The hook keeps what it needs (its model's parameters): our copy of the
            # global model is not needed for encoding, masking or the upload.
            del global_flat
            self.metrics.training_seconds.observe(time.perf_counter() - started)
            self.metrics.samples_used.set(update.num_samples)
            self.metrics.patients_used.set(update.patients)
            choice = getattr(self.hook, "grad_sample_choice", None)
            if choice is not None:
                self.metrics.observe_grad_sample(mode=choice.mode, source=choice.source,
                                                 seconds_per_step=choice.seconds_per_step)
            vector = (encode_update(rnd, update) if planned_hospital is None
                      else hospital_round.encode(rnd, update, planned_hospital))
            timeline.mark("encoded")
            log.debug("round %d: update trained and encoded", rnd.number)
            if client is not None and keys is not None:
                self.phases.finish(stub, rnd, client, *keys, vector, heartbeats=heartbeats,
                                   timeline=timeline)
            else:
                self.phases.upload_plain(stub, rnd, vector, timeline=timeline)
        except BaseException:
            if download is not None:
                download.cancel()
            if client is not None:
                client.abort()  # nothing more is ever revealed for this round
            raise
        return update

    def _log_done(self, rnd: VerifiedRound, update: LocalUpdate, *,
                  extra: dict[str, object]) -> None:
        """What the ML engineer wants per round: data used, local loss, privacy spent."""
        parts = []
        fields: dict[str, object] = {
            "event": "site_round_done", "round_number": rnd.number,
            "planned_rounds": rnd.plan.planned_rounds,
            "evaluation_only": rnd.plan.local_epochs == 0, **extra,
        }
        if rnd.plan.local_epochs == 0:
            parts.append("evaluated the global model (no training)")
        else:
            records = update.records if update.records is not None else update.num_samples
            used = f"trained on {records} records"
            if update.patients:
                # Under DP the trainer sees the released (noisy) count, not the exact one.
                if getattr(self.hook, "released_units", None) == update.patients:
                    unit = "patients" if self.hook.privacy_unit == "patient" else "units"
                    used += f" (DP count of {unit} ~{update.patients})"
                else:
                    used += f" ({update.patients} patients)"
            parts.append(used)
            if update.loss is not None:
                self.losses.append(update.loss)
                loss = f"local loss {update.loss:.4f}"
                if len(self.losses) > 1:
                    loss += f" ({describe_loss_trend(self.losses)})"
                parts.append(loss)
        fields["records"] = (update.records if update.records is not None
                             else update.num_samples)
        fields["patients"] = update.patients
        if update.loss is not None:
            fields["local_loss"] = update.loss
        ledger = self.membership.ledger
        if ledger is not None:
            status = ledger.status()
            parts.append(f"epsilon {status.spent_epsilon:.3f} of {status.budget_epsilon:g} "
                         f"spent (delta {status.delta:g})")
            fields["epsilon_spent"] = status.spent_epsilon
            fields["epsilon_budget"] = status.budget_epsilon
        log.info("%s done: %s", round_of(rnd.number, rnd.plan.planned_rounds,
                                         evaluation=rnd.plan.local_epochs == 0),
                 ", ".join(parts) or "contributed", extra=fields)
