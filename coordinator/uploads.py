"""Bulk transfers of a round: masked-input uploads (bounded slots, spooling to disk for
large vectors, the idle cut) and model downloads (bounded slots).

Memory, not bandwidth, is what these bounds protect: each staged upload is a
model-sized vector, and each open download can hold a flow-control window of
sent-but-unread chunks in gRPC's buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Protocol

import numpy as np

from common.core.codec import ChunkAssembler, SpoolAssembler
from common.core.config import LimitsSection
from common.core.errors import AbortReason, ProtocolAbort, StateError
from coordinator.metrics import CoordinatorMetrics
from coordinator.phases import ActiveRound, PhaseState, RoundPhase

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

SPOOL_WINDOW_ELEMENTS = 1 << 18
"""Elements read back from a spooled upload at a time."""


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


class Accumulator(Protocol):
    """Where an accepted upload goes (the round's aggregator)."""

    def add(self, site_id: str, vector: np.ndarray) -> None: ...

    def add_windows(self, site_id: str, windows: Iterable[np.ndarray]) -> None: ...


def iter_model(rnd: ActiveRound, chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
    """The round's model, one copied chunk at a time, while the round still serves it."""
    view = memoryview(rnd.model_bytes)
    for offset in range(0, len(view), chunk_bytes):
        if not rnd.serves_model:
            # The global model is being updated in place: stop rather than tear.
            raise StateError(f"round {rnd.number} no longer serves its model")
        yield offset, bytes(view[offset : offset + chunk_bytes])


class Transfers:
    """Upload and download slots, sized per round by `prepare`."""

    def __init__(
        self, limits: LimitsSection, spool_dir: Path, *, metrics: CoordinatorMetrics
    ) -> None:
        self.limits = limits
        self.metrics = metrics
        self.spool_dir = spool_dir
        self.upload_slots = asyncio.Semaphore(limits.max_concurrent_uploads)
        self.download_slots = asyncio.Semaphore(MIN_CONCURRENT_DOWNLOADS)
        # In-memory staging buffers, kept from upload to upload and round to round
        # (at most one per upload slot, each under upload_spool_bytes): a fresh buffer
        # per upload costs the kernel a model's worth of zero-filled pages every time.
        self._staging_length = 0
        self._staging: list[np.ndarray] = []

    def prepare(self, length: int) -> None:
        """Bound concurrent uploads by max_concurrent_uploads and the staging budget."""
        fits = max(1, STAGING_BUDGET_BYTES // max(length * 4, 1))
        self.upload_slots = asyncio.Semaphore(min(self.limits.max_concurrent_uploads, fits))
        self.download_slots = asyncio.Semaphore(max(MIN_CONCURRENT_DOWNLOADS, fits))
        if length != self._staging_length:
            self._staging_length = length
            self._staging.clear()

    def _take_staging(self, length: int) -> np.ndarray:
        if length == self._staging_length and self._staging:
            return self._staging.pop()
        return np.empty(length, dtype=np.uint32)

    def _return_staging(self, buffer: np.ndarray) -> None:
        """Keep a buffer for the next upload (its content is overwritten in full before
        it is used again: the assembler refuses a stream that does not cover it)."""
        if buffer.size == self._staging_length and len(self._staging) < (
            self.limits.max_concurrent_uploads
        ):
            self._staging.append(buffer)

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

    async def receive(
        self,
        rnd: ActiveRound,
        site_id: str,
        length: int,
        chunks: AsyncIterator[tuple[int, bytes]],
        *,
        into: Accumulator,
        lock: asyncio.Lock,
    ) -> None:
        """Receive one vector and add it `into` the round's sum under `lock`.

        One stream per site at a time: otherwise one site could take every upload
        slot with streams that stall after the header (slow loris)."""
        state = rnd.require_phase(RoundPhase.MASKED_INPUT, site_id)
        if site_id in rnd.uploading:
            raise StateError(f"an upload from {site_id} is already in progress")
        rnd.uploading.add(site_id)
        try:
            await self._stage_and_add(rnd, state, site_id, length, chunks, into, lock)
        except ProtocolAbort as exc:
            if exc.reason is AbortReason.UPLOAD_IDLE and drop_stalled_uploader(
                rnd, state, site_id
            ):
                self.metrics.dropouts_total.labels(phase=RoundPhase.MASKED_INPUT.value).inc()
            raise
        finally:
            rnd.uploading.discard(site_id)
        self.metrics.bytes_received.inc(length * 4)

    async def _stage_and_add(
        self,
        rnd: ActiveRound,
        state: PhaseState,
        site_id: str,
        length: int,
        chunks: AsyncIterator[tuple[int, bytes]],
        into: Accumulator,
        lock: asyncio.Lock,
    ) -> None:
        # A bounded number of staging buffers (one per slot, reused): between uploads
        # the coordinator holds the accumulator and at most that many small buffers.
        limits = self.limits
        async with self.upload_slots:
            if length * 4 > limits.upload_spool_bytes:
                # Very large vectors are staged on disk: the coordinator's memory then
                # holds the model and the accumulator, not one more vector per upload.
                spool = SpoolAssembler(
                    str(self.spool_dir), total_bytes=length * 4,
                    max_chunk_bytes=limits.max_chunk_bytes,
                )
                try:
                    await self._receive_before_close(rnd, state, site_id, spool, chunks)
                    async with lock:
                        rnd.require_phase(RoundPhase.MASKED_INPUT, site_id)
                        windows = spool.windows(SPOOL_WINDOW_ELEMENTS)
                        await asyncio.to_thread(into.add_windows, site_id, windows)
                        state.mark(site_id)
                finally:
                    spool.close()
                return
            buffer = self._take_staging(length)
            try:
                assembler = ChunkAssembler(
                    buffer, total_bytes=length * 4, max_chunk_bytes=limits.max_chunk_bytes
                )
                await self._receive_before_close(rnd, state, site_id, assembler, chunks)
                async with lock:
                    # Re-check under the lock: the deadline may have closed the phase
                    # while this site was still streaming.
                    rnd.require_phase(RoundPhase.MASKED_INPUT, site_id)
                    # On the event loop: adding at most upload_spool_bytes of uint32 is
                    # a few milliseconds, less than waking a worker thread costs.
                    into.add(site_id, buffer)
                    state.mark(site_id)
            finally:
                self._return_staging(buffer)

    async def _receive_before_close(
        self,
        rnd: ActiveRound,
        state: PhaseState,
        site_id: str,
        assembler: ChunkAssembler,
        chunks: AsyncIterator[tuple[int, bytes]],
    ) -> None:
        """A stream still open when MaskedInput closes, or when its site is dropped
        (silent for `Liveness.misses` heartbeats: frozen or cut off), is cut (its data
        could no longer be used), so it frees its upload slot at once."""
        receive = asyncio.ensure_future(
            self._receive_into(assembler, chunks, alive=partial(rnd.heard_from, site_id)))
        closed = asyncio.ensure_future(state.closed.wait())
        dropped = asyncio.ensure_future(state.dropped_event(site_id).wait())
        try:
            await asyncio.wait({receive, closed, dropped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            dropped.cancel()
            if not receive.done():
                receive.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await receive
        if receive.cancelled() and site_id not in state.expected:
            raise StateError(f"site {site_id} was dropped from round {rnd.number} while "
                             "its upload was streaming")
        if receive.cancelled():
            raise ProtocolAbort(
                AbortReason.UNEXPECTED_MESSAGE,
                f"round {rnd.number}: masked input closed before the upload ended",
            )
        receive.result()  # the stream's ValidationError, if any

    async def _receive_into(
        self, assembler: ChunkAssembler, chunks: AsyncIterator[tuple[int, bytes]],
        *, alive: Callable[[], None],
    ) -> None:
        idle = self.limits.upload_idle_seconds
        loop = asyncio.get_running_loop()
        try:
            # One deadline, pushed forward after every chunk: a stream that sends nothing
            # for `idle` seconds is cut and frees its staging slot (slow loris), while a
            # large model that streams steadily may take as long as the phase allows.
            async with asyncio.timeout(idle) as window:
                async for offset, data in chunks:
                    assembler.add(offset, data)
                    alive()  # a chunk is as good as a heartbeat
                    window.reschedule(loop.time() + idle)
        except TimeoutError:
            raise ProtocolAbort(
                AbortReason.UPLOAD_IDLE, f"no upload chunk for {idle:g} s: stream cut"
            ) from None
        assembler.finish()


def drop_stalled_uploader(rnd: ActiveRound, state: PhaseState, site_id: str) -> bool:
    """Drop a site whose upload stalled from MaskedInput now, as the deadline would
    later: site agents do not resend an upload the coordinator cut, so waiting for
    it would only hold every other site until the phase deadline. SecAgg+ treats it
    as any dropout (its masks are recovered at Unmask)."""
    if state.closed.is_set() or site_id in state.arrived or site_id not in state.expected:
        return False
    log.info("round %d: upload of %s stalled: dropped", rnd.number, site_id)
    state.drop(site_id)
    return True
