"""Fixtures for the networked tests: a real PKI on disk, an in-process coordinator on
127.0.0.1:0 (its own asyncio loop in a background thread), honest site agents in
threads, and raw gRPC stubs that present any certificate we like.

Everything is real: mTLS sockets, SQLite state, SecAgg+ crypto. Synchronisation is by
events and thread joins, never by sleeping.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.instrumented import Instrumentation, flat_model
from bench.transport_site import DeterministicTestHook
from common.core.codec import CHUNK_BYTES, iter_chunks
from common.core.config import CoordinatorSettings, SiteSettings
from common.core.errors import CertificateRejected
from common.crypto.quantize import encode_update
from common.crypto.random import numpy_generator, system_random
from common.crypto.signing import SigningKey, VerifyingKey
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.protocol import pki
from common.protocol.secagg.client import SecAggClient
from common.rounds import wire
from common.rounds.announcement import secagg_params
from coordinator.engine import RoundEngine
from coordinator.service import RunningCoordinator, start
from site_agent.agent import SiteAgent
from site_agent.metrics import SiteMetrics

HONEST_SITES = ("a", "b", "c", "d", "e", "f")
MODEL_DIM = 64
HISTOGRAM_BINS = 4
# Small chunk limit so "oversized chunk" costs little traffic; honest uploads of a
# 64-element model are one chunk far below it.
MAX_CHUNK_BYTES = 1 << 16


# --------------------------------------------------------------------------- PKI


@dataclass(frozen=True)
class PkiLayout:
    """The federation PKI (`root`) and a foreign CA that also issued a site "a"."""

    root: Path
    foreign: Path

    @property
    def ca_pem(self) -> bytes:
        return (self.root / pki.CA_CERT).read_bytes()

    def site_pair(self, site_id: str, *, foreign: bool = False) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) of a site, from the federation or the foreign CA."""
        cert, key = pki.site_paths(self.foreign if foreign else self.root, site_id)
        return cert.read_bytes(), key.read_bytes()


@pytest.fixture(scope="session")
def pki_layout(tmp_path_factory: pytest.TempPathFactory) -> PkiLayout:
    """CA (back-dated a month), coordinator for 127.0.0.1, sites a..f, one expired site,
    one revoked site, two ("late", "midround") that tests revoke while the coordinator
    runs, and a foreign CA with its own site "a"."""
    base = tmp_path_factory.mktemp("network-pki")
    now = dt.datetime.now(dt.UTC)
    root = base / "pki"
    pki.init_ca(root, now=now - dt.timedelta(days=30))
    pki.refresh_crl(root, now=now)
    pki.issue_coordinator(root, ["127.0.0.1"], now=now)
    for site in (*HONEST_SITES, "revoked", "late", "midround"):
        pki.issue_site(root, site, now=now)
    # Valid for one day, ten days ago: expired now, but chains to our CA.
    pki.issue_site(root, "expired", validity_days=1, now=now - dt.timedelta(days=10))
    pki.revoke_site(root, "revoked", now=now)
    foreign = base / "foreign"
    pki.init_ca(foreign, name="medfed federation CA", now=now)
    pki.issue_site(foreign, "a", now=now)
    return PkiLayout(root=root, foreign=foreign)


# ------------------------------------------------------------------ coordinator


def coordinator_settings(
    pki_layout: PkiLayout, state: Path, **overrides: Any
) -> CoordinatorSettings:
    """Short deadlines so a dropped site costs seconds, not minutes."""
    values: dict[str, Any] = {
        "pki": pki_layout.root,
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "state": state,
        "rounds": 1,
        "min_sites": 4,
        "aggregation": {"histogram_bins": HISTOGRAM_BINS},
        "deadlines": {
            "selection_seconds": 0.5,
            "train_seconds": 2.0,
            "phase_seconds": 3.0,
            "round_start_timeout_seconds": 30.0,
            # Scripted sites send no heartbeats: only deadlines drop them here (the
            # liveness tests set their own interval).
            "heartbeat_seconds": 300.0,
        },
        "limits": {"max_chunk_bytes": MAX_CHUNK_BYTES},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}
        else:
            values[key] = value
    return CoordinatorSettings(**values)


