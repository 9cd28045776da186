"""The round engine: selects sites, drives the SecAgg+ phases with deadlines, updates
the global model and persists what must survive a crash.

It speaks dataclasses only (`common.secagg.messages`); `servicer.py` translates
protobuf and maps errors to gRPC status codes. Everything runs on one asyncio event
loop; CPU-heavy steps (adding a masked vector, unmasking) run in a worker thread
under `_accumulator_lock`, so long-polls from hundreds of sites never starve.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import datetime as dt
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.codec import (
    ChunkAssembler,
    SpoolAssembler,
    TensorSpec,
    digest,
    flat_to_bytes,
    layout_elements,
)
from common.config import CoordinatorSettings
from common.crypto.quantize import bits_for_sites, dequantize_sum, max_integer_for_sites
from common.errors import (
    AbortReason,
    ConfigError,
    MedfedError,
    ProtocolAbort,
    StateError,
    ValidationError,
)
from common.evaluation import operating_point_metrics
from common.modelfile import ModelFile, flat_layout, read_model_file, write_model_file
from common.privacy.federation import FederationBudgetView, has_budget_left
from common.privacy.ledger import BudgetStatus
from common.secagg import messages as sm
from common.secagg.client import IdentityVerifier
from common.secagg.params import (
    ROUND_NONCE_BYTES,
    SecAggParams,
    ThreatModel,
    choose_parameters,
    validate_against_threat_model,
)
from common.secagg.server import SecAggServer
from coordinator.metrics import CoordinatorMetrics
from coordinator.optimizers import FedAdam, FedAvg, FedYogi, ServerOptimizer, weighted_mean
from coordinator.rounds import ActiveRound, Announcement, PhaseState, RoundPhase
from coordinator.store import Checkpoint, CoordinatorStore

log = logging.getLogger("medfed.coordinator")

STAGING_BUDGET_BYTES = 64 << 20
"""Upload staging memory: with a large model, fewer concurrent uploads are staged
(at least one), so coordinator memory stays a small multiple of one model."""

MIN_CONCURRENT_DOWNLOADS = 2
"""Model downloads streamed at once, at least; more while they fit STAGING_BUDGET_BYTES.
Each open stream can hold up to a flow-control window of sent-but-unread chunks in
gRPC's buffers, so ten concurrent 40 MB downloads cost the coordinator ~150 MB."""

DOWNLOAD_SLOT_WAIT_SECONDS = 10.0
"""A download waits at most this long for a slot, then streams anyway: a site that
opens downloads and never reads them can cost memory, but cannot stall the round."""

UPDATE_CHUNK_ELEMENTS = 1 << 18
"""Window of the decode/optimizer pass: float64 temporaries stay at 2 MiB, not 2 x d."""



