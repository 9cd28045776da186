"""The round engine: runs the study round after round, and one round from selection to
checkpoint, delegating each concern to its module (sessions, selection, phases,
uploads, aggregation, optimizers, checkpoints).

It speaks dataclasses only; `servicer.py` translates protobuf and maps errors to gRPC
status codes. Everything runs on one asyncio event loop; CPU-heavy steps (adding a
masked vector, unmasking, the update) run in worker threads.

A failure of the engine itself (a full disk, a database error) is never reported as
a finished federation: waiting sites are told UNAVAILABLE and keep retrying, and a
coordinator restarted on the same state resumes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from cryptography import x509

from common.codec import digest
from common.config import CoordinatorSettings
from common.errors import (
    AbortReason,
    LedgerForkError,
    MedfedError,
    ProtocolAbort,
    StateError,
    Unavailable,
    ValidationError,
)
from common.pki import load_certificate
from common.privacy.federation import FederationBudgetView
from common.privacy.replica import LedgerReplica
from common.round import Announcement, SiteBudget
from common.secagg.client import IdentityVerifier
from common.secagg.params import (
    ROUND_NONCE_BYTES,
)
from common.statistics import decode_release, ring_to_signed, statistics_length
from coordinator import checkpoints, hospital_sum, selection
from coordinator.aggregation import (
    UPDATE_CHUNK_ELEMENTS,
    Aggregator,
    aggregator_for,
    decode_round_sum,
)
from coordinator.inbox import RoundInbox
from coordinator.metrics import CoordinatorMetrics
from coordinator.optimizers import apply_step, build_optimizer
from coordinator.phases import (
    ActiveRound,
    Liveness,
    PhaseClosed,
    drive,
    phase_timeout,
)
from coordinator.sessions import SiteRegistry
from coordinator.status import StudyStatus, study_status
from coordinator.store import CoordinatorStore
from coordinator.study_run import StudyRun
from coordinator.uploads import Transfers

log = logging.getLogger("medfed.coordinator")


@dataclass(frozen=True)
class RoundResult:
    round_number: int
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    mean_delta: np.ndarray
    metrics: dict[str, float]
    histogram: np.ndarray | None = None
    statistics: bool = False  # the study's statistics release (no model update)


class RoundEngine:
    """Runs `settings.rounds` rounds (and a final evaluation round), one at a time."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        store: CoordinatorStore,
        *,
        identity: IdentityVerifier,
        metrics: CoordinatorMetrics,
        clock: Callable[[], float] = time.time,
        rng: Callable[[int], bytes] = os.urandom,
        budget_view: FederationBudgetView | None = None,
        study: StudyRun | None = None,
    ) -> None:
        # With a study, its model and training settings replace the config's.
        self.study = study
        if study is not None:
            settings = study.settings(settings)
        self.settings = settings
        self.store = store
        # The federation budget view lives in the same state database as the store
        # (SQLite or PostgreSQL), so a restarted or fail-over coordinator keeps it.
        self.budget_view = budget_view or FederationBudgetView(store.database)
        self.identity = identity
        self.metrics = metrics
        self.clock = clock
        self.rng = rng
        self.sessions = SiteRegistry(store, self.budget_view, metrics=metrics, clock=clock)
        # Replica of every site's signed ledger, in the same state database (issue 10,
        # section 7): a site whose head does not extend it is refused, never selected.
        self.replica = LedgerReplica(store.database, ca_certificate=_federation_ca(settings))
        self.transfers = Transfers(settings.limits, settings.state, metrics=metrics)
        self.inbox = RoundInbox(store, self.sessions, self.transfers)
        self.finished = asyncio.Event()  # set only when the whole study completed
        self.optimizer = build_optimizer(settings.optimizer)
        self.layout, self.global_flat = checkpoints.load_model(
            store, settings.model, self.optimizer,
            initial=study.initial_model if study is not None else None,
        )
        self.last_round_number = 0
        self.last_result: RoundResult | None = None
        self.last_secagg: tuple[int, int] = (0, 0)  # (threshold, neighbours) last announced

    @property
    def total_rounds(self) -> int:
        return self.settings.rounds + (1 if self.settings.training.final_evaluation else 0)

    def is_evaluation_round(self) -> bool:
        return self.store.completed_rounds() >= self.settings.rounds

    def recover(self) -> None:
        """After a crash: abandon the round that was in flight, saying truthfully
        whether its sum had already been unmasked."""
        for rnd in self.store.abandon_in_flight(now=self.clock()):
            if rnd.unmasked:
                log.warning("round %d was abandoned at a crash after its sum was unmasked: "
                            "the coordinator may have seen that sum; no model was built "
                            "from it", rnd.round_number)
            else:
                log.warning("round %d was in flight at a crash: abandoned", rnd.round_number)
            self.metrics.rounds_total.labels(outcome="abandoned").inc()
        self.last_round_number = self.store.next_round_number() - 1
        # Budget gauges show the persisted federation view before any site reports again.
        for row in self.budget_view.snapshot():
            self.metrics.observe_budget(row.site_id, row.spent_epsilon, row.budget_epsilon)

    # --------------------------------------------------------------- site calls
    def enroll(self, site_id: str, certificate_der: bytes, *, serial: str, version: str,
               device: str, budget: SiteBudget) -> int:
        self.check_ledger_head(site_id, budget)
        self.sessions.enroll(site_id, certificate_der, serial=serial, version=version,
                             device=device, budget=budget)
        return self.last_round_number

    def check_ledger_head(self, site_id: str, budget: SiteBudget | None) -> int:
        """The replica's entry count for the site; LedgerForkError (FAILED_PRECONDITION
        to the site) when its reported head does not extend the replica: fork, shrink or
        reset. The site is then dropped from selection until an operator restores it."""
        held = self.replica.head(site_id)
        if budget is None or (held is None and budget.ledger_entries == 0):
            return 0 if held is None else held.entries
        try:
            self.replica.check_head(
                site_id, entries=budget.ledger_entries, head_hash=budget.ledger_head
            )
        except LedgerForkError as exc:
            log.error("site %s refused: %s", site_id, exc,
                      extra={"event": "ledger_fork", "site": site_id})
            raise
        return 0 if held is None else held.entries

    def replicate_ledger(self, site_id: str, history: bytes) -> int:
        head = self.replica.extend(
            site_id, history, now=dt.datetime.fromtimestamp(self.clock(), dt.UTC)
        )
        return head.entries

    def decline(self, site_id: str, round_number: int, *, budget: SiteBudget | None) -> None:
        session = self.sessions.session(site_id)
        self.sessions.record_budget(session, budget)
        session.declined_round = round_number
        self.inbox.decline(site_id, round_number)
        log.info("site %s declined round %d", site_id, round_number)

    def heartbeat(self, site_id: str, round_number: int) -> None:
        self.inbox.heartbeat(site_id, round_number)

    async def wait_for_round(
        self, site_id: str, *, after_round: int, wait_seconds: float, budget: SiteBudget | None
    ) -> Announcement | None:
        """Long-poll until a round selecting this site opens (None on timeout)."""
        self.check_ledger_head(site_id, budget)
        self.sessions.record_budget(self.sessions.session(site_id), budget)
        current = self.inbox.rejoin(site_id, after_round=after_round)
        if current is not None:
            return current.announcement
        return await self.sessions.poll(site_id, wait_seconds=wait_seconds)

    def status(self) -> StudyStatus:
        """The study as `medfed status` shows it (read-only)."""
        return study_status(
            list(self.sessions.sites.values()), self.store.rounds(), rnd=self.inbox.round,
            total_rounds=self.total_rounds, finished=self.finished.is_set(), now=self.clock(),
        )

    def final_model(self, study_sha256: bytes) -> bytes:
        """The bytes of the finished study's final bundle, for the site that names it."""
        study = self.study
        if study is None:
            raise StateError("this coordinator runs no study: there is no final model")
        if study_sha256 != bytes.fromhex(study.sha256):
            raise ValidationError("study_sha256 names another study")
        if not self.finished.is_set() or not study.final_path.exists():
            raise StateError("the study has not finished: no final model yet")
        try:
            return study.final_path.read_bytes()
        except OSError as exc:
            raise StateError(f"final model unreadable: {exc.strerror}") from None

    # --------------------------------------------------------------- main loop
    async def run(self) -> None:
        """Run rounds until the study is complete; any other exit is a failure that
        waiting sites hear as UNAVAILABLE (they retry), never as "finished"."""
        self.recover()
        try:
            # Once per study, before training: the federated DP statistics release
            # (common/statistics.py) every site then preprocesses with.
            while self.study is not None and self.study.statistics is None:
                await self._run_round(await self.select_participants(), statistics=True)
            while self.store.completed_rounds() < self.total_rounds:
                await self._run_round(await self.select_participants())
        except BaseException as exc:
            # The cause stays in the coordinator's log (service.serve): sites learn only
            # that they should retry, not the coordinator's paths or database errors.
            what = "is shutting down" if isinstance(exc, asyncio.CancelledError) else (
                "stopped on an error"
            )
            self.sessions.close(failure=Unavailable(f"coordinator {what}: retry later"))
            raise
        self.finished.set()
        self.metrics.study_finished.set(1)
        self.sessions.close(failure=None)

    async def select_participants(self) -> list[str]:
        """Wait for `min_sites` eligible sites, then briefly for the rest to arrive."""
        cfg = self.settings
        evaluation = self.is_evaluation_round()

        def eligible(site_ids: list[str]) -> list[str]:
            return self.sessions.with_budget(site_ids, evaluation_round=evaluation)

        return await self.sessions.gather(
            eligible, min_sites=cfg.min_sites, max_sites=cfg.limits.max_sites,
            start_timeout=cfg.deadlines.round_start_timeout_seconds,
            grace=cfg.deadlines.selection_seconds,
        )

    def next_round_number(self, participants: list[str]) -> int:
        return selection.next_round_number(
            recorded_next=self.store.next_round_number(),
            ledger_last_rounds=self.sessions.ledger_last_rounds(participants),
        )

    def _announce(self, participants: list[str], *, statistics: bool = False) -> Announcement:
        payload = checkpoints.model_payload(self.layout, self.global_flat)
        study = self.study
        ann = selection.announcement(
            self.settings, participants, number=self.next_round_number(participants),
            nonce=self.rng(ROUND_NONCE_BYTES), layout=self.layout,
            model_sha256=digest(payload), model_bytes=len(payload),
            evaluation_round=self.is_evaluation_round(), now=self.clock(),
            study_sha256=bytes.fromhex(study.sha256) if study is not None else b"",
            statistics=study.statistics_bytes if study is not None else b"",
            statistics_length=(
                statistics_length(study.study) if statistics and study is not None else None
            ),
        )
        return hospital_sum.announce(ann, hospital_sum.terms_for(
            study.study if study is not None else None, self.settings.aggregation))

    def _phase_closed(self, rnd: ActiveRound, closed: PhaseClosed) -> None:
        name = closed.phase.value
        if closed.silent:
            log.info(
                "round %d %s: dropping %s (no heartbeat for %d intervals)", rnd.number, name,
                list(closed.silent), self.settings.deadlines.heartbeat_misses,
                extra={"event": "sites_silent", "round_number": rnd.number, "phase": name,
                       "sites": ",".join(closed.silent)},
            )
        late = sorted(set(closed.missing) - set(closed.silent))
        if late:
            log.info("round %d %s deadline: dropping %s", rnd.number, name, late)
        if closed.missing:
            self.metrics.dropouts_total.labels(phase=name).inc(len(closed.missing))
        self.metrics.phase_seconds.labels(phase=name).observe(closed.seconds)
        log.debug("round %d %s closed after %.4f s", rnd.number, name, closed.seconds)

    async def _run_round(self, participants: list[str], *, statistics: bool = False) -> None:
        ann = self._announce(participants, statistics=statistics)
        self.last_secagg = (ann.threshold, ann.neighbours)
        started = time.perf_counter()
        self.transfers.prepare(ann.vector_length)
        self.store.begin_round(ann.round_number, participants, now=self.clock())
        self.metrics.current_round.set(ann.round_number)
        deadlines = self.settings.deadlines
        model = b"" if statistics else checkpoints.model_payload(self.layout, self.global_flat)
        rnd = ActiveRound(
            ann, model,
            liveness=Liveness(ann.heartbeat_ms / 1000, deadlines.heartbeat_misses),
        )
        aggregator = aggregator_for(
            rnd, identity=self.identity, metrics=self.metrics,
            max_colluding_sites=self.settings.aggregation.max_colluding_sites,
        )
        self.inbox.open(rnd, aggregator)
        log.info(
            "round %d open: %d sites, threshold %d, neighbours %d, secure=%s",
            ann.round_number, len(participants), ann.threshold, ann.neighbours,
            ann.secure_aggregation,
        )
        self.sessions.announce(ann)
        abort: ProtocolAbort | None = ProtocolAbort(AbortReason.ROUND_ABANDONED, "round ended")
        try:
            phase_s = self.settings.deadlines.phase_seconds
            await drive(rnd, aggregator.phases, close=aggregator.close,
                        timeout_for=lambda p: phase_timeout(ann, p, now=self.clock(),
                                                            phase_seconds=phase_s),
                        lock=self.inbox.lock, on_closed=self._phase_closed)
            # Before the sum is used: a crash from here on is reported as "abandoned
            # after unmasking" at the next start (the sum existed in the clear).
            self.store.mark_unmasked(ann.round_number)
            result = await asyncio.to_thread(self._apply_update, rnd, aggregator)
            self._commit(result)
            abort = None
        except MedfedError as exc:
            abort = exc if isinstance(exc, ProtocolAbort) else ProtocolAbort(
                AbortReason.ROUND_ABANDONED, str(exc)
            )
            log.warning(
                "round %d aborted: %s", ann.round_number, exc,
                extra={"event": "round_aborted", "round_number": ann.round_number,
                       "participants": ",".join(participants), "reason": str(exc)},
            )
            self.store.finish_round(
                ann.round_number, status="aborted", now=self.clock(), detail=str(exc)
            )
            self.metrics.rounds_total.labels(outcome="aborted").inc()
        else:
            self._log_completed(rnd, result, participants, time.perf_counter() - started)
        finally:
            rnd.end(abort=abort)
            self.last_round_number = ann.round_number
            self.inbox.close()

    def _apply_update(self, rnd: ActiveRound, aggregator: Aggregator) -> RoundResult:
        """Decode the sum and step the model (worker thread; the model is no longer
        served, so an elementwise optimizer may update it in place)."""
        ann = rnd.announcement
        aggregate = aggregator.result
        if aggregate is None:
            raise ProtocolAbort(AbortReason.ROUND_ABANDONED, "no aggregate for this round")
        survivors = aggregator.survivors
        if ann.is_statistics:
            return self._decode_statistics(ann, aggregator, aggregate)
        if self.settings.debug_write_aggregates:
            # TEST ONLY: streamed straight from the ring sum before it is decoded in
            # place (a copy would add a model-sized vector to the coordinator's peak).
            checkpoints.write_debug_aggregate(
                self.settings.state, ann.round_number, aggregate, survivors
            )
        decoded = hospital_sum.decode(
            aggregate, ann=ann, count=len(survivors),
            histogram_classes=self.settings.aggregation.histogram_classes,
            terms=hospital_sum.terms_for(self.study.study if self.study else None,
                                         self.settings.aggregation),
        ) if ann.is_hospital else decode_round_sum(
            aggregate, model_dim=self.global_flat.size, count=len(survivors), clip=ann.clip,
            bits=ann.quantization_bits, weight_cap=ann.weight_cap,
            histogram_bins=ann.histogram_bins, evaluation_only=ann.local_epochs == 0,
            histogram_classes=self.settings.aggregation.histogram_classes,
        )
        mean_delta = decoded.mean_delta
        if mean_delta is None:
            mean_delta = np.zeros(self.global_flat.size, dtype=np.float32)
        else:
            self.global_flat = apply_step(
                self.optimizer, self.global_flat, mean_delta, window=UPDATE_CHUNK_ELEMENTS
            )
        return RoundResult(ann.round_number, survivors, rnd.dropped_sites(survivors),
                           mean_delta, decoded.metrics, decoded.histogram)

    def _decode_statistics(
        self, ann: Announcement, aggregator: Aggregator, aggregate: np.ndarray
    ) -> RoundResult:
        """The noisy secure sum of the statistics release -> GlobalStatistics, kept under
        STATE and sent with every later announcement."""
        study = self.study
        if study is None:
            raise ProtocolAbort(AbortReason.ROUND_ABANDONED, "statistics round without a study")
        if self.settings.debug_write_aggregates:
            checkpoints.write_debug_aggregate(
                self.settings.state, ann.round_number, aggregate, aggregator.survivors
            )
        privacy = study.study.privacy
        source = (
            f"federated DP release, round {ann.round_number}: {len(aggregator.survivors)} "
            f"sites, epsilon {privacy.statistics_epsilon:g}, delta {privacy.delta:g} "
            "(distributed discrete Gaussian)"
        )
        stats = decode_release(ring_to_signed(aggregate), study.study, source=source)
        study.save_statistics(stats, ann.round_number)
        return RoundResult(
            ann.round_number, aggregator.survivors, aggregator.dropped,
            np.zeros(0, dtype=np.float32),
            {"contributors": float(len(aggregator.survivors))}, statistics=True,
        )

    def _commit(self, result: RoundResult) -> None:
        if result.statistics:
            # Not a training round: not counted in completed_rounds, no checkpoint.
            self.store.finish_round(
                result.round_number, status="statistics", now=self.clock(),
                survivors=result.survivors, dropped=result.dropped, metrics=result.metrics,
            )
            self.metrics.rounds_total.labels(outcome="completed").inc()
            return
        checkpoint = checkpoints.write_checkpoint(
            self.settings.state, result.round_number, layout=self.layout,
            flat=self.global_flat, optimizer_name=self.settings.optimizer.name,
            optimizer=self.optimizer,
        )
        self.store.finish_round(
            result.round_number, status="completed", now=self.clock(),
            survivors=result.survivors, dropped=result.dropped, metrics=result.metrics,
            checkpoint=checkpoint,
        )
        # Only after the new checkpoint is recorded: the store's latest record never
        # points at a deleted file.
        checkpoints.prune_checkpoints(
            self.settings.state, keep=self.settings.checkpoints.keep, protected=checkpoint.path
        )
        if "auc" in result.metrics:
            self.metrics.model_auc.set(result.metrics["auc"])
        if self.study is not None:
            if result.histogram is not None and result.histogram.sum() > 0:
                self.study.last_histogram = result.histogram
            self.study.bundle(
                round_number=result.round_number, layout=self.layout, flat=self.global_flat,
                settings=self.settings, budgets=self.budget_view.snapshot(),
                secagg=self.last_secagg,
                final=self.store.completed_rounds() >= self.total_rounds,
                hospital_epsilons=hospital_sum.replica_epsilons(self.replica),
            )
        # Only the latest result is kept: a long-running coordinator must not grow by
        # two model-sized vectors per round.
        self.last_result = result
        self.metrics.rounds_total.labels(outcome="completed").inc()

    def _log_completed(self, rnd: ActiveRound, result: RoundResult,
                       participants: list[str], seconds: float) -> None:
        ann = rnd.announcement
        log.info(
            "round %d completed: %d contributors, %d dropped, %.2f s, auc=%s",
            ann.round_number, len(result.survivors), len(result.dropped),
            seconds, result.metrics.get("auc"),
            extra={
                "event": "round_completed",
                "round_number": ann.round_number,
                "participants": ",".join(participants),
                "survivors": ",".join(result.survivors),
                "dropped": ",".join(result.dropped),
                "dropped_after_input": ",".join(sorted(rnd.dropped_after_input)),
                "kind": "statistics" if result.statistics else "training",
                "evaluation_only": ann.local_epochs == 0,
                **result.metrics,
                "secure": ann.secure_aggregation,
                "round_seconds": round(seconds, 6),
                # Idle time after a phase's last message until its deadline dropped
                # the missing sites (see ActiveRound.deadline_wait_seconds).
                "deadline_wait_seconds": round(rnd.deadline_wait_seconds, 6),
            },
        )


def _federation_ca(settings: CoordinatorSettings) -> x509.Certificate | None:
    """The federation CA replica entries must be signed under (None without one)."""
    path = settings.pki / "ca.crt"
    return load_certificate(path) if path.exists() else None