def thread_stack(thread: threading.Thread) -> str:
    """Where a thread that should have ended is stuck (for the failure message)."""
    frame = sys._current_frames().get(thread.ident or -1)
    where = "".join(traceback.format_stack(frame)) if frame is not None else "(ended)\n"
    return f"thread {thread.name}:\n{where}"


class InProcessCoordinator:
    """`coordinator.service.start` on its own event loop in a daemon thread, serving a
    flat model of `model_dim` elements without a study (`bench.instrumented.flat_model`)
    and writing each round's unmasked sum under its state folder (`read_aggregate`)."""

    def __init__(self, settings: CoordinatorSettings, *, model_dim: int = MODEL_DIM) -> None:
        self.settings = settings
        self.model = flat_model(model_dim)
        self.observer = Instrumentation(settings.state, write_aggregates=True)
        self.loop = asyncio.new_event_loop()
        self.engine_done = threading.Event()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._running: RunningCoordinator | None = None
        self._stop: asyncio.Event | None = None
        self._engine_task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._main, name="coordinator", daemon=True)

    def __enter__(self) -> InProcessCoordinator:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("coordinator did not start within 30 s")
        if self._startup_error is not None:
            raise self._startup_error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        # A hang guard, not a timing: stop() takes well under a second.
        assert not self._thread.is_alive(), (
            "coordinator thread still running 30 s after stop:\n"
            + "\n".join(thread_stack(t) for t in threading.enumerate()))

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        try:
            self._running = await start(self.settings, observer=self.observer,
                                        model_without_study=self.model)
            self._stop = asyncio.Event()
            self._engine_task = asyncio.create_task(self._running.engine.run())
            self._engine_task.add_done_callback(lambda _task: self.engine_done.set())
        except Exception as exc:
            # Re-raised by __enter__ in the test's thread, where it belongs.
            self._startup_error = exc
            return
        finally:
            self._ready.set()
        await self._stop.wait()
        self._engine_task.cancel()
        await asyncio.wait({self._engine_task})  # its outcome is engine_error()'s to report
        await self._running.stop(grace=0)

    @property
    def port(self) -> int:
        if self._running is None:
            raise RuntimeError("not started")
        return self._running.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_port(self) -> int:
        if self._running is None:
            raise RuntimeError("not started")
        return self._running.metrics_port

    @property
    def stopped(self) -> bool:
        """True once `RunningCoordinator.stop()` returned and the loop thread ended."""
        return self._running is not None and not self._thread.is_alive()

    @property
    def engine(self) -> RoundEngine:
        if self._running is None:
            raise RuntimeError("not started")
        return self._running.engine

    def engine_error(self) -> BaseException | None:
        task = self._engine_task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()

    def wait_engine_done(self, timeout: float) -> None:
        """Block until every configured round ran (or the engine failed)."""
        if not self.engine_done.wait(timeout):
            raise AssertionError(f"round engine still running after {timeout} s")
        error = self.engine_error()
        if error is not None:
            raise AssertionError(f"round engine failed: {error!r}")


@pytest.fixture
def coordinator(
    pki_layout: PkiLayout, tmp_path: Path
) -> Iterator[Callable[..., InProcessCoordinator]]:
    """Factory: `coordinator(model_dim=..., **settings_overrides)` starts one; all stop
    at teardown."""
    started: list[InProcessCoordinator] = []

    def make(*, model_dim: int = MODEL_DIM, **overrides: Any) -> InProcessCoordinator:
        state = tmp_path / f"coordinator-{len(started)}"
        running = InProcessCoordinator(coordinator_settings(pki_layout, state, **overrides),
                                       model_dim=model_dim)
        started.append(running.__enter__())
        return running

    yield make
    for running in reversed(started):
        running.__exit__(None, None, None)


# ------------------------------------------------------------------- raw stubs


