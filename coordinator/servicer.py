"""gRPC servicer: authenticates the caller, translates protobuf <-> dataclasses and maps
exceptions to status codes. No protocol logic lives here.

The caller's site id comes ONLY from its verified mTLS certificate (`_caller`); message
fields naming a site are never trusted for identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from google.protobuf.message import DecodeError, Message

from common.core.codec import CHUNK_BYTES
from common.core.errors import (
    AbortReason,
    CertificateRejected,
    DatabaseUnavailable,
    MedfedError,
    ProtocolAbort,
    ResourceExhausted,
    Unauthenticated,
    ValidationError,
)
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.protocol.pki import PeerVerifier, Role, parse_certificate, public_key_fingerprint
from common.protocol.tls import current_identity, peer_certificate_pem
from common.rounds import wire
from coordinator.call_limits import CallLimits
from coordinator.engine import RoundEngine
from coordinator.metrics import CoordinatorMetrics
from coordinator.revocation import CrlRelay
from coordinator.study_run import StudyRun

log = logging.getLogger("medfed.coordinator.rpc")

DECLINE_REASONS = {
    pb.DeclineRoundRequest.BUDGET_EXHAUSTED: "its privacy budget cannot pay for the round",
    pb.DeclineRoundRequest.NOT_READY: "not ready",
    pb.DeclineRoundRequest.STATISTICS_RELEASED: (
        "it released this study's statistics already and refuses a second release; it "
        "leaves the study (a study restarted from a fresh coordinator state?)"
    ),
    pb.DeclineRoundRequest.EVALUATIONS_USED: (
        "its policy.max_evaluations are used up on its ledger, so it cannot answer the "
        "final evaluation round"
    ),
    pb.DeclineRoundRequest.QUERY_NOT_APPROVED: (
        "the round's query is not one it approved for this study, it already ran as "
        "many times as its approval allows, or one run adds more epsilon than the "
        "per-round cap (its policy's or the study's max_epsilon_per_round)"
    ),
    pb.DeclineRoundRequest.MODEL_OUT_OF_BOUNDS: (
        "the round's global model holds a weight beyond the study's model.max_abs_weight, "
        "so it does not train or evaluate on it"
    ),
}
"""What the coordinator logs for a site's DeclineRound reason."""

LASTING_DECLINES = frozenset({
    pb.DeclineRoundRequest.BUDGET_EXHAUSTED,
    pb.DeclineRoundRequest.STATISTICS_RELEASED,
    pb.DeclineRoundRequest.EVALUATIONS_USED,
    pb.DeclineRoundRequest.QUERY_NOT_APPROVED,
    pb.DeclineRoundRequest.MODEL_OUT_OF_BOUNDS,
})
"""Reasons that do not change by waiting: re-opening the same round for these sites
would loop (NOT_READY, or no reason, may pass)."""

MAX_WAIT_SECONDS = 60
MAX_LEDGER_HISTORY_BYTES = 4 << 20
T = TypeVar("T")


class MalformedRequest:
    """Stands in for request bytes that do not parse as the RPC's message.

    gRPC answers a deserializer exception with UNKNOWN before any handler runs; parsing
    leniently and refusing in the handler gives hostile bytes a clear INVALID_ARGUMENT.
    """

    def __init__(self, message_name: str) -> None:
        self.message_name = message_name


