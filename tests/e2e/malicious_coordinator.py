"""TEST DOUBLE: a coordinator that deviates from the protocol on purpose.

A small grpc.aio server implementing the Federation service over real mTLS (it holds
the federation's real coordinator certificate), running the REAL `SecAggServer`. It
can also hold valid *site* certificates of the same CA ("puppets": what the shipped
deployment once gave the coordinator, or what a CA holder can mint) and play those
sites with real `SecAggClient`s. Its deviations are chosen per test:

* tell each real site its own `Story` (announcement + model): divergent announcements;
* announce a round of two (itself plus one hospital);
* withhold chosen masked inputs so the survivor set shrinks after the inputs are in.

It records every request it receives, so a test can show what a site did and did not
send. Everything runs on its own event loop in a daemon thread; tests wait on events.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from common.core.codec import CHUNK_BYTES, TensorSpec, digest, flat_to_bytes
from common.core.errors import MedfedError, ProtocolAbort
from common.crypto.random import system_random
from common.crypto.signing import SigningKey, VerifyingKey
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.protocol import pki
from common.protocol.secagg import messages as sm
from common.protocol.secagg.client import SecAggClient
from common.protocol.secagg.server import SecAggServer
from common.protocol.tls import peer_certificate_pem, server_credentials
from common.rounds import wire
from common.rounds.announcement import Announcement, secagg_params
from common.study import GlobalStatistics, Study, statistics_bytes, study_bytes, study_sha256


@dataclass(frozen=True)
class Story:
    """What one site is told about the round: the announcement and the model bytes."""

    announcement: Announcement
    model: bytes


def make_story(
    *,
    participants: Sequence[str],
    layout: tuple[TensorSpec, ...],
    flat: np.ndarray,
    nonce: bytes,
    threshold: int,
    clip: float = 1.0,
    histogram_bins: int = 10,
    study: Study | None = None,
    statistics: GlobalStatistics | None = None,
) -> Story:
    """A training round 1 of `study` (the one the double serves at enrolment), carrying
    `statistics` as if the study's statistics round had released them."""
    model = flat_to_bytes(flat.astype(np.float32), layout)
    elements = sum(spec.elements for spec in layout)
    now_ms = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    return Story(
        Announcement(
            round_number=1, round_nonce=nonce, participants=tuple(sorted(participants)),
            threshold=threshold, neighbours=0, vector_length=elements + 1 + 2 * histogram_bins,
            quantization_bits=16, clip=clip, histogram_bins=histogram_bins,
            secure_aggregation=True, model_layout=layout, model_sha256=digest(model),
            model_bytes=len(model), local_epochs=1, learning_rate=0.1, fedprox_mu=0.0,
            planned_rounds=1, train_deadline_ms=now_ms + 120_000, phase_timeout_ms=60_000,
            weight_cap=1000,
            study_sha256=bytes.fromhex(study_sha256(study)) if study is not None else b"",
            statistics=statistics_bytes(statistics) if statistics is not None else b"",
        ),
        model,
    )


def _certificate_key(site_id: str, certificate_der: bytes) -> VerifyingKey:
    return VerifyingKey.from_certificate(pki.parse_certificate(certificate_der))


@dataclass
class Puppet:
    """A site identity the coordinator holds (certificate and key) and plays itself."""

    site_id: str
    certificate_der: bytes
    client: SecAggClient
    vector: np.ndarray
    shares: sm.ShareKeysOut | None = None
    masked: np.ndarray | None = None


@dataclass
class Record:
    """Every request the double received: (site, method) in arrival order, the masked
    vectors sites uploaded and the reason of each site's DeclineRound."""

    calls: list[tuple[str, str]] = field(default_factory=list)
    masked: dict[str, np.ndarray] = field(default_factory=dict)
    declines: dict[str, int] = field(default_factory=dict)  # site -> DeclineRound reason

    def methods_of(self, site: str) -> list[str]:
        return [method for who, method in self.calls if who == site]


