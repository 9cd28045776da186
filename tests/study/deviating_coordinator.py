"""TEST DOUBLE: a coordinator that deviates at the study seams (enrolment, the statistics
round, the statistics carried by announcements, the final model).

A small gRPC server implementing the Federation service over real mutual TLS with the
federation's real coordinator certificate. It enrols sites into a study of its choosing
(any bytes, any announced SHA-256), serves a scripted list of round announcements, then
says the federation finished and serves the final bundle bytes it was given. It stops
every round at the first SecAgg+ message (AdvertiseKeys) or model download, and records
every request with the round it names, so a test can show what a site did and did not
send for each announcement.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.protocol import pki
from common.protocol.tls import peer_certificate_pem, server_credentials
from common.rounds import wire
from common.rounds.announcement import Announcement

STOP = "the deviating coordinator ends every round here"


@dataclass
class Record:
    """(site, method, round) of every request, in arrival order (round 0: none named)."""

    calls: list[tuple[str, str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, site: str, method: str, round_number: int = 0) -> None:
        with self.lock:
            self.calls.append((site, method, round_number))

    def rounds_of(self, method: str) -> list[int]:
        with self.lock:
            return [r for _, m, r in self.calls if m == method]

    def methods(self) -> list[str]:
        with self.lock:
            return [m for _, m, _ in self.calls]


class DeviatingStudyCoordinator(pb_grpc.FederationServicer):
    def __init__(
        self,
        pki_dir: Path,
        *,
        study: bytes,
        study_sha256: str,
        rounds: Sequence[Announcement] = (),
        final_bundle: bytes = b"",
        chunk_bytes: int = 1 << 16,
    ) -> None:
        crl = x509.load_pem_x509_crl((pki_dir / pki.CRL_FILE).read_bytes())
        self.crl_der = crl.public_bytes(Encoding.DER)
        self.pki_dir = pki_dir
        self.study = study
        self.study_sha256 = study_sha256
        self.script = list(rounds)
        self.final_bundle = final_bundle
        self.chunk_bytes = chunk_bytes
        self.record = Record()
        self.decline_reasons: dict[int, int] = {}  # round -> DeclineRoundRequest.Reason
        self._lock = threading.Lock()
        self._server = grpc.server(ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_FederationServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        self.port = self._server.add_secure_port("127.0.0.1:0", server_credentials(pki_dir))

    def __enter__(self) -> DeviatingStudyCoordinator:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(0).wait(30)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _caller(self, context: Any) -> str:
        pem = peer_certificate_pem(context.auth_context())
        if pem is None:
            raise RuntimeError("mTLS without a client certificate")
        return pki.site_id_from_certificate(pki.parse_certificate(pem))

    # ------------------------------------------------------------ membership RPCs
    def Enroll(self, request: pb.EnrollRequest, context: Any) -> pb.EnrollResponse:
        self.record.add(self._caller(context), "Enroll")
        return pb.EnrollResponse(
            federation_id="deviating", crl_der=self.crl_der, study=self.study,
            study_sha256=self.study_sha256, ledger_seq_held=1 << 32,
        )

    def WaitForRound(
        self, request: pb.WaitForRoundRequest, context: Any
    ) -> pb.WaitForRoundResponse:
        self.record.add(self._caller(context), "WaitForRound")
        with self._lock:
            ann = self.script.pop(0) if self.script else None
        if ann is None:
            return pb.WaitForRoundResponse(federation_finished=True, crl_der=self.crl_der)
        return pb.WaitForRoundResponse(
            has_round=True, round=wire.announcement_to_pb(ann), crl_der=self.crl_der
        )

    def ReplicateLedger(
        self, request: pb.ReplicateLedgerRequest, context: Any
    ) -> pb.ReplicateLedgerResponse:
        self.record.add(self._caller(context), "ReplicateLedger")
        return pb.ReplicateLedgerResponse(ledger_seq_held=1 << 32)

    def DeclineRound(
        self, request: pb.DeclineRoundRequest, context: Any
    ) -> pb.DeclineRoundResponse:
        self.record.add(self._caller(context), "DeclineRound", request.round)
        self.decline_reasons[request.round] = request.reason
        return pb.DeclineRoundResponse()

    def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        self.record.add(self._caller(context), "Heartbeat", request.round)
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, STOP)
        raise AssertionError("unreachable")

    # ------------------------------------------------- anything a round would send
    def DownloadModel(self, request: pb.DownloadModelRequest, context: Any) -> Iterator[Any]:
        self.record.add(self._caller(context), "DownloadModel", request.round)
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, STOP)
        yield from ()

    def AdvertiseKeys(
        self, request: pb.AdvertiseKeysRequest, context: Any
    ) -> pb.AdvertiseKeysResponse:
        self.record.add(self._caller(context), "AdvertiseKeys", request.round)
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, STOP)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------- end of study
    def DownloadFinalModel(
        self, request: pb.DownloadFinalModelRequest, context: Any
    ) -> Iterator[pb.ModelChunk]:
        self.record.add(self._caller(context), "DownloadFinalModel")
        data = self.final_bundle
        for offset in range(0, len(data), self.chunk_bytes):
            yield pb.ModelChunk(offset=offset, data=data[offset : offset + self.chunk_bytes])