def _lenient_parser(message_class: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError:
            return MalformedRequest(message_class.DESCRIPTOR.full_name)

    return parse


def require_parsed(request: Any) -> None:
    if isinstance(request, MalformedRequest):
        raise ValidationError(f"request is not a valid {request.message_name}")


def add_to_server(servicer: FederationServicer, server: grpc.aio.Server) -> None:
    """Register the Federation service like the generated helper, with lenient parsers."""
    service = pb.DESCRIPTOR.services_by_name["Federation"]
    factories = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for method in service.methods:
        factory = factories[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=_lenient_parser(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


def refuse_non_member(run: StudyRun | None, site_id: str, cert: x509.Certificate) -> None:
    """A study listing its [[members]] enrols only them, each under its pinned key
    (CertificateRejected: PERMISSION_DENIED). Every site checks each round's roster
    against the same members itself; this keeps a non-member out of the rosters too."""
    if run is None or not run.study.members:
        return
    pinned = run.study.member_fingerprints().get(site_id)
    fingerprint = public_key_fingerprint(cert)
    if pinned != fingerprint:
        what = ("is not a member" if pinned is None
                else f"presents key {fingerprint[:16]}..., not the member's {pinned[:16]}...")
        raise CertificateRejected(
            f"site {site_id!r} {what} of study {run.study.study.name!r} (its [[members]]); "
            "a new hospital joins with a new study version that every site approves"
        )


async def answer_failure(
    context: Any, error: Exception, *, method: str, metrics: CoordinatorMetrics | None
) -> None:
    """Abort the call with the status `error` maps to, counted and logged: the one place
    where exceptions become gRPC status codes.

    A MedfedError answers its own code (`wire.status_for`) with its message, except a
    lost state database: that is the coordinator's own matter (its log names it) and
    the site hears only that it should retry. Anything else is a bug: INTERNAL, logged
    with its traceback, and nothing of it reaches the caller.
    """
    if isinstance(error, MedfedError):
        code = wire.status_for(error)
        log.info("%s -> %s: %s", method, code.name, error)
        details = ("coordinator state database unavailable: retry later"
                   if isinstance(error, DatabaseUnavailable) else str(error)[:500])
    else:
        code, details = grpc.StatusCode.INTERNAL, "internal error"
        log.error("%s failed unexpectedly", method, exc_info=error)
    if metrics is not None:
        metrics.grpc_requests.labels(method=method, code=code.name).inc()
    await context.abort(code, details)


def rpc(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A unary (or client-streaming) RPC: the caller's share of calls held, the request
    parsed, every failure answered by `answer_failure`, every request counted."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: FederationServicer, request: Any, context: Any) -> T:
        try:
            with self.hold_call(request):
                require_parsed(request)
                result = await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # mapped in one place; a bug answers INTERNAL, never a crash
            await answer_failure(context, exc, method=name, metrics=self.metrics)
            raise  # unreachable: abort raises
        self.metrics.grpc_requests.labels(method=name, code="OK").inc()
        return result

    return wrapper


def rpc_stream(
    method: Callable[..., AsyncIterator[T]],
) -> Callable[..., AsyncIterator[T]]:
    """A server-streaming RPC: as `rpc`, for failures before and during the stream (the
    method holds the caller's share itself, around the streaming part only)."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: FederationServicer, request: Any, context: Any) -> AsyncIterator[T]:
        try:
            require_parsed(request)
            async for item in method(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # mapped in one place; a bug answers INTERNAL, never a crash
            await answer_failure(context, exc, method=name, metrics=self.metrics)
            raise  # unreachable: abort raises
        self.metrics.grpc_requests.labels(method=name, code="OK").inc()

    return wrapper


class FederationServicer(pb_grpc.FederationServicer):
    def __init__(
        self,
        engine: RoundEngine,
        verifier: PeerVerifier,
        metrics: CoordinatorMetrics,
        *,
        federation_id: str,
        crl: CrlRelay | None = None,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self.crl = crl
        self.engine = engine
        self.verifier = verifier
        self.metrics = metrics
        self.federation_id = federation_id
        self.clock = clock
        self.limits = CallLimits.from_settings(engine.settings.limits)

    @contextlib.contextmanager
    def hold_call(self, request: Any) -> Iterator[None]:
        """Hold one call of the calling site, with its parsed request's bytes, in the
        site's share (`coordinator.call_limits`); ResourceExhausted beyond it, counted.
        The site is the certificate's, as the interceptor verified it for this call
        (without an interceptor all callers share one "unauthenticated" share)."""
        try:
            site = current_identity().name
        except CertificateRejected:
            site = "unauthenticated"
        nbytes = request.ByteSize() if isinstance(request, Message) else 0
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self.limits.hold(site, nbytes=nbytes))
            except ResourceExhausted:
                self.metrics.calls_refused.labels(site=site).inc()
                raise
            yield

    @property
    def heartbeat_ms(self) -> int:
        """The sites' heartbeat interval (in rounds and in their long-polls)."""
        return round(self.engine.settings.deadlines.heartbeat_seconds * 1000)

    def _caller(self, context: Any) -> tuple[str, x509.Certificate]:
        """Verified site id of the caller, from its mTLS certificate only."""
        pem = peer_certificate_pem(context.auth_context())
        if pem is None:
            raise Unauthenticated("no client certificate")
        cert = parse_certificate(pem)
        try:
            # RequireCertificateRole verified this very call's certificate with the
            # same verifier moments ago: one verification per RPC, not two.
            identity = current_identity()
        except CertificateRejected:
            site_id = self.verifier.verify(cert, now=self.clock())  # no interceptor ran
        else:
            if identity.role is not Role.SITE:
                raise CertificateRejected(
                    f"a {identity.role.value} certificate ({identity.name!r}) is not a site "
                    "certificate"
                )
            site_id = identity.name
        self.engine.sessions.touch(site_id)
        return site_id, cert

    def _crl_der(self) -> bytes:
        """The CA's CRL for sites to check roster peers against (empty: none to relay)."""
        return self.crl.der() if self.crl is not None else b""

    def _site(self, context: Any) -> str:
        return self._caller(context)[0]

    @rpc
    async def Enroll(self, request: pb.EnrollRequest, context: Any) -> pb.EnrollResponse:
        site_id, cert = self._caller(context)
        self.metrics.observe_certificate("site", site_id, cert)
        refuse_non_member(self.engine.study, site_id, cert)
        # None: the site reported no budget (its ledger opens once it knows the study).
        budget = wire.budget_from_pb(request.budget)
        self.engine.sites.enroll(
            site_id,
            cert.public_bytes(Encoding.DER),
            serial=format(cert.serial_number, "x"),
            version=request.agent_version,
            device=request.device,
            budget=budget,
        )
        last = self.engine.last_round_number
        held = self.engine.sites.check_ledger_head(site_id, budget)
        study = self.engine.study
        return pb.EnrollResponse(
            federation_id=self.federation_id, current_round=last, ledger_seq_held=held,
            crl_der=self._crl_der(),
            study=study.canonical if study is not None else b"",
            study_sha256=study.sha256 if study is not None else "",
            heartbeat_ms=self.heartbeat_ms,
        )

    @rpc
    async def ReplicateLedger(
        self, request: pb.ReplicateLedgerRequest, context: Any
    ) -> pb.ReplicateLedgerResponse:
        """Extend this site's replica with its signed entries (verified; never rewritten)."""
        site_id = self._site(context)
        history = wire.bounded(request.history, what="ledger history",
                               maximum=MAX_LEDGER_HISTORY_BYTES)
        held = await asyncio.to_thread(self.engine.sites.replicate_ledger, site_id, history)
        return pb.ReplicateLedgerResponse(ledger_seq_held=held)

    @rpc
    async def WaitForRound(
        self, request: pb.WaitForRoundRequest, context: Any
    ) -> pb.WaitForRoundResponse:
        site_id = self._site(context)
        wait = min(max(request.wait_seconds, 1), MAX_WAIT_SECONDS)
        ann = await self.engine.sites.wait_for_round(
            site_id,
            after_round=wire.round_number(request.after_round, "after_round"),
            wait_seconds=wait,
            budget=wire.budget_from_pb(request.budget),
            beat_seconds=self.heartbeat_ms / 1000 if request.heartbeats else None,
        )
        if ann is None:
            return pb.WaitForRoundResponse(
                has_round=False,
                federation_finished=self.engine.finished.is_set(),
                crl_der=self._crl_der(),
            )
        return pb.WaitForRoundResponse(
            has_round=True, round=wire.announcement_to_pb(ann), crl_der=self._crl_der()
        )

    @rpc
    async def DeclineRound(
        self, request: pb.DeclineRoundRequest, context: Any
    ) -> pb.DeclineRoundResponse:
        site_id = self._site(context)
        self.engine.sites.decline(
            site_id, wire.round_number(request.round), budget=wire.budget_from_pb(request.budget),
            reason=DECLINE_REASONS.get(request.reason, "no reason given"),
            lasting=request.reason in LASTING_DECLINES,
        )
        return pb.DeclineRoundResponse()

    @rpc
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: Any
    ) -> pb.HeartbeatResponse:
        self.engine.sites.heartbeat(self._site(context), request.round)
        return pb.HeartbeatResponse()

    @rpc_stream
    async def DownloadModel(
        self, request: pb.DownloadModelRequest, context: Any
    ) -> AsyncIterator[pb.ModelChunk]:
        site_id = self._site(context)
        # model_chunks checks the caller now and copies one chunk at a time later.
        chunks = self.engine.inbox.model_chunks(
            site_id, wire.round_number(request.round), CHUNK_BYTES
        )
        # Bounded concurrent streams: each can hold a flow-control window of
        # sent-but-unread chunks in gRPC's buffers (large models, many sites). A round
        # that ends mid-stream (the model is being replaced) answers its clear status.
        with self.hold_call(request):
            async with self.engine.inbox.download_slot():
                for offset, data in chunks:
                    yield pb.ModelChunk(offset=offset, data=data)

    @rpc_stream
    async def DownloadFinalModel(
        self, request: pb.DownloadFinalModelRequest, context: Any
    ) -> AsyncIterator[pb.ModelChunk]:
        """The finished study's final model bundle, in chunks."""
        self._site(context)
        data = self.engine.final_model(bytes(request.study_sha256))
        with self.hold_call(request):
            async with self.engine.inbox.download_slot():
                for offset in range(0, len(data), CHUNK_BYTES):
                    yield pb.ModelChunk(offset=offset, data=data[offset : offset + CHUNK_BYTES])

    @rpc
    async def AdvertiseKeys(
        self, request: pb.AdvertiseKeysRequest, context: Any
    ) -> pb.AdvertiseKeysResponse:
        site_id = self._site(context)
        msg = wire.advertise_from_pb(request, caller=site_id)
        nonce = wire.bounded(request.round_nonce, what="round_nonce", exact=16)
        roster = await self.engine.inbox.advertise(
            site_id, wire.round_number(request.round), nonce, msg
        )
        return wire.roster_to_pb(roster)

    @rpc
    async def ShareKeys(self, request: pb.ShareKeysRequest, context: Any) -> pb.ShareKeysResponse:
        site_id = self._site(context)
        msg = wire.share_keys_from_pb(request)
        shares = await self.engine.inbox.share_keys(
            site_id, wire.round_number(request.round), wire.session_id(request.session_id), msg
        )
        return wire.shares_for_recipient_to_pb(shares)

    @rpc
    async def UploadMaskedInput(
        self, request_iterator: AsyncIterator[pb.MaskedInputChunk], context: Any
    ) -> pb.MaskedInputResponse:
        site_id = self._site(context)
        iterator = request_iterator.__aiter__()
        idle = self.engine.settings.limits.upload_idle_seconds
        try:
            # A stream that never sends its header holds no staging slot, but it is cut
            # after the same idle time as one that stalls mid-upload.
            async with asyncio.timeout(idle):
                first = await iterator.__anext__()
        except StopAsyncIteration:
            raise ValidationError("empty upload stream") from None
        except TimeoutError:
            raise ProtocolAbort(
                AbortReason.UPLOAD_IDLE, f"no upload header for {idle:g} s: stream cut"
            ) from None
        require_parsed(first)
        if first.WhichOneof("part") != "header":
            raise ValidationError("upload must start with a header")
        header = first.header
        session = wire.session_id(header.session_id) if header.session_id else b""

        async def chunks() -> AsyncIterator[tuple[int, bytes]]:
            async for item in iterator:
                require_parsed(item)
                if item.WhichOneof("part") != "chunk":
                    raise ValidationError("only one header per upload")
                offset = wire.uint(
                    item.chunk.offset, what="chunk offset", maximum=4 * wire.MAX_VECTOR_LENGTH
                )
                yield offset, item.chunk.data

        survivors = await self.engine.inbox.upload(
            site_id,
            wire.round_number(header.round),
            session,
            wire.uint(header.vector_length, what="vector_length", maximum=wire.MAX_VECTOR_LENGTH),
            chunks(),
        )
        return wire.survivors_to_pb(survivors)

    @rpc
    async def ConsistencyCheck(
        self, request: pb.ConsistencyCheckRequest, context: Any
    ) -> pb.ConsistencyCheckResponse:
        site_id = self._site(context)
        sigs = await self.engine.inbox.consistency(
            site_id,
            wire.round_number(request.round),
            wire.session_id(request.session_id),
            wire.consistency_from_pb(request),
        )
        return wire.signatures_to_pb(sigs)

    @rpc
    async def Unmask(self, request: pb.UnmaskRequest, context: Any) -> pb.UnmaskResponse:
        site_id = self._site(context)
        contributors = await self.engine.inbox.unmask(
            site_id,
            wire.round_number(request.round),
            wire.session_id(request.session_id),
            wire.unmask_from_pb(request),
        )
        return pb.UnmaskResponse(completed=True, contributors=contributors)


def _unix_ms(seconds: float | None) -> int:
    return 0 if seconds is None else max(int(seconds * 1000), 0)


class MonitorServicer(pb_grpc.MonitorServicer):
    """Read-only status for operators. Who may call it is decided before any handler
    runs (RequireCertificateRole: monitor certificates only)."""

    def __init__(self, engine: RoundEngine, *, federation_id: str,
                 metrics: CoordinatorMetrics | None = None) -> None:
        self.engine = engine
        self.federation_id = federation_id
        self.metrics = metrics

    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusResponse:
        # Counted like the Federation calls (a dashboard polling status is traffic too).
        try:
            response = self._status()
        except Exception as exc:  # mapped in one place; a bug answers INTERNAL, never a crash
            await answer_failure(context, exc, method="Status", metrics=self.metrics)
            raise  # unreachable: abort raises
        if self.metrics is not None:
            self.metrics.grpc_requests.labels(method="Status", code="OK").inc()
        return response

    def _status(self) -> pb.StatusResponse:
        status = self.engine.status()
        return pb.StatusResponse(
            federation_id=self.federation_id,
            total_rounds=status.total_rounds,
            completed_rounds=status.completed_rounds,
            aborted_rounds=status.aborted_rounds,
            current_round=status.current_round,
            phase=status.phase,
            finished=status.finished,
            eta_seconds=-1.0 if status.eta_seconds is None else status.eta_seconds,
            now_unix_ms=_unix_ms(status.now),
            training_rounds=status.training_rounds,
            evaluation_round=status.evaluation_round,
            statistics_round=status.statistics_round,
            current_kind=status.current_kind,
            auc_round=0 if status.auc is None else status.auc.round_number,
            auc=0.0 if status.auc is None else status.auc.auc,
            auc_interval_low=math.nan if status.auc is None else status.auc.low,
            auc_interval_high=math.nan if status.auc is None else status.auc.high,
            sites=[
                pb.SiteState(
                    site_id=s.site_id, state=s.state,
                    last_contact_unix_ms=_unix_ms(s.last_contact),
                    epsilon_spent=s.epsilon_spent, epsilon_budget=s.epsilon_budget,
                    privacy_unit=s.privacy_unit,
                )
                for s in status.sites
            ],
        )