class MaliciousCoordinator(pb_grpc.FederationServicer):
    def __init__(
        self,
        pki_dir: Path,
        *,
        stories: Mapping[str, Story],
        server_story: Story,
        puppets: Sequence[str] = (),
        withhold: Sequence[str] = (),
        study: Study | None = None,
        final_model: bytes = b"",
    ) -> None:
        self.pki_dir = pki_dir
        self.study = study  # sent at enrolment, as a coordinator serving it does
        # The study's final bundle, which a site downloads once the federation finished.
        self.final_model = final_model
        self.stories = dict(stories)
        self.server_story = server_story
        self.withhold = set(withhold)
        self.record = Record()
        crl = x509.load_pem_x509_crl((pki_dir / pki.CRL_FILE).read_bytes())
        self.crl_der = crl.public_bytes(Encoding.DER)
        ann = server_story.announcement
        params = secagg_params(ann)
        self.server = SecAggServer(params, identity=_certificate_key)
        self.puppets: dict[str, Puppet] = {}
        for site in puppets:
            cert_path, key_path = pki.site_paths(pki_dir, site)
            client = SecAggClient(
                params, site_id=site, signing_key=SigningKey.from_pem(key_path.read_bytes()),
                identity=_certificate_key, rng=system_random,
                # The coordinator's own puppets accept any round (it wrote it).
                min_round_sites=2, max_colluding_sites=0,
            )
            vector = np.frombuffer(system_random(4 * ann.vector_length), dtype="<u4").copy()
            cert_der = pki.load_certificate(cert_path).public_bytes(Encoding.DER)
            self.puppets[site] = Puppet(site, cert_der, client, vector)
        self.real_sites = set(stories)
        self.entries: dict[str, sm.RosterEntry] = {}
        self.forced: set[str] = set()
        self.roster: sm.Roster | None = None
        self.inbox: dict[str, sm.SharesForRecipient] = {}
        self.survivors: sm.SurvivorList | None = None
        self.round_over = threading.Event()
        self._announced: set[str] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._advertised: asyncio.Event | None = None
        self._shared: asyncio.Event | None = None
        self._uploaded: asyncio.Event | None = None
        self._shared_sites: set[str] = set()
        self._uploaded_sites: set[str] = set()
        self.port = 0
        self._thread = threading.Thread(target=self._main, name="malicious", daemon=True)

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> MaliciousCoordinator:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("malicious coordinator did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self._advertised = asyncio.Event()
        self._shared = asyncio.Event()
        self._uploaded = asyncio.Event()
        server = grpc.aio.server()
        pb_grpc.add_FederationServicer_to_server(self, server)  # type: ignore[no-untyped-call]
        self.port = server.add_secure_port("127.0.0.1:0", server_credentials(self.pki_dir))
        await server.start()
        self._ready.set()
        await self._stop.wait()
        await server.stop(0)

    # ------------------------------------------------------------------- helpers
    def _caller(self, context: Any, method: str) -> tuple[str, bytes]:
        pem = peer_certificate_pem(context.auth_context())
        if pem is None:
            raise RuntimeError("mTLS without a client certificate")
        cert = pki.parse_certificate(pem)
        site = pki.site_id_from_certificate(cert)
        self.record.calls.append((site, method))
        return site, cert.public_bytes(Encoding.DER)

    def _expected_adverts(self) -> set[str]:
        return set(self.server_story.announcement.participants)

    # ------------------------------------------------------------ membership RPCs
    async def Enroll(self, request: pb.EnrollRequest, context: Any) -> pb.EnrollResponse:
        self._caller(context, "Enroll")
        if self.study is None:
            return pb.EnrollResponse(federation_id="malicious", crl_der=self.crl_der)
        return pb.EnrollResponse(federation_id="malicious", crl_der=self.crl_der,
                                 study=study_bytes(self.study),
                                 study_sha256=study_sha256(self.study))

    async def WaitForRound(
        self, request: pb.WaitForRoundRequest, context: Any
    ) -> pb.WaitForRoundResponse:
        site, _ = self._caller(context, "WaitForRound")
        if site in self._announced or site not in self.stories:
            # After its one round, a site hears that the federation is over (it exits).
            self.round_over.set()
            return pb.WaitForRoundResponse(federation_finished=True, crl_der=self.crl_der)
        self._announced.add(site)
        return pb.WaitForRoundResponse(
            has_round=True,
            round=wire.announcement_to_pb(self.stories[site].announcement),
            crl_der=self.crl_der,
        )

    async def ReplicateLedger(
        self, request: pb.ReplicateLedgerRequest, context: Any
    ) -> pb.ReplicateLedgerResponse:
        """Recorded (the signed ledger entries carry parameters only) and acknowledged
        as fully held, so the site sends them once."""
        self._caller(context, "ReplicateLedger")
        return pb.ReplicateLedgerResponse(ledger_seq_held=1 << 32)

    async def DeclineRound(
        self, request: pb.DeclineRoundRequest, context: Any
    ) -> pb.DeclineRoundResponse:
        site, _ = self._caller(context, "DeclineRound")
        self.record.declines[site] = request.reason
        return pb.DeclineRoundResponse()

    async def DownloadModel(
        self, request: pb.DownloadModelRequest, context: Any
    ) -> AsyncIterator[pb.ModelChunk]:
        site, _ = self._caller(context, "DownloadModel")
        model = self.stories[site].model
        for offset in range(0, len(model), CHUNK_BYTES):
            yield pb.ModelChunk(offset=offset, data=model[offset : offset + CHUNK_BYTES])

    async def DownloadFinalModel(
        self, request: pb.DownloadFinalModelRequest, context: Any
    ) -> AsyncIterator[pb.ModelChunk]:
        self._caller(context, "DownloadFinalModel")
        model = self.final_model
        for offset in range(0, len(model), CHUNK_BYTES):
            yield pb.ModelChunk(offset=offset, data=model[offset : offset + CHUNK_BYTES])

    # ----------------------------------------------------------------- SecAgg+
    async def AdvertiseKeys(
        self, request: pb.AdvertiseKeysRequest, context: Any
    ) -> pb.AdvertiseKeysResponse:
        site, cert_der = self._caller(context, "AdvertiseKeys")
        msg = wire.advertise_from_pb(request, caller=site)
        entry = sm.RosterEntry(
            site_id=site, encryption_public_key=msg.encryption_public_key,
            masking_public_key=msg.masking_public_key, signature=msg.signature,
            certificate_der=cert_der,
        )
        try:
            self.server.receive_advertisement(site, msg, certificate_der=cert_der)
        except MedfedError:
            # Signed under another story than the server's: the real server refuses
            # it, the double passes it on anyway (the deviation) so that the sites
            # themselves must notice.
            self.forced.add(site)
        self.entries[site] = entry
        if self.real_sites <= set(self.entries):
            self._close_advertise()
        assert self._advertised is not None
        await self._advertised.wait()
        assert self.roster is not None
        return wire.roster_to_pb(self.roster)

    def _close_advertise(self) -> None:
        for puppet in self.puppets.values():
            adv = puppet.client.advertise_keys()
            self.server.receive_advertisement(
                puppet.site_id, adv, certificate_der=puppet.certificate_der
            )
            self.entries[puppet.site_id] = sm.RosterEntry(
                site_id=puppet.site_id, encryption_public_key=adv.encryption_public_key,
                masking_public_key=adv.masking_public_key, signature=adv.signature,
                certificate_der=puppet.certificate_der,
            )
        self.roster = sm.Roster(entries=tuple(self.entries[s] for s in sorted(self.entries)))
        try:
            server_roster: sm.Roster | None = self.server.close_advertise()
        except ProtocolAbort:
            server_roster = None  # too few adverts under the server's story: we lie on
        if server_roster is not None and not self.forced:
            for puppet in self.puppets.values():
                puppet.shares = puppet.client.receive_roster(server_roster)
                self.server.receive_shares(puppet.site_id, puppet.shares)
        assert self._advertised is not None
        self._advertised.set()

    async def ShareKeys(self, request: pb.ShareKeysRequest, context: Any) -> pb.ShareKeysResponse:
        site, _ = self._caller(context, "ShareKeys")
        self.server.receive_shares(site, wire.share_keys_from_pb(request))
        self._shared_sites.add(site)
        if self._shared_sites >= self.real_sites:
            self.inbox = self.server.close_shares()
            for puppet in self.puppets.values():
                masked = puppet.client.receive_shares(self.inbox[puppet.site_id], puppet.vector)
                puppet.masked = masked.vector
            assert self._shared is not None
            self._shared.set()
        assert self._shared is not None
        await self._shared.wait()
        return wire.shares_for_recipient_to_pb(self.inbox[site])

    async def UploadMaskedInput(
        self, request_iterator: AsyncIterator[pb.MaskedInputChunk], context: Any
    ) -> pb.MaskedInputResponse:
        site, _ = self._caller(context, "UploadMaskedInput")
        header: pb.MaskedInputHeader | None = None
        buffer = bytearray()
        async for item in request_iterator:
            if item.WhichOneof("part") == "header":
                header = item.header
                buffer = bytearray(4 * header.vector_length)
            else:
                buffer[item.chunk.offset : item.chunk.offset + len(item.chunk.data)] = (
                    item.chunk.data
                )
        if header is None:
            raise RuntimeError("upload without a header")
        vector = np.frombuffer(bytes(buffer), dtype="<u4").astype(np.uint32)
        self.record.masked[site] = vector
        if site not in self.withhold:
            self.server.receive_masked_input(site, vector)
        self._uploaded_sites.add(site)
        if self._uploaded_sites >= self.real_sites:
            for puppet in self.puppets.values():
                if puppet.site_id not in self.withhold and puppet.masked is not None:
                    self.server.receive_masked_input(puppet.site_id, puppet.masked)
            # The real server's survivor list: whoever's input we let into the sum.
            self.survivors = self.server.close_masked_input()
            assert self._uploaded is not None
            self._uploaded.set()
        assert self._uploaded is not None
        await self._uploaded.wait()
        assert self.survivors is not None
        return wire.survivors_to_pb(self.survivors)

    async def ConsistencyCheck(
        self, request: pb.ConsistencyCheckRequest, context: Any
    ) -> pb.ConsistencyCheckResponse:
        self._caller(context, "ConsistencyCheck")
        await context.abort(grpc.StatusCode.ABORTED, "recorded")
        raise RuntimeError("unreachable")

    async def Unmask(self, request: pb.UnmaskRequest, context: Any) -> pb.UnmaskResponse:
        self._caller(context, "Unmask")
        await context.abort(grpc.StatusCode.ABORTED, "recorded")
        raise RuntimeError("unreachable")
