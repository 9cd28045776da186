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
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import numpy as np

from common.codec import digest
from common.config import CoordinatorSettings
from common.errors import (
    AbortReason,
    MedfedError,
    ProtocolAbort,
    StateError,
    Unavailable,
    ValidationError,
)
from common.privacy.federation import FederationBudgetView
from common.round import Announcement, SiteBudget
from common.secagg import messages as sm
from common.secagg.client import IdentityVerifier
from common.secagg.params import (
    ROUND_NONCE_BYTES,
    SecAggParams,
    ThreatModel,
    validate_against_threat_model,
)
from common.secagg.server import SecAggServer
from coordinator import checkpoints, selection
from coordinator.aggregation import (
    UPDATE_CHUNK_ELEMENTS,
    Aggregator,
    PlainAggregator,
    SecureAggregator,
    decode_round_sum,
)
from coordinator.metrics import CoordinatorMetrics
from coordinator.optimizers import apply_step, build_optimizer
from coordinator.phases import ActiveRound, PhaseClosed, PhaseState, RoundPhase, drive
from coordinator.sessions import SiteRegistry
from coordinator.store import CoordinatorStore
from coordinator.uploads import Transfers, iter_model

log = logging.getLogger("medfed.coordinator")


@dataclass(frozen=True)
class RoundResult:
    round_number: int
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    mean_delta: np.ndarray
    metrics: dict[str, float]


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
    ) -> None:
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
        self.transfers = Transfers(settings.limits, settings.state, metrics=metrics)
        self.round: ActiveRound | None = None
        self.aggregator: Aggregator | None = None
        self.finished = asyncio.Event()  # set only when the whole study completed
        self._accumulator_lock = asyncio.Lock()
        self.optimizer = build_optimizer(settings.optimizer)
        self.layout, self.global_flat = checkpoints.load_model(
            store, settings.model, self.optimizer
        )
        self.last_round_number = 0
        self.last_result: RoundResult | None = None

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
        self.sessions.enroll(site_id, certificate_der, serial=serial, version=version,
                             device=device, budget=budget)
        return self.last_round_number

    async def wait_for_round(
        self, site_id: str, *, after_round: int, wait_seconds: float, budget: SiteBudget | None
    ) -> Announcement | None:
        """Long-poll until a round selecting this site opens (None on timeout)."""
        self.sessions.record_budget(self.sessions.session(site_id), budget)
        current = self.round
        if current is not None and current.number > after_round and current.can_rejoin(site_id):
            return current.announcement
        return await self.sessions.poll(site_id, wait_seconds=wait_seconds)

    def decline(self, site_id: str, round_number: int, *, budget: SiteBudget | None) -> None:
        self.sessions.record_budget(self.sessions.session(site_id), budget)
        self._round_for(site_id, round_number).decline(site_id)
        log.info("site %s declined round %d", site_id, round_number)

    def _round_for(self, site_id: str, round_number: int) -> ActiveRound:
        rnd = self.round
        if rnd is None or rnd.number != round_number:
            if self.store.round_status(round_number) == "abandoned":
                raise ProtocolAbort(
                    AbortReason.ROUND_ABANDONED,
                    f"round {round_number} was abandoned (coordinator restart)",
                )
            raise ProtocolAbort(
                AbortReason.WRONG_ROUND, f"round {round_number} is not the round in flight"
            )
        if site_id not in rnd.announcement.participants:
            raise StateError(f"site {site_id} is not a participant of round {round_number}")
        return rnd

    def _in_phase(self, site_id: str, round_number: int, phase: RoundPhase, *,
                  session_id: bytes | None) -> tuple[ActiveRound, PhaseState, Aggregator]:
        """The round, phase and aggregator a site's `phase` message belongs to (the
        session id is checked unless None)."""
        rnd = self._round_for(site_id, round_number)
        state = rnd.require_phase(phase, site_id)
        aggregator = self.aggregator
        if aggregator is None:
            raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "no round in flight")
        if session_id is not None:
            aggregator.check_session(session_id)
        return rnd, state, aggregator

    def model_chunks(self, site_id: str, round_number: int, chunk_bytes: int) -> Iterator[
        tuple[int, bytes]
    ]:
        """Check the caller now; then copy one chunk at a time (not the whole model)."""
        return iter_model(self._round_for(site_id, round_number), chunk_bytes)

    def download_slot(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.transfers.download_slot()

    async def advertise(
        self, site_id: str, round_number: int, nonce: bytes, msg: sm.AdvertiseKeys
    ) -> sm.Roster:
        rnd = self._round_for(site_id, round_number)
        if nonce != rnd.announcement.round_nonce:
            raise ProtocolAbort(AbortReason.WRONG_ROUND, "round nonce does not match")
        _, state, aggregator = self._in_phase(
            site_id, round_number, RoundPhase.ADVERTISE_KEYS, session_id=None
        )
        if msg.site_id != site_id:
            raise ValidationError("advertisement names another site")
        cert = self.sessions.session(site_id).certificate_der
        _secure(aggregator).receive_advertisement(site_id, msg, certificate_der=cert)
        state.mark(site_id)
        roster: sm.Roster = await rnd.wait_closed(RoundPhase.ADVERTISE_KEYS)
        return roster

    async def share_keys(
        self, site_id: str, round_number: int, session_id: bytes, msg: sm.ShareKeysOut
    ) -> sm.SharesForRecipient:
        rnd, state, aggregator = self._in_phase(
            site_id, round_number, RoundPhase.SHARE_KEYS, session_id=session_id
        )
        _secure(aggregator).receive_shares(site_id, msg)
        state.mark(site_id)
        per_site: dict[str, sm.SharesForRecipient] = await rnd.wait_closed(RoundPhase.SHARE_KEYS)
        return per_site.get(site_id, sm.SharesForRecipient(shares=()))

    async def upload(
        self,
        site_id: str,
        round_number: int,
        session_id: bytes,
        length: int,
        chunks: AsyncIterator[tuple[int, bytes]],
    ) -> sm.SurvivorList:
        """Receive one masked (or, in plain rounds, quantized) vector in chunks."""
        rnd, _, aggregator = self._in_phase(
            site_id, round_number, RoundPhase.MASKED_INPUT, session_id=session_id
        )
        if length != rnd.announcement.vector_length:
            raise ProtocolAbort(
                AbortReason.WRONG_LENGTH,
                f"vector of {length} elements, round needs {rnd.announcement.vector_length}",
            )
        await self.transfers.receive(
            rnd, site_id, length, chunks, into=aggregator, lock=self._accumulator_lock
        )
        survivors: sm.SurvivorList = await rnd.wait_closed(RoundPhase.MASKED_INPUT)
        return survivors

    async def consistency(
        self, site_id: str, round_number: int, session_id: bytes, msg: sm.ConsistencySignature
    ) -> sm.ConsistencySignatures:
        rnd, state, aggregator = self._in_phase(
            site_id, round_number, RoundPhase.CONSISTENCY_CHECK, session_id=session_id
        )
        _secure(aggregator).receive_consistency(site_id, msg)
        state.mark(site_id)
        sigs: sm.ConsistencySignatures = await rnd.wait_closed(RoundPhase.CONSISTENCY_CHECK)
        return sigs

    async def unmask(
        self, site_id: str, round_number: int, session_id: bytes, msg: sm.UnmaskShares
    ) -> int:
        rnd, state, aggregator = self._in_phase(
            site_id, round_number, RoundPhase.UNMASK, session_id=session_id
        )
        _secure(aggregator).receive_unmask(site_id, msg)
        state.mark(site_id)
        contributors: int = await rnd.wait_closed(RoundPhase.UNMASK)
        return contributors

    # --------------------------------------------------------------- main loop
    async def run(self) -> None:
        """Run rounds until the study is complete; any other exit is a failure that
        waiting sites hear as UNAVAILABLE (they retry), never as "finished"."""
        self.recover()
        try:
            while self.store.completed_rounds() < self.total_rounds:
                await self._run_round(await self.select_participants())
        except BaseException as exc:
            cause = "shutting down" if isinstance(exc, asyncio.CancelledError) else (
                f"round engine failed: {type(exc).__name__}: {exc}"
            )
            self.sessions.close(failure=Unavailable(f"coordinator {cause}"))
            raise
        self.finished.set()
        self.sessions.close(failure=None)

    async def select_participants(self) -> list[str]:
        """Wait for `min_sites` eligible sites, then briefly for the rest to arrive."""
        cfg = self.settings

        def eligible(site_ids: list[str]) -> list[str]:
            return selection.with_budget(
                site_ids,
                reports={s: self.sessions.sites[s].budget for s in site_ids},
                view={row.site_id: row for row in self.budget_view.snapshot()},
                evaluation_round=self.is_evaluation_round(),
            )

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

    def _announce(self, participants: list[str]) -> Announcement:
        payload = checkpoints.model_payload(self.layout, self.global_flat)
        return selection.announcement(
            self.settings, participants, number=self.next_round_number(participants),
            nonce=self.rng(ROUND_NONCE_BYTES), layout=self.layout,
            model_sha256=digest(payload), model_bytes=len(payload),
            evaluation_round=self.is_evaluation_round(), now=self.clock(),
        )

    def _aggregator_for(self, rnd: ActiveRound) -> Aggregator:
        ann = rnd.announcement
        if not ann.secure_aggregation:
            return PlainAggregator(rnd)
        params = SecAggParams(
            round_number=ann.round_number, round_nonce=ann.round_nonce,
            participants=ann.participants, threshold=ann.threshold,
            neighbours=ann.neighbours, vector_length=ann.vector_length,
        )
        colluding = self.settings.aggregation.max_colluding_sites
        validate_against_threat_model(params, ThreatModel(colluding, 0))
        server = SecAggServer(params, identity=self.identity)
        return SecureAggregator(rnd, server, metrics=self.metrics)

    def _timeout_for(self, rnd: ActiveRound) -> Callable[[RoundPhase], float]:
        phase_s = self.settings.deadlines.phase_seconds

        def timeout(phase: RoundPhase) -> float:
            if phase is not RoundPhase.MASKED_INPUT:
                return phase_s
            return max(rnd.announcement.train_deadline_ms / 1000 - self.clock(), 0.0) + phase_s

        return timeout

    def _phase_closed(self, rnd: ActiveRound, closed: PhaseClosed) -> None:
        name = closed.phase.value
        if closed.missing:
            log.info("round %d %s deadline: dropping %s", rnd.number, name, list(closed.missing))
            self.metrics.dropouts_total.labels(phase=name).inc(len(closed.missing))
        self.metrics.phase_seconds.labels(phase=name).observe(closed.seconds)

    async def _run_round(self, participants: list[str]) -> None:
        ann = self._announce(participants)
        started = time.perf_counter()
        self.transfers.prepare(ann.vector_length)
        self.store.begin_round(ann.round_number, participants, now=self.clock())
        self.metrics.current_round.set(ann.round_number)
        rnd = ActiveRound(ann, checkpoints.model_payload(self.layout, self.global_flat))
        aggregator = self._aggregator_for(rnd)
        self.round, self.aggregator = rnd, aggregator
        log.info(
            "round %d open: %d sites, threshold %d, neighbours %d, secure=%s",
            ann.round_number, len(participants), ann.threshold, ann.neighbours,
            ann.secure_aggregation,
        )
        self.sessions.announce(ann)
        abort: ProtocolAbort | None = ProtocolAbort(AbortReason.ROUND_ABANDONED, "round ended")
        try:
            await drive(rnd, aggregator.phases, timeout_for=self._timeout_for(rnd),
                        close=aggregator.close, lock=self._accumulator_lock,
                        on_closed=self._phase_closed)
            # Before the sum is used: a crash from here on is reported as "abandoned
            # after unmasking" at the next start (the sum existed in the clear).
            self.store.mark_unmasked(ann.round_number)
            result = await asyncio.to_thread(self._apply_update, ann, aggregator)
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
            self.round = None
            self.aggregator = None

    def _apply_update(self, ann: Announcement, aggregator: Aggregator) -> RoundResult:
        """Decode the sum and step the model (worker thread; the model is no longer
        served, so an elementwise optimizer may update it in place)."""
        aggregate = aggregator.result
        if aggregate is None:
            raise ProtocolAbort(AbortReason.ROUND_ABANDONED, "no aggregate for this round")
        survivors = aggregator.survivors
        if self.settings.debug_write_aggregates:
            # TEST ONLY: streamed straight from the ring sum before it is decoded in
            # place (a copy would add a model-sized vector to the coordinator's peak).
            checkpoints.write_debug_aggregate(
                self.settings.state, ann.round_number, aggregate, survivors
            )
        decoded = decode_round_sum(
            aggregate, model_dim=self.global_flat.size, count=len(survivors), clip=ann.clip,
            bits=ann.quantization_bits, weight_cap=ann.weight_cap,
            histogram_bins=ann.histogram_bins, evaluation_only=ann.local_epochs == 0,
        )
        mean_delta = decoded.mean_delta
        if mean_delta is None:
            mean_delta = np.zeros(self.global_flat.size, dtype=np.float32)
        else:
            self.global_flat = apply_step(
                self.optimizer, self.global_flat, mean_delta, window=UPDATE_CHUNK_ELEMENTS
            )
        return RoundResult(ann.round_number, survivors, aggregator.dropped, mean_delta,
                           decoded.metrics)

    def _commit(self, result: RoundResult) -> None:
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
        if "auc" in result.metrics:
            self.metrics.model_auc.set(result.metrics["auc"])
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
                "evaluation_only": ann.local_epochs == 0,
                **result.metrics,
                "secure": ann.secure_aggregation,
                "round_seconds": round(seconds, 6),
                # Idle time after a phase's last message until its deadline dropped
                # the missing sites (see ActiveRound.deadline_wait_seconds).
                "deadline_wait_seconds": round(rnd.deadline_wait_seconds, 6),
            },
        )


def _secure(aggregator: Aggregator) -> SecAggServer:
    if not isinstance(aggregator, SecureAggregator):
        raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "this round is not secure")
    return aggregator.server
