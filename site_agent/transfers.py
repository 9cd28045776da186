"""A round's model-sized transfers: the global model streamed down (in a worker thread,
while the key phases run) and checked against the announcement, the upload streamed up
in chunks, and the test-only copy of what was uploaded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import numpy as np

from common.core.codec import (
    ChunkAssembler,
    bytes_to_flat,
    check_finite,
    digest,
    iter_chunks,
    layout_bytes,
)
from common.core.errors import RoundFailed, ValidationError
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.rounds.announcement import VerifiedRound
from site_agent.round_timeline import RoundTimeline

MAX_MODEL_CHUNK_BYTES = 4 << 20


def download(
    stub: pb_grpc.FederationStub, rnd: VerifiedRound,
    started: Callable[[grpc.Call], None] | None = None,
) -> np.ndarray:
    """The round's global model, every chunk in place and the whole matching the
    announced size and SHA-256 (ValidationError otherwise); `started` is handed the
    stream, so the caller can cancel it."""
    total = layout_bytes(rnd.plan.layout)
    if total != rnd.announcement.model_bytes:
        raise ValidationError("announced model size does not match its layout")
    # An all-float32 model is assembled straight into the array training gets (one
    # model-sized buffer, no parse copy); other layouts are converted after.
    direct = all(spec.dtype == "<f4" for spec in rnd.plan.layout)
    buffer: np.ndarray | bytearray = (
        np.empty(total // 4, dtype="<f4") if direct else bytearray(total)
    )
    assembler = ChunkAssembler(buffer, total_bytes=total, max_chunk_bytes=MAX_MODEL_CHUNK_BYTES)
    stream = stub.DownloadModel(pb.DownloadModelRequest(round=rnd.number), timeout=300)
    if started is not None:
        started(stream)
    for chunk in stream:
        assembler.add(chunk.offset, chunk.data)
    assembler.finish()
    if digest(buffer) != rnd.announcement.model_sha256:
        raise ValidationError("downloaded model does not match the announced SHA-256")
    if isinstance(buffer, bytearray):
        return bytes_to_flat(buffer, rnd.plan.layout)
    check_finite(buffer, rnd.plan.layout)
    return buffer.astype(np.float32, copy=False)


class ModelDownload:
    """The round's model, downloaded in a worker thread while the key phases run."""

    def __init__(self, stub: pb_grpc.FederationStub, rnd: VerifiedRound,
                 timeline: RoundTimeline) -> None:
        self._call: grpc.Call | None = None
        self._cancelled = threading.Event()
        self._result: np.ndarray | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(stub, rnd, timeline), name="model-download", daemon=True
        )
        self._thread.start()

    def _started(self, call: grpc.Call) -> None:
        self._call = call
        if self._cancelled.is_set():
            call.cancel()

    def _run(self, stub: pb_grpc.FederationStub, rnd: VerifiedRound,
             timeline: RoundTimeline) -> None:
        try:
            self._result = download(stub, rnd, self._started)
            timeline.mark("downloaded")
        except BaseException as exc:  # re-raised in the caller's thread by result()
            self._error = exc

    def result(self) -> np.ndarray:
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._result is None:  # pragma: no cover - _run sets one of the two
            raise RoundFailed("model download ended without a model")
        model, self._result = self._result, None
        return model

    def cancel(self) -> None:
        """The round failed: stop the stream, wait for the thread, drop the model."""
        self._cancelled.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join()
        self._result = None


def upload_stream(
    rnd: VerifiedRound, session: bytes, vector: np.ndarray, *,
    after_first_chunk: Callable[[], None] | None = None,
) -> Iterator[pb.MaskedInputChunk]:
    """The (masked) upload as UploadMaskedInput streams it: a header, then chunks as
    large as the coordinator accepts (`after_first_chunk`: TEST ONLY fault injection,
    called once the first chunk was sent)."""
    yield pb.MaskedInputChunk(
        header=pb.MaskedInputHeader(
            round=rnd.number, session_id=session, vector_length=vector.size
        )
    )
    for index, (offset, data) in enumerate(iter_chunks(vector, chunk_bytes=rnd.chunk_bytes)):
        yield pb.MaskedInputChunk(chunk=pb.ModelChunk(offset=offset, data=data))
        if index == 0 and after_first_chunk is not None:
            after_first_chunk()