def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None elsewhere (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def release_freed_memory() -> None:
    """Hand memory freed by the upload streams back to the OS.

    A round streams hundreds of 1 MiB chunks through gRPC and Python; glibc keeps
    the freed chunks in its arenas, so without a trim the coordinator's RSS carries
    ~2 models' worth of dead buffers into the unmask and checkpoint steps.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass
class SiteBudget:
    """What a site last reported about its own ledger (epsilon_budget 0: no ledger,
    i.e. a run without DP accounting)."""

    epsilon_budget: float = 0.0
    epsilon_spent: float = 0.0
    delta: float = 0.0
    privacy_unit: str = ""
    reported_exhausted: bool = False
    ledger_entries: int = 0
    ledger_head: str = ""
    ledger_last_round: int | None = None

    @property
    def exhausted(self) -> bool:
        if self.reported_exhausted:
            return True
        return self.epsilon_budget > 0 and self.epsilon_spent >= self.epsilon_budget

    def as_status(self, site_id: str) -> BudgetStatus:
        """The report in the federation view's terms."""
        return BudgetStatus(
            site_id=site_id,
            budget_epsilon=self.epsilon_budget,
            delta=self.delta,
            spent_epsilon=self.epsilon_spent,
            remaining_epsilon=max(0.0, self.epsilon_budget - self.epsilon_spent),
            last_round=self.ledger_last_round,
            exhausted=self.exhausted,
            privacy_unit=self.privacy_unit or "record",
            ledger_entries=self.ledger_entries,
            ledger_head=self.ledger_head,
        )


@dataclass
class SiteSession:
    """What the coordinator knows about a connected site (not persisted)."""

    site_id: str
    certificate_der: bytes
    budget: SiteBudget = field(default_factory=SiteBudget)
    budget_reported: bool = False
    waiting: asyncio.Future[Announcement | None] | None = None


@dataclass(frozen=True)
class RoundResult:
    round_number: int
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    mean_delta: np.ndarray
    metrics: dict[str, float]


def build_optimizer(settings: CoordinatorSettings) -> ServerOptimizer:
    opt = settings.optimizer
    if opt.name == "fedavg":
        return FedAvg(server_lr=opt.server_lr)
    cls = FedAdam if opt.name == "fedadam" else FedYogi
    return cls(lr=opt.server_lr, beta1=opt.beta1, beta2=opt.beta2, tau=opt.tau)


class RoundEngine:
    """Runs `settings.rounds` rounds, one at a time."""

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
        self.threat = ThreatModel(
            max_colluding_sites=settings.aggregation.max_colluding_sites,
            max_dropouts=0,
        )
        self.sites: dict[str, SiteSession] = {}
        self.round: ActiveRound | None = None
        self.secagg: SecAggServer | None = None
        self.finished = asyncio.Event()
        self._changed = asyncio.Event()
        self._accumulator_lock = asyncio.Lock()
        self._plain_sum: np.ndarray | None = None
        self._upload_slots = asyncio.Semaphore(settings.limits.max_concurrent_uploads)
        self.download_slots = asyncio.Semaphore(MIN_CONCURRENT_DOWNLOADS)
        self.optimizer = build_optimizer(settings)
        self.layout, self.global_flat = self._load_model()
        self.model_dim = layout_elements(self.layout)
        self.last_round_number = 0
        self.last_result: RoundResult | None = None

    # ------------------------------------------------------------------ start-up
    def _load_model(self) -> tuple[tuple[TensorSpec, ...], np.ndarray]:
        """Latest good checkpoint if there is one, else the configured initial model."""
        ckpt = self.store.latest_checkpoint()
        if ckpt is not None:
            model = read_model_file(ckpt.path)
            if digest(flat_to_bytes(model.flat, model.layout)).hex() != ckpt.sha256:
                raise StateError(f"checkpoint {ckpt.path} does not match its recorded digest")
            self.optimizer.load_state_dict(dict(model.extras))
            log.info("resuming from checkpoint of round %d", ckpt.round_number)
            return model.layout, model.flat
        cfg = self.settings.model
        if cfg.init_file is not None:
            model = read_model_file(cfg.init_file)
            return model.layout, model.flat
        if cfg.dim is None:  # excluded by ModelSection validation
            raise ConfigError("model", "no initial model configured")
        return flat_layout(cfg.dim), np.zeros(cfg.dim, dtype=np.float32)

    @property
    def total_rounds(self) -> int:
        return self.settings.rounds + (1 if self.settings.training.final_evaluation else 0)

    def is_evaluation_round(self) -> bool:
        return self.store.completed_rounds() >= self.settings.rounds

    def recover(self) -> None:
        """After a crash: abandon the round that was in flight; nothing is unmasked."""
        abandoned = self.store.abandon_in_flight(now=self.clock())
        for number in abandoned:
            log.warning("round %d was in flight at a crash: abandoned", number)
            self.metrics.rounds_total.labels(outcome="abandoned").inc()
        self.last_round_number = self.store.next_round_number() - 1
        # Budget gauges show the persisted federation view before any site reports again.
        for row in self.budget_view.snapshot():
            self.metrics.observe_budget(row.site_id, row.spent_epsilon, row.budget_epsilon)

    @property
    def vector_length(self) -> int:
        return self.model_dim + 1 + 2 * self.settings.aggregation.histogram_bins

    # --------------------------------------------------------------- membership
    def enroll(self, site_id: str, certificate_der: bytes, *, serial: str, version: str,
               device: str, budget: SiteBudget) -> int:
        session = self.sites.get(site_id)
        if session is None:
            session = self.sites[site_id] = SiteSession(site_id, certificate_der)
        session.certificate_der = certificate_der
        self.store.record_site(
            site_id, cert_serial=serial, agent_version=version, device=device, now=self.clock()
        )
        self._record_budget(session, budget)
        self.metrics.sites_enrolled.set(len(self.store.enrolled_sites()))
        self._changed.set()
        return self.last_round_number

    def _record_budget(self, session: SiteSession, budget: SiteBudget) -> None:
        """Keep a site's budget report in the session and in the federation view.

        A site without a ledger (budget 0: no DP accounting) is not entered in the view.
        A report whose spend or ledger length went DOWN is refused by the view (a ledger
        is append-only): the higher recorded spend keeps governing selection, and the
        operator is warned, since that site's ledger was reset or rewritten."""
        if session.budget_reported and budget == session.budget:
            return  # every long-poll repeats the report: no database write when unchanged
        session.budget = budget
        session.budget_reported = True
        site_id = session.site_id
        spent, total = budget.epsilon_spent, budget.epsilon_budget
        if budget.epsilon_budget > 0 or budget.ledger_entries > 0:
            now = dt.datetime.fromtimestamp(self.clock(), dt.UTC)
            try:
                row = self.budget_view.update_site(site_id, budget.as_status(site_id), now=now)
            except StateError as exc:
                log.warning("budget report of site %s ignored: %s", site_id, exc)
                recorded = self.budget_view.get(site_id)
                if recorded is not None:
                    spent, total = recorded.spent_epsilon, recorded.budget_epsilon
            else:
                spent, total = row.spent_epsilon, row.budget_epsilon
        self.metrics.observe_budget(site_id, spent, total)
        self._changed.set()

    def _with_budget(self, site_ids: list[str]) -> list[str]:
        """The sites (order kept) that selection may pick, judged by the federation view:
        not exhausted and more than `MIN_REMAINING_EPSILON` left. A site with no row
        in the view is one that keeps no ledger (runs without DP accounting). The final
        evaluation round trains nothing and spends no budget: every site may join it."""
        if self.is_evaluation_round():
            return list(site_ids)
        rows = {row.site_id: row for row in self.budget_view.snapshot()}
        chosen = []
        for site_id in site_ids:
            row = rows.get(site_id)
            if self.sites[site_id].budget.exhausted:
                continue
            if row is None or has_budget_left(row):
                chosen.append(site_id)
        return chosen

    def _session(self, site_id: str) -> SiteSession:
        session = self.sites.get(site_id)
        if session is None:
            raise StateError(f"site {site_id} has not enrolled since the coordinator started")
        return session

    async def wait_for_round(
        self, site_id: str, *, after_round: int, wait_seconds: float, budget: SiteBudget | None
    ) -> Announcement | None:
        """Long-poll until a round selecting this site opens (None on timeout)."""
        session = self._session(site_id)
        if budget is not None:
            self._record_budget(session, budget)
        current = self.round
        if current is not None and current.number > after_round:
            # A site that reconnects while the round it was chosen for is still in its
            # first phase (and has not sent anything yet) may still join it.
            first = current.phases.get(current.first_phase)
            if (
                first is not None
                and current.phase is current.first_phase
                and site_id in first.expected
                and site_id not in first.arrived
            ):
                return current.announcement
        if self.finished.is_set():
            return None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Announcement | None] = loop.create_future()
        if session.waiting is not None and not session.waiting.done():
            session.waiting.set_result(None)  # a newer poll replaces an older one
        session.waiting = future
        self._changed.set()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(future), timeout=wait_seconds)
        finally:
            # Also when the RPC is cancelled (the site hung up or its deadline passed):
            # a site that is no longer polling must not count as waiting, or selection
            # would open a round for it and the round would wait out its first phase.
            if session.waiting is future:
                session.waiting = None
                self._changed.set()
        # No await between the check and here: selection cannot pick this site after
        # it stopped waiting, and an announcement that raced the timeout is not lost.
        return future.result() if future.done() and not future.cancelled() else None

    def decline(self, site_id: str, round_number: int, *, budget: SiteBudget | None) -> None:
        session = self._session(site_id)
        if budget is not None:
            self._record_budget(session, budget)
        rnd = self._round_for(site_id, round_number)
        rnd.declined.add(site_id)
        log.info("site %s declined round %d", site_id, round_number)
        for state in rnd.phases.values():
            if not state.closed.is_set():
                state.expected.discard(site_id)
                if state.expected <= state.arrived:
                    state.all_arrived.set()

    def _round_for(self, site_id: str, round_number: int) -> ActiveRound:
        rnd = self.round
        if rnd is None or rnd.number != round_number:
            status = self.store.round_status(round_number)
            if status == "abandoned":
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

    def model_chunks(self, site_id: str, round_number: int, chunk_bytes: int) -> Iterator[
        tuple[int, bytes]
    ]:
        """Check the caller now; then copy one chunk at a time (not the whole model)."""
        rnd = self._round_for(site_id, round_number)
        return self._iter_model(rnd, chunk_bytes)

    @staticmethod
    def _iter_model(rnd: ActiveRound, chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
        view = memoryview(rnd.model_bytes)
        for offset in range(0, len(view), chunk_bytes):
            if rnd.phase is RoundPhase.FINISHED or rnd.model_released:
                # The global model is being updated in place: stop rather than tear.
                raise StateError(f"round {rnd.number} no longer serves its model")
            yield offset, bytes(view[offset : offset + chunk_bytes])

    # ------------------------------------------------------------ secure phases
    def _secure(self) -> SecAggServer:
        if self.secagg is None:
            raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "this round is not secure")
        return self.secagg

    def _check_session(self, session_id: bytes) -> None:
        server = self._secure()
        expected = server.session_id
        if expected is None or session_id != expected:
            raise ProtocolAbort(AbortReason.WRONG_SESSION, "session id does not match")

    async def advertise(
        self, site_id: str, round_number: int, nonce: bytes, msg: sm.AdvertiseKeys
    ) -> sm.Roster:
        rnd = self._round_for(site_id, round_number)
        if nonce != rnd.announcement.round_nonce:
            raise ProtocolAbort(AbortReason.WRONG_ROUND, "round nonce does not match")
        state = rnd.require_phase(RoundPhase.ADVERTISE_KEYS, site_id)
        if msg.site_id != site_id:
            raise ValidationError("advertisement names another site")
        cert = self._session(site_id).certificate_der
        self._secure().receive_advertisement(site_id, msg, certificate_der=cert)
        state.mark(site_id)
        roster: sm.Roster = await rnd.wait_closed(RoundPhase.ADVERTISE_KEYS)
        return roster

    async def share_keys(
        self, site_id: str, round_number: int, session_id: bytes, msg: sm.ShareKeysOut
    ) -> sm.SharesForRecipient:
        rnd = self._round_for(site_id, round_number)
        state = rnd.require_phase(RoundPhase.SHARE_KEYS, site_id)
        self._check_session(session_id)
        self._secure().receive_shares(site_id, msg)
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
        rnd = self._round_for(site_id, round_number)
        state = rnd.require_phase(RoundPhase.MASKED_INPUT, site_id)
        if rnd.announcement.secure_aggregation:
            self._check_session(session_id)
        elif session_id:
            raise ValidationError("plain rounds carry no session id")
        if length != rnd.announcement.vector_length:
            raise ProtocolAbort(
                AbortReason.WRONG_LENGTH,
                f"vector of {length} elements, round needs {rnd.announcement.vector_length}",
            )
        # One stream per site at a time: otherwise one site could take every upload
        # slot with streams that stall after the header (slow loris).
        if site_id in rnd.uploading:
            raise StateError(f"an upload from {site_id} is already in progress")
        rnd.uploading.add(site_id)
        try:
            await self._receive_and_add(rnd, state, site_id, length, chunks)
        except ProtocolAbort as exc:
            if exc.reason is AbortReason.UPLOAD_IDLE:
                self._drop_stalled_uploader(rnd, state, site_id)
            raise
        finally:
            rnd.uploading.discard(site_id)
        self.metrics.bytes_received.inc(length * 4)
        survivors: sm.SurvivorList = await rnd.wait_closed(RoundPhase.MASKED_INPUT)
        return survivors

    def _drop_stalled_uploader(self, rnd: ActiveRound, state: PhaseState, site_id: str) -> None:
        """Drop a site whose upload stalled from MaskedInput now, as the deadline would
        later: site agents do not resend an upload the coordinator cut, so waiting for
        it would only hold every other site until the phase deadline. SecAgg+ treats it
        as any dropout (its masks are recovered at Unmask)."""
        if state.closed.is_set() or site_id in state.arrived or site_id not in state.expected:
            return
        state.expected.discard(site_id)
        log.info("round %d: upload of %s stalled: dropped", rnd.number, site_id)
        self.metrics.dropouts_total.labels(phase=RoundPhase.MASKED_INPUT.value).inc()
        if state.expected <= state.arrived:
            state.all_arrived.set()

    async def _receive_and_add(
        self,
        rnd: ActiveRound,
        state: PhaseState,
        site_id: str,
        length: int,
        chunks: AsyncIterator[tuple[int, bytes]],
    ) -> None:
        # A bounded number of staging buffers, each freed after its upload: between
        # uploads the coordinator holds only the accumulator.
        limits = self.settings.limits
        async with self._upload_slots:
            if length * 4 > limits.upload_spool_bytes:
                # Very large vectors are staged on disk: the coordinator's memory then
                # holds the model and the accumulator, not one more vector per upload.
                spool = SpoolAssembler(
                    str(self.settings.state), total_bytes=length * 4,
                    max_chunk_bytes=limits.max_chunk_bytes,
                )
                try:
                    await self._receive_before_close(rnd, state, spool, chunks)
                    async with self._accumulator_lock:
                        rnd.require_phase(RoundPhase.MASKED_INPUT, site_id)
                        await asyncio.to_thread(self._accumulate_windows, rnd, site_id, spool)
                        state.mark(site_id)
                finally:
                    spool.close()
                return
            buffer = np.empty(length, dtype=np.uint32)
            assembler = ChunkAssembler(
                buffer, total_bytes=length * 4, max_chunk_bytes=limits.max_chunk_bytes
            )
            await self._receive_before_close(rnd, state, assembler, chunks)
            async with self._accumulator_lock:
                # Re-check under the lock: the deadline may have closed the phase
                # while this site was still streaming.
                rnd.require_phase(RoundPhase.MASKED_INPUT, site_id)
                await asyncio.to_thread(self._accumulate, rnd, site_id, buffer)
                state.mark(site_id)
            del buffer

    async def _receive_before_close(
        self,
        rnd: ActiveRound,
        state: PhaseState,
        assembler: ChunkAssembler,
        chunks: AsyncIterator[tuple[int, bytes]],
    ) -> None:
        """A stream still open when MaskedInput closes is cut off (its data could no
        longer be used), so a stalled stream frees its upload slot at the deadline."""
        receive = asyncio.ensure_future(self._receive_into(assembler, chunks))
        closed = asyncio.ensure_future(state.closed.wait())
        try:
            await asyncio.wait({receive, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            if not receive.done():
                receive.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await receive
        if receive.cancelled():
            raise ProtocolAbort(
                AbortReason.UNEXPECTED_MESSAGE,
                f"round {rnd.number}: masked input closed before the upload ended",
            )
        receive.result()  # the stream's ValidationError, if any

    async def _receive_into(
        self, assembler: ChunkAssembler, chunks: AsyncIterator[tuple[int, bytes]]
    ) -> None:
        idle = self.settings.limits.upload_idle_seconds
        loop = asyncio.get_running_loop()
        try:
            # One deadline, pushed forward after every chunk: a stream that sends nothing
            # for `idle` seconds is cut and frees its staging slot (slow loris), while a
            # large model that streams steadily may take as long as the phase allows.
            async with asyncio.timeout(idle) as window:
                async for offset, data in chunks:
                    assembler.add(offset, data)
                    window.reschedule(loop.time() + idle)
        except TimeoutError:
            raise ProtocolAbort(
                AbortReason.UPLOAD_IDLE, f"no upload chunk for {idle:g} s: stream cut"
            ) from None
        assembler.finish()

    def _accumulate_windows(self, rnd: ActiveRound, site_id: str, spool: SpoolAssembler) -> None:
        windows = spool.windows(UPDATE_CHUNK_ELEMENTS)
        if rnd.announcement.secure_aggregation:
            self._secure().receive_masked_input_windows(site_id, windows)
            return
        if self._plain_sum is None:
            raise StateError("no accumulator for this round")
        position = 0
        for window in windows:
            part = self._plain_sum[position : position + window.size]
            np.add(part, window, out=part)
            position += window.size

    def _accumulate(self, rnd: ActiveRound, site_id: str, vector: np.ndarray) -> None:
        if rnd.announcement.secure_aggregation:
            self._secure().receive_masked_input(site_id, sm.MaskedInput(vector=vector))
        else:
            if self._plain_sum is None:
                raise StateError("no accumulator for this round")
            np.add(self._plain_sum, vector, out=self._plain_sum)

    async def consistency(
        self, site_id: str, round_number: int, session_id: bytes, msg: sm.ConsistencySignature
    ) -> sm.ConsistencySignatures:
        rnd = self._round_for(site_id, round_number)
        state = rnd.require_phase(RoundPhase.CONSISTENCY_CHECK, site_id)
        self._check_session(session_id)
        self._secure().receive_consistency(site_id, msg)
        state.mark(site_id)
        sigs: sm.ConsistencySignatures = await rnd.wait_closed(RoundPhase.CONSISTENCY_CHECK)
        return sigs

    async def unmask(
        self, site_id: str, round_number: int, session_id: bytes, msg: sm.UnmaskShares
    ) -> int:
        rnd = self._round_for(site_id, round_number)
        state = rnd.require_phase(RoundPhase.UNMASK, site_id)
        self._check_session(session_id)
        self._secure().receive_unmask(site_id, msg)
        state.mark(site_id)
        contributors: int = await rnd.wait_closed(RoundPhase.UNMASK)
        return contributors

    # --------------------------------------------------------------- main loop
    async def run(self) -> None:
        """Run rounds until `settings.rounds` have completed."""
        self.recover()
        try:
            while self.store.completed_rounds() < self.total_rounds:
                participants = await self._select()
                await self._run_round(participants)
        finally:
            self.finished.set()
            for session in self.sites.values():
                if session.waiting is not None and not session.waiting.done():
                    session.waiting.set_result(None)

    def _eligible_waiting(self) -> list[str]:
        return self._with_budget(
            sorted(
                s.site_id
                for s in self.sites.values()
                if s.waiting is not None and not s.waiting.done()
            )
        )

    def _eligible_connected(self) -> list[str]:
        return self._with_budget(sorted(self.sites))

    async def _wait_changed(self, timeout: float) -> None:
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout=timeout)

    async def _select(self) -> list[str]:
        """Wait for `min_sites` eligible sites, then briefly for the rest to arrive."""
        cfg = self.settings
        loop = asyncio.get_running_loop()
        give_up = loop.time() + cfg.deadlines.round_start_timeout_seconds
        while len(self._eligible_waiting()) < cfg.min_sites:
            remaining = give_up - loop.time()
            if remaining <= 0:
                raise StateError(
                    f"fewer than min_sites={cfg.min_sites} eligible sites for "
                    f"{cfg.deadlines.round_start_timeout_seconds:.0f} s"
                )
            self.metrics.sites_active.set(len(self._eligible_waiting()))
            await self._wait_changed(min(remaining, 5.0))
        grace_end = loop.time() + cfg.deadlines.selection_seconds
        while set(self._eligible_waiting()) != set(self._eligible_connected()):
            remaining = grace_end - loop.time()
            if remaining <= 0:
                break
            await self._wait_changed(remaining)
        chosen = self._eligible_waiting()[: cfg.limits.max_sites]
        self.metrics.sites_active.set(len(chosen))
        return chosen

    def _round_parameters(self, n_sites: int) -> tuple[int, int]:
        agg = self.settings.aggregation
        if not agg.secure_aggregation:
            return 0, 0
        dropouts = agg.max_dropouts
        if dropouts == "auto":
            # As many dropouts as the collusion bound leaves room for.
            dropouts = 0
            while True:
                try:
                    choose_parameters(
                        n_sites,
                        ThreatModel(self.threat.max_colluding_sites, dropouts + 1),
                        agg.neighbours,
                    )
                except ConfigError:
                    break
                dropouts += 1
        threat = ThreatModel(self.threat.max_colluding_sites, dropouts)
        threshold, neighbours = choose_parameters(n_sites, threat, agg.neighbours)
        if agg.threshold != "auto":
            threshold = agg.threshold
        return threshold, neighbours

    def _announce(self, participants: list[str]) -> Announcement:
        cfg = self.settings
        number = self.next_round_number(participants)
        threshold, neighbours = self._round_parameters(len(participants))
        nonce = self.rng(ROUND_NONCE_BYTES)
        model_bytes = self._model_payload()
        weight_cap = min(cfg.aggregation.weight_cap, max_integer_for_sites(len(participants)))
        now = self.clock()
        return Announcement(
            round_number=number,
            round_nonce=nonce,
            participants=tuple(participants),
            threshold=threshold,
            neighbours=neighbours,
            vector_length=self.vector_length,
            quantization_bits=bits_for_sites(len(participants)),
            clip=cfg.aggregation.clip,
            histogram_bins=cfg.aggregation.histogram_bins,
            secure_aggregation=cfg.aggregation.secure_aggregation,
            model_layout=self.layout,
            model_sha256=digest(model_bytes),
            model_bytes=len(model_bytes),
            # After the planned training rounds, one evaluation-only round (no training,
            # no privacy spend) measures the final model through the same secure sum.
            local_epochs=0 if self.is_evaluation_round() else cfg.training.local_epochs,
            learning_rate=cfg.training.learning_rate,
            fedprox_mu=cfg.training.fedprox_mu,
            planned_rounds=cfg.rounds,
            train_deadline_ms=int((now + cfg.deadlines.train_seconds) * 1000),
            phase_timeout_ms=int(cfg.deadlines.phase_seconds * 1000),
            weight_cap=weight_cap,
            max_chunk_bytes=cfg.limits.max_chunk_bytes,
        )

    def next_round_number(self, participants: list[str]) -> int:
        """The next round number: after every round this coordinator ever recorded AND
        after every round the participants' own ledgers already hold. A coordinator
        restored from an old backup (or started on empty state) would otherwise reuse
        round numbers that sites have spent budget on, and they refuse such rounds."""
        seen = [
            self.sites[s].budget.ledger_last_round or 0 for s in participants if s in self.sites
        ]
        return max([self.store.next_round_number(), *(n + 1 for n in seen)])

    def _prepare_buffers(self, length: int) -> None:
        """Bound concurrent uploads by max_concurrent_uploads and the staging budget."""
        fits = max(1, STAGING_BUDGET_BYTES // max(length * 4, 1))
        self._upload_slots = asyncio.Semaphore(
            min(self.settings.limits.max_concurrent_uploads, fits)
        )
        self.download_slots = asyncio.Semaphore(max(MIN_CONCURRENT_DOWNLOADS, fits))

    @contextlib.asynccontextmanager
    async def download_slot(self) -> AsyncIterator[None]:
        """Hold one of the bounded download slots while streaming the model."""
        slots = self.download_slots
        try:
            await asyncio.wait_for(slots.acquire(), timeout=DOWNLOAD_SLOT_WAIT_SECONDS)
        except TimeoutError:
            log.warning("no free download slot after %.0f s: streaming without one",
                        DOWNLOAD_SLOT_WAIT_SECONDS)
            yield
            return
        try:
            yield
        finally:
            slots.release()

    def _model_payload(self) -> bytes | memoryview:
        """The model's wire bytes: a zero-copy view when the layout is all float32 LE."""
        flat = self.global_flat
        if (
            all(spec.dtype == "<f4" for spec in self.layout)
            and flat.dtype == np.dtype("<f4")
            and flat.ndim == 1
            and flat.flags.c_contiguous
            and flat.size == self.model_dim
        ):
            return flat.data.cast("B")
        return flat_to_bytes(flat, self.layout)

    async def _run_round(self, participants: list[str]) -> None:
        ann = self._announce(participants)
        started = time.perf_counter()
        self._prepare_buffers(ann.vector_length)
        self.store.begin_round(ann.round_number, participants, now=self.clock())
        self.metrics.current_round.set(ann.round_number)
        rnd = ActiveRound(ann, self._model_payload())
        self.round = rnd
        if ann.secure_aggregation:
            params = SecAggParams(
                round_number=ann.round_number,
                round_nonce=ann.round_nonce,
                participants=ann.participants,
                threshold=ann.threshold,
                neighbours=ann.neighbours,
                vector_length=ann.vector_length,
            )
            validate_against_threat_model(params, ThreatModel(self.threat.max_colluding_sites, 0))
            self.secagg = SecAggServer(params, identity=self.identity)
            self._plain_sum = None
        else:
            self.secagg = None
            self._plain_sum = np.zeros(ann.vector_length, dtype=np.uint32)
        log.info(
            "round %d open: %d sites, threshold %d, neighbours %d, secure=%s",
            ann.round_number, len(participants), ann.threshold, ann.neighbours,
            ann.secure_aggregation,
        )
        for site_id in participants:
            waiting = self.sites[site_id].waiting
            if waiting is not None and not waiting.done():
                waiting.set_result(ann)
        try:
            if ann.secure_aggregation:
                aggregate, survivors, dropped = await self._secure_phases(rnd)
            else:
                aggregate, survivors, dropped = await self._plain_phases(rnd)
            # No chunk of the old model is served once the update starts (it may be
            # applied in place); set on the event loop before the worker thread runs.
            rnd.model_released = True
            update_started = time.perf_counter()
            result = await asyncio.to_thread(
                self._apply_update, ann, aggregate, survivors, dropped
            )
            del aggregate
            log.debug("round %d model updated in %.3f s", ann.round_number,
                      time.perf_counter() - update_started)
        except MedfedError as exc:
            rnd.abort = exc if isinstance(exc, ProtocolAbort) else ProtocolAbort(
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
            commit_started = time.perf_counter()
            self._commit(result)
            log.debug("round %d checkpoint committed in %.3f s", ann.round_number,
                      time.perf_counter() - commit_started)
            self.metrics.rounds_total.labels(outcome="completed").inc()
            seconds = time.perf_counter() - started
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
        finally:
            rnd.phase = RoundPhase.FINISHED
            rnd.finished.set()
            self.last_round_number = ann.round_number
            self.round = None
            self.secagg = None
            self._plain_sum = None

    async def _close_when_ready(self, rnd: ActiveRound, state: PhaseState, timeout: float) -> None:
        started = time.perf_counter()
        try:
            await asyncio.wait_for(state.all_arrived.wait(), timeout=max(timeout, 0.0))
        except TimeoutError:
            last = state.last_arrival if state.last_arrival is not None else started
            rnd.deadline_wait_seconds += time.perf_counter() - max(last, started)
            missing = sorted(state.expected - state.arrived)
            log.info("round %d %s deadline: dropping %s", rnd.number, rnd.phase.value, missing)
            self.metrics.dropouts_total.labels(phase=rnd.phase.value).inc(len(missing))
        elapsed = time.perf_counter() - started
        self.metrics.phase_seconds.labels(phase=rnd.phase.value).observe(elapsed)
        log.debug("round %d %s closed after %.3f s: %d of %d arrived", rnd.number,
                  rnd.phase.value, elapsed, len(state.arrived), len(state.expected))

    def _advance(self, rnd: ActiveRound, current: PhaseState, output: object,
                 nxt: RoundPhase | None, expected: set[str]) -> PhaseState | None:
        """Publish a phase's output; open the next phase BEFORE waking the long-polls,
        so a fast site's next message always finds its phase open."""
        current.output = output
        new_state = rnd.open_phase(nxt, expected) if nxt is not None else None
        current.closed.set()
        return new_state

    async def _secure_phases(
        self, rnd: ActiveRound
    ) -> tuple[np.ndarray, tuple[str, ...], tuple[str, ...]]:
        server = self._secure()
        ann = rnd.announcement
        phase_s = self.settings.deadlines.phase_seconds
        # Keys first: sites advertise and share keys as soon as they hear of the round,
        # then download and train; uploads then overlap other sites' training exactly as
        # in plain FedAvg, and only Consistency and Unmask come after the last upload.
        state = rnd.open_phase(RoundPhase.ADVERTISE_KEYS, set(ann.participants))
        await self._close_when_ready(rnd, state, phase_s)
        roster = server.close_advertise()
        in_roster = {e.site_id for e in roster.entries}
        state = self._advance(rnd, state, roster, RoundPhase.SHARE_KEYS, in_roster)
        _require(state)
        await self._close_when_ready(rnd, state, phase_s)
        per_site = server.close_shares()
        state = self._advance(rnd, state, per_site, RoundPhase.MASKED_INPUT, set(per_site))
        _require(state)
        train_left = ann.train_deadline_ms / 1000 - self.clock()
        await self._close_when_ready(rnd, state, max(train_left, 0.0) + phase_s)
        async with self._accumulator_lock:
            survivors = server.close_masked_input()
            state = self._advance(
                rnd, state, survivors, RoundPhase.CONSISTENCY_CHECK, set(survivors.survivors)
            )
        release_freed_memory()
        _require(state)
        await self._close_when_ready(rnd, state, phase_s)
        signatures = server.close_consistency()
        signers = {site for site, _ in signatures.signatures}
        state = self._advance(rnd, state, signatures, RoundPhase.UNMASK, signers)
        _require(state)
        await self._close_when_ready(rnd, state, phase_s)
        unmask_started = time.perf_counter()
        try:
            aggregate = await asyncio.to_thread(server.close_unmask)
        finally:
            self._report_misbehaving(rnd, server)
        self.metrics.unmask_seconds.observe(time.perf_counter() - unmask_started)
        log.debug("round %d unmasked in %.3f s", rnd.number, time.perf_counter() - unmask_started)
        self.metrics.quorum_margin.set(len(survivors.survivors) - ann.threshold)
        # Sites whose input is in the sum but that vanished before unmasking: their
        # self-masks were removed with the other survivors' shares.
        rnd.dropped_after_input = set(survivors.survivors) - state.arrived
        self._advance(rnd, state, len(survivors.survivors), None, set())
        return aggregate, survivors.survivors, survivors.dropped

    def _report_misbehaving(self, rnd: ActiveRound, server: SecAggServer) -> None:
        """Name the sites whose Unmask shares were wrong (corrected, or the round
        aborted): they are malicious or broken, and an operator should know."""
        for holder, owners in sorted(server.misbehaving_sites.items()):
            log.warning(
                "round %d: %s revealed wrong unmask shares of %s",
                rnd.number, holder, ",".join(owners),
                extra={"event": "misbehaving_site", "round_number": rnd.number,
                       "site": holder, "owners": ",".join(owners)},
            )
            self.metrics.misbehaving_total.labels(site=holder).inc()

    async def _plain_phases(
        self, rnd: ActiveRound
    ) -> tuple[np.ndarray, tuple[str, ...], tuple[str, ...]]:
        ann = rnd.announcement
        state = rnd.open_phase(RoundPhase.MASKED_INPUT, set(ann.participants))
        train_left = ann.train_deadline_ms / 1000 - self.clock()
        await self._close_when_ready(rnd, state, train_left + self.settings.deadlines.phase_seconds)
        async with self._accumulator_lock:
            survivors = tuple(sorted(state.arrived))
            dropped = tuple(sorted(set(ann.participants) - state.arrived - rnd.declined))
            listing = sm.SurvivorList(survivors=survivors, dropped=dropped)
            self._advance(rnd, state, listing, None, set())
            if self._plain_sum is None:
                raise StateError("no accumulator for this round")
            aggregate = self._plain_sum.copy()
        release_freed_memory()
        if not survivors:
            raise ProtocolAbort(AbortReason.TOO_FEW_PARTICIPANTS, "no site uploaded")
        return aggregate, survivors, dropped

    # ------------------------------------------------------------ model update
    def _apply_update(
        self,
        ann: Announcement,
        aggregate: np.ndarray,
        survivors: tuple[str, ...],
        dropped: tuple[str, ...],
    ) -> RoundResult:
        bins = ann.histogram_bins
        count = len(survivors)
        if aggregate.dtype != np.uint32 or aggregate.ndim != 1 or aggregate.size < self.model_dim:
            raise ValidationError("aggregate must be a uint32 vector covering the model")
        # Validates clip, bits and that `count` sums cannot have wrapped (decode_sum's checks).
        dequantize_sum(aggregate[:0], clip=ann.clip, bits=ann.quantization_bits, count=count)
        integers = [int(v) for v in aggregate[self.model_dim :]]
        weight_sum = integers[0]
        histogram = np.asarray(integers[1:], dtype=np.int64)
        metrics: dict[str, float] = {"contributors": float(len(survivors))}
        if histogram.sum() > 0:
            m = operating_point_metrics(histogram, bins=bins)
            metrics.update(
                auc=m.auc, sensitivity=m.sensitivity, specificity=m.specificity, ppv=m.ppv,
                evaluated=float(m.n),
            )
        if self.settings.debug_write_aggregates:
            # TEST ONLY: streamed straight from the ring sum before it is decoded in
            # place (a copy would add a model-sized vector to the coordinator's peak).
            self._write_debug_aggregate(ann.round_number, aggregate, survivors)
        if ann.local_epochs == 0 or weight_sum == 0:
            mean_delta = np.zeros(self.model_dim, dtype=np.float32)
        else:
            mean_delta = self._mean_delta(ann, aggregate, count=count, weight_sum=weight_sum)
            self._server_step(mean_delta)
        return RoundResult(ann.round_number, survivors, dropped, mean_delta, metrics)

    def _mean_delta(
        self, ann: Announcement, aggregate: np.ndarray, *, count: int, weight_sum: int
    ) -> np.ndarray:
        """Decode the ring sum window by window into the float32 weighted mean delta.

        Elementwise the same arithmetic as decoding the whole vector at once, without
        d-sized float64 temporaries (2 x 8 bytes per parameter at d = 10^7).
        """
        # The mean is written over the ring sum itself (same 4 bytes per element, each
        # window decoded into `scratch` before it is overwritten): no third model-sized
        # vector next to the global model and the accumulator.
        mean_delta = aggregate[: self.model_dim].view(np.float32)
        scratch = np.empty(min(self.model_dim, UPDATE_CHUNK_ELEMENTS), dtype=np.float64)
        for start in range(0, self.model_dim, UPDATE_CHUNK_ELEMENTS):
            stop = min(start + UPDATE_CHUNK_ELEMENTS, self.model_dim)
            floats = dequantize_sum(
                aggregate[start:stop], clip=ann.clip, bits=ann.quantization_bits, count=count,
                out=scratch[: stop - start],
            )
            # Sites send delta * n_k / weight_cap (so each element stays inside the
            # clip range) plus n_k; undo the scale on the SUM only.
            floats *= ann.weight_cap
            mean_delta[start:stop] = weighted_mean(floats, float(weight_sum))
        return mean_delta

    def _server_step(self, mean_delta: np.ndarray) -> None:
        """Apply the server optimizer; FedAvg (elementwise, stateless) in place by windows.

        In place is safe: the round's model is no longer served (`model_released`).
        Adaptive optimizers keep whole-vector moments anyway and step on the full vector.
        """
        if not isinstance(self.optimizer, FedAvg):
            self.global_flat = self.optimizer.step(self.global_flat, mean_delta)
            return
        flat = self.global_flat
        for start in range(0, self.model_dim, UPDATE_CHUNK_ELEMENTS):
            stop = min(start + UPDATE_CHUNK_ELEMENTS, self.model_dim)
            flat[start:stop] = self.optimizer.step(flat[start:stop], mean_delta[start:stop])

    def _write_debug_aggregate(
        self, round_number: int, aggregate: np.ndarray, survivors: tuple[str, ...]
    ) -> None:
        debug = Path(self.settings.state) / "aggregates"
        debug.mkdir(parents=True, exist_ok=True)
        aggregate.astype("<u4", copy=False).tofile(debug / f"round-{round_number:06d}.u32")
        (debug / f"round-{round_number:06d}.survivors").write_text("\n".join(survivors) + "\n")

    def _commit(self, result: RoundResult) -> None:
        state_dir = Path(self.settings.state)
        ckpt_dir = state_dir / "checkpoints"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        path = ckpt_dir / f"round-{result.round_number:06d}.mfm"
        model = ModelFile(
            self.layout,
            self.global_flat,
            {"round": result.round_number, "optimizer": self.settings.optimizer.name},
            self.optimizer.state_dict(),
        )
        write_model_file(path, model)
        checkpoint = Checkpoint(result.round_number, path, digest(self._model_payload()).hex())
        self.store.finish_round(
            result.round_number,
            status="completed",
            now=self.clock(),
            survivors=result.survivors,
            dropped=result.dropped,
            metrics=result.metrics,
            checkpoint=checkpoint,
        )
        if "auc" in result.metrics:
            self.metrics.model_auc.set(result.metrics["auc"])
        # Only the latest result is kept: a long-running coordinator must not grow by
        # two model-sized vectors per round.
        self.last_result = result


def _require(state: PhaseState | None) -> PhaseState:
    """Narrow Optional for the type checker (a next phase is always opened here)."""
    if state is None:
        raise StateError("internal: next phase missing")
    return state