def raw_channel(
    pki_layout: PkiLayout,
    address: str,
    *,
    cert_of: str | None,
    foreign: bool = False,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A channel that presents `cert_of`'s certificate unchecked (None: no certificate).

    Bypasses `common.protocol.tls` on purpose: a hostile client does not check its own files.
    """
    if cert_of is None:
        credentials = grpc.ssl_channel_credentials(root_certificates=pki_layout.ca_pem)
    else:
        cert_pem, key_pem = pki_layout.site_pair(cert_of, foreign=foreign)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=pki_layout.ca_pem, private_key=key_pem, certificate_chain=cert_pem
        )
    return grpc.secure_channel(
        address,
        credentials,
        options=[("grpc.max_send_message_length", 16 << 20), *options],
    )


def raw_stub(
    pki_layout: PkiLayout, address: str, *, cert_of: str | None, foreign: bool = False
) -> pb_grpc.FederationStub:
    return pb_grpc.FederationStub(
        raw_channel(pki_layout, address, cert_of=cert_of, foreign=foreign)
    )


def status_of(call: Callable[..., Any], *args: Any, **kwargs: Any) -> grpc.StatusCode:
    """The status code an RPC ends with (OK if it returns)."""
    try:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__") and not hasattr(result, "ByteSize"):
            for _ in result:  # drain server streams
                pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def health_status(pki_layout: PkiLayout, address: str, *, cert_of: str = "f") -> int:
    """The coordinator's health answer to a valid site (raises if it does not answer)."""
    channel = raw_channel(pki_layout, address, cert_of=cert_of)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    finally:
        channel.close()
    return int(reply.status)


# ------------------------------------------------------------------ honest sites


@dataclass
class HonestSites:
    """Site agents with `DeterministicTestHook`, each in its own thread."""

    states: dict[str, Path]
    threads: dict[str, threading.Thread]
    stop: threading.Event
    codes: dict[str, int] = field(default_factory=dict)

    def join(self, timeout: float) -> dict[str, int]:
        """Wait until every agent returned (the federation finished); their exit codes."""
        for site, thread in self.threads.items():
            thread.join(timeout)
            if thread.is_alive():
                self.stop.set()
                raise AssertionError(f"site {site} still running after {timeout} s")
        return dict(self.codes)

    def update(self, site: str, round_number: int) -> np.ndarray:
        """The plaintext ring vector `site` contributed to `round_number`."""
        path = self.states[site] / "debug-updates" / f"round-{round_number:06d}.u32"
        return np.fromfile(path, dtype="<u4")


@pytest.fixture
def honest_sites(
    pki_layout: PkiLayout, tmp_path: Path
) -> Iterator[Callable[[str, Sequence[str]], HonestSites]]:
    """Factory: `honest_sites(address, ["a", "b"])` starts agents; stopped at teardown."""
    stop = threading.Event()
    started: list[HonestSites] = []

    def make(address: str, sites: Sequence[str]) -> HonestSites:
        states: dict[str, Path] = {}
        threads: dict[str, threading.Thread] = {}
        group = HonestSites(states, threads, stop)
        for site in sites:
            state = tmp_path / f"site-{site}-{len(started)}"
            states[site] = state
            settings = SiteSettings(
                pki=pki_layout.root,
                site=site,
                coordinator=address,
                metrics_listen="127.0.0.1:0",
                state=state,
                reconnect={"initial_backoff_seconds": 0.1, "max_backoff_seconds": 0.5},
            )
            agent = SiteAgent(
                settings, DeterministicTestHook(site), metrics=SiteMetrics(site), ledger=None,
                stop=stop, observer=Instrumentation(state, write_updates=True),
            )

            def run(agent: SiteAgent = agent, site: str = site) -> None:
                group.codes[site] = agent.run()

            threads[site] = threading.Thread(target=run, name=f"site-{site}", daemon=True)
        for thread in threads.values():
            thread.start()
        started.append(group)
        return group

    yield make
    stop.set()
    alive = []
    for group in started:
        for thread in group.threads.values():
            thread.join(10)
            if thread.is_alive():
                alive.append(thread)
    assert not alive, "site agents still running 10 s after stop:\n" + "\n".join(
        thread_stack(thread) for thread in alive)


# ------------------------------------------------------------- scripted (hostile) site


def certificate_identity(ca_cert: Any) -> Callable[[str, bytes], VerifyingKey]:
    """Roster check a site makes: the certificate chains to our CA and names the site."""

    def identity(site_id: str, certificate_der: bytes) -> VerifyingKey:
        cert = pki.parse_certificate(certificate_der)
        pki.check_issued_by(cert, ca_cert, what=site_id)
        if pki.site_id_from_certificate(cert) != site_id:
            raise CertificateRejected("roster certificate names another site")
        return VerifyingKey.from_certificate(cert)

    return identity


class ScriptedSite:
    """A participant driven step by step from the test: honest by default, so a test
    can misbehave in exactly one place. It speaks with the certificate of `cert_of`
    (its own unless a test borrows another's)."""

    def __init__(self, pki_layout: PkiLayout, address: str, site_id: str) -> None:
        self.site_id = site_id
        self.pki_layout = pki_layout
        self.stub = raw_stub(pki_layout, address, cert_of=site_id)
        _, key_pem = pki_layout.site_pair(site_id)
        self.signing_key = SigningKey.from_pem(key_pem)
        self.ca_cert = pki.load_ca(pki_layout.root)
        self.announcement: pb.RoundAnnouncement | None = None
        self.client: SecAggClient | None = None
        self.plain_vector: np.ndarray | None = None
        self.session = b""

    # -- membership
    def enroll(self) -> None:
        self.stub.Enroll(pb.EnrollRequest(agent_version="scripted/1"), timeout=10)

    def wait_for_round(self, timeout: float = 30) -> pb.RoundAnnouncement:
        reply = self.stub.WaitForRound(
            pb.WaitForRoundRequest(wait_seconds=int(timeout)), timeout=timeout + 5
        )
        if not reply.has_round:
            raise AssertionError(f"{self.site_id} was not selected for a round")
        self.join_round(reply.round)
        return reply.round

    def join_round(self, ann: pb.RoundAnnouncement) -> None:
        """Set up this round's SecAgg+ client and plaintext update."""
        self.announcement = ann
        # The announcement digest is bound into the session as every honest site binds it.
        params = secagg_params(wire.announcement_from_pb(ann))
        self.client = SecAggClient(
            params,
            site_id=self.site_id,
            signing_key=self.signing_key,
            identity=certificate_identity(self.ca_cert),
            rng=system_random,
        )
        self.plain_vector = self._encoded_update(ann)

    def _encoded_update(self, ann: pb.RoundAnnouncement) -> np.ndarray:
        """A well-formed ring vector, as an honest agent would encode it."""
        seed = hashlib.sha256(f"scripted/{self.site_id}/{ann.round}".encode()).digest()
        gen = np.random.Generator(np.random.PCG64(int.from_bytes(seed[:8], "big")))
        bins = ann.histogram_bins
        delta = gen.uniform(-0.1, 0.1, size=ann.vector_length - 1 - 2 * bins)
        out = np.empty(ann.vector_length, dtype=np.uint32)
        encode_update(
            delta.astype(np.float32) * np.float32(10 / ann.weight_cap),
            integers=[10, *([1] * (2 * bins))],
            clip=ann.clip,
            bits=ann.quantization_bits,
            n_sites=len(ann.participants),
            rng=numpy_generator(system_random),
            out=out,
        )
        return out

    @property
    def ann(self) -> pb.RoundAnnouncement:
        if self.announcement is None:
            raise AssertionError("no round yet")
        return self.announcement

    @property
    def secagg(self) -> SecAggClient:
        if self.client is None:
            raise AssertionError("no round yet")
        return self.client

    # -- honest messages, one per phase (tests may alter them before sending)
    def advertise_request(self) -> pb.AdvertiseKeysRequest:
        return wire.advertise_to_pb(
            self.secagg.advertise_keys(), round_number=self.ann.round, nonce=self.ann.round_nonce
        )

    def send_advertise(self, request: pb.AdvertiseKeysRequest) -> pb.ShareKeysRequest:
        """Send keys, check the roster, return the (unsent) ShareKeys request."""
        return self.accept_roster(self.stub.AdvertiseKeys(request, timeout=30))

    def accept_roster(self, roster: pb.AdvertiseKeysResponse) -> pb.ShareKeysRequest:
        """Verify the roster (every signature) and build this site's ShareKeys request."""
        shares = self.secagg.receive_roster(wire.roster_from_pb(roster))
        self.session = self.secagg.session_id
        return wire.share_keys_to_pb(shares, round_number=self.ann.round, session=self.session)

    def send_shares(self, request: pb.ShareKeysRequest) -> np.ndarray:
        """Send shares; return the masked vector for this site's upload."""
        received = self.stub.ShareKeys(request, timeout=30)
        masked = self.secagg.receive_shares(
            wire.shares_for_recipient_from_pb(received), self.plain_vector.copy()
        )
        return masked.vector

    def upload_chunks(
        self, vector: np.ndarray, *, length: int | None = None, chunk_bytes: int = 4096
    ) -> list[pb.MaskedInputChunk]:
        header = pb.MaskedInputHeader(
            round=self.ann.round,
            session_id=self.session,
            vector_length=vector.size if length is None else length,
        )
        chunks = [pb.MaskedInputChunk(header=header)]
        for offset, data in iter_chunks(vector, chunk_bytes=chunk_bytes):
            chunks.append(pb.MaskedInputChunk(chunk=pb.ModelChunk(offset=offset, data=data)))
        return chunks

    def send_upload(self, chunks: Sequence[pb.MaskedInputChunk]) -> pb.ConsistencyCheckRequest:
        survivors = self.stub.UploadMaskedInput(iter(chunks), timeout=30)
        signature = self.secagg.receive_survivors(wire.survivors_from_pb(survivors))
        return pb.ConsistencyCheckRequest(
            round=self.ann.round, session_id=self.session, signature=signature.signature
        )

    def send_consistency(self, request: pb.ConsistencyCheckRequest) -> pb.UnmaskRequest:
        sigs = self.stub.ConsistencyCheck(request, timeout=30)
        reveal = self.secagg.receive_consistency(wire.signatures_from_pb(sigs))
        return wire.unmask_to_pb(reveal, round_number=self.ann.round, session=self.session)

    def send_unmask(self, request: pb.UnmaskRequest) -> pb.UnmaskResponse:
        reply: pb.UnmaskResponse = self.stub.Unmask(request, timeout=30)
        self.secagg.complete()
        return reply


# ----------------------------------------------------------------- sum checking


def read_aggregate(state: Path, round_number: int) -> tuple[np.ndarray, tuple[str, ...]]:
    """The coordinator's unmasked ring sum and its survivor list (debug files)."""
    folder = state / "aggregates"
    aggregate = np.fromfile(folder / f"round-{round_number:06d}.u32", dtype="<u4")
    survivors = tuple(
        line for line in (folder / f"round-{round_number:06d}.survivors").read_text().split()
    )
    return aggregate, survivors


def ring_sum(vectors: Sequence[np.ndarray]) -> np.ndarray:
    total = np.zeros_like(vectors[0], dtype=np.uint32)
    for vector in vectors:
        np.add(total, vector.astype(np.uint32), out=total)  # wraps mod 2**32
    return total


__all__ = [
    "CHUNK_BYTES",
    "HONEST_SITES",
    "MAX_CHUNK_BYTES",
    "HonestSites",
    "InProcessCoordinator",
    "PkiLayout",
    "ScriptedSite",
    "coordinator_settings",
    "health_status",
    "raw_channel",
    "raw_stub",
    "read_aggregate",
    "ring_sum",
    "status_of",
]
