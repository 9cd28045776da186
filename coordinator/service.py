"""`medfed coordinator serve`: the gRPC server (mTLS only), health, reflection, metrics
and the round engine, on one asyncio event loop."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import signal
import sys
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.core.config import CoordinatorSettings, is_loopback_host, parse_host_port
from common.core.errors import ConfigError, StudyFailed
from common.core.observer import RoundObserver
from common.core.state_lock import StateLock
from common.crypto.signing import VerifyingKey
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.protocol.metrics_http import MetricsTls, serve_metrics
from common.protocol.pki import COORDINATOR_CERT, CRL_FILE, PeerVerifier, load_ca, load_certificate
from common.protocol.tls import RequireCertificateRole, TlsFiles, server_credentials
from common.releases.convergence import auc_trend, describe_auc_trend
from coordinator.checkpoints import InitialModel
from coordinator.engine import RoundEngine
from coordinator.metrics import CoordinatorMetrics
from coordinator.refusals import RefusalLog
from coordinator.revocation import CrlRelay
from coordinator.servicer import FederationServicer, MonitorServicer, add_to_server
from coordinator.store import CoordinatorStore
from coordinator.study_run import StudyRun

log = logging.getLogger("medfed.coordinator")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Federation"].full_name
MONITOR_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Monitor"].full_name


def log_convergence(store: CoordinatorStore) -> None:
    """At the study's end: was the model still improving? (the DP-evaluated AUC of the
    global model over the last rounds; post-processing of released histograms)."""
    aucs = [float(r.metrics["auc"]) for r in store.rounds()
            if r.status == "completed" and isinstance(r.metrics.get("auc"), int | float)]
    verdict = auc_trend(aucs)
    log.info("study convergence: %s", describe_auc_trend(aucs),
             extra={"event": "study_convergence", "aucs": aucs,
                    "still_improving": verdict.improving})


@dataclass
class RunningCoordinator:
    server: grpc.aio.Server
    engine: RoundEngine
    port: int
    metrics_port: int
    health: health.aio.HealthServicer
    metrics_server: WSGIServer | None = None
    state_lock: StateLock | None = None

    async def stop(self, *, grace: float | None = 0.0) -> None:
        """Stop serving and release every port and file: gRPC (in-flight calls get
        `grace` seconds), the Prometheus exporter, then the state store. The round
        engine task is the caller's to cancel."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        exporter = self.metrics_server
        if exporter is not None:
            self.metrics_server = None
            # shutdown() blocks until the exporter's serve_forever loop notices (up to
            # its 0.5 s poll interval): off the event loop.
            await asyncio.to_thread(exporter.shutdown)
            exporter.server_close()
        self.engine.store.close()
        if self.state_lock is not None:
            self.state_lock.release()


def database_url(settings: CoordinatorSettings) -> str:
    return settings.database_url or f"sqlite:///{settings.state / 'coordinator.db'}"


async def start(
    settings: CoordinatorSettings, *, observer: RoundObserver | None = None,
    model_without_study: InitialModel | None = None,
) -> RunningCoordinator:
    """Serve `settings` on its ports, holding its state folder (one coordinator per
    folder: a second is refused naming the holder) until `RunningCoordinator.stop`.
    `observer`: what a test plugs in to watch the rounds (`common.core.observer`);
    `model_without_study`: the flat model a transport test serves instead of a study
    (`bench.instrumented --model-dim`), plugged in by code, never by a setting."""
    if settings.study is None and model_without_study is None:
        raise ConfigError(
            "study", "coordinator serve needs --study study.toml (see `medfed study init`)"
        )
    if settings.study is not None and model_without_study is not None:
        raise ConfigError("study", "a study gives the model: a flat model without a study "
                          "(transport tests) and a study, not both")
    # Ledger, state database and checkpoints: readable by this service only.
    try:
        settings.state.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise ConfigError(
            "state", f"cannot create the state folder {settings.state}: {exc.strerror or exc}"
        ) from exc
    lock = StateLock.acquire(settings.state, role="coordinator")
    try:
        running = await _start(settings, observer=observer,
                               model_without_study=model_without_study)
    except BaseException:
        lock.release()
        raise
    running.state_lock = lock
    return running


async def _start(
    settings: CoordinatorSettings, *, observer: RoundObserver | None,
    model_without_study: InitialModel | None,
) -> RunningCoordinator:
    store = CoordinatorStore(database_url(settings))
    verifier = PeerVerifier.from_pki_dir(settings.pki)
    metrics = CoordinatorMetrics()
    store.database.on_reconnect = metrics.database_reconnects_total.inc
    ca_cert = load_ca(settings.pki)
    metrics.observe_certificate("ca", "ca", ca_cert)
    metrics.observe_certificate(
        "coordinator", "coordinator", load_certificate(settings.pki / COORDINATOR_CERT)
    )
    crl = CrlRelay(settings.pki / CRL_FILE, ca_cert, metrics=metrics)
    crl.der()  # the nextUpdate gauge from the first scrape

    def identity(site_id: str, certificate_der: bytes) -> VerifyingKey:
        key = verifier.verifying_key_for(site_id, certificate_der, now=dt.datetime.now(dt.UTC))
        return VerifyingKey.from_public_key(key)

    study = StudyRun.open(settings.study, settings.state,
                          initial_model=settings.initial_model) if settings.study else None
    engine = RoundEngine(settings, store, identity=identity, metrics=metrics, study=study,
                         observer=observer, model_without_study=model_without_study)
    refusals = RefusalLog(metrics)
    server = grpc.aio.server(
        # Per-method certificate roles: sites call Federation, monitors Health/status,
        # revoked certificates nothing (common/protocol/tls.py, ACCESS_RULES). Each refusal is
        # logged (rate-limited) and counted: no servicer runs to do it.
        interceptors=[RequireCertificateRole(verifier, on_refused=refusals)],
        options=[
            ("grpc.max_receive_message_length", settings.limits.max_message_bytes),
            ("grpc.max_send_message_length", 8 << 20),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            # gRPC sets SO_REUSEPORT by default: a second coordinator would then bind
            # the same port and silently share the sites' connections.
            ("grpc.so_reuseport", 0),
        ]
    )
    servicer = FederationServicer(
        engine,
        verifier,
        metrics,
        federation_id=settings.federation_id,
        crl=crl,
    )
    add_to_server(servicer, server)
    pb_grpc.add_MonitorServicer_to_server(  # type: ignore[no-untyped-call]
        MonitorServicer(engine, federation_id=settings.federation_id, metrics=metrics), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, MONITOR_SERVICE_NAME,
         health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    # mTLS is the only transport: there is no insecure port to forget to close.
    try:
        try:
            port = server.add_secure_port(settings.listen, server_credentials(settings.pki))
        except RuntimeError:  # grpc raises "Failed to bind" (older versions return 0)
            port = 0
        if port == 0:
            raise ConfigError(
                "listen", f"cannot listen on {settings.listen}: the port is already in use "
                "(another coordinator?) or the address is not local",
            )
        await server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        metrics_server, metrics_port = serve_metrics(
            settings.metrics_listen, metrics.registry,
            tls=metrics_tls(settings, verifier, on_refused=refusals),
        )
    except BaseException:
        await server.stop(None)
        store.close()
        raise
    return RunningCoordinator(
        server, engine, port, metrics_port, health_servicer, metrics_server=metrics_server
    )


def metrics_tls(
    settings: CoordinatorSettings, verifier: PeerVerifier, *, on_refused: RefusalLog
) -> MetricsTls | None:
    """HTTPS for /metrics (`settings.metrics_over_tls`): the coordinator's own pair,
    monitor certificates only, checked by the gRPC port's `verifier`; None for plain
    HTTP, with a warning where that reaches beyond loopback (`metrics_tls = false`)."""
    if settings.metrics_over_tls:
        return MetricsTls(TlsFiles.for_coordinator(settings.pki), verifier,
                          on_refused=on_refused)
    if not is_loopback_host(parse_host_port(settings.metrics_listen)[0]):
        log.warning(
            "/metrics on %s is plain HTTP without authentication (metrics_tls = false): "
            "anyone who reaches that address reads it", settings.metrics_listen,
            extra={"event": "metrics_plain_http", "metrics_listen": settings.metrics_listen},
        )
    return None


async def serve(
    settings: CoordinatorSettings, *, exit_when_finished: bool = False,
    linger_seconds: float = 5.0, observer: RoundObserver | None = None,
    model_without_study: InitialModel | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT. A finished study is not an outage: the coordinator
    stays up (status `finished`, Health SERVING, sites told the federation finished);
    `exit_when_finished` (batch use) exits `linger_seconds` after the last round."""
    running = await start(settings, observer=observer, model_without_study=model_without_study)
    # One machine-readable line so scripts and tests learn the bound ports.
    print(
        json.dumps({"event": "listening", "port": running.port,
                    "metrics_port": running.metrics_port,
                    "metrics_tls": settings.metrics_over_tls}),
        flush=True,
    )
    log.info("coordinator listening on port %d (metrics %d, %s)", running.port,
             running.metrics_port,
             "HTTPS for monitor certificates" if settings.metrics_over_tls else "plain HTTP")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine_task = asyncio.create_task(running.engine.run())
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({engine_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if engine_task in done:
        exc = engine_task.exception()
        if isinstance(exc, StudyFailed):
            # Not an outage: the study cannot finish. Status keeps saying why and sites
            # polling hear it (they stop), until the operator stops the coordinator.
            log.error("%s", exc, extra={"event": "study_failed", "reason": exc.reason})
            print(f"medfed: error: {exc}", file=sys.stderr)
            code = 1
            if exit_when_finished:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=linger_seconds)
            else:
                log.info("study failed: still serving status until stopped")
                await stop.wait()
        elif exc is not None:
            # Waiting sites were told UNAVAILABLE (never "finished"): they retry until a
            # coordinator restarted on the same state resumes the study.
            cause = f"{type(exc).__name__}: {exc}"
            log.error("round engine failed: %s", cause, exc_info=exc,
                      extra={"event": "engine_failed", "reason": cause})
            print(f"medfed: error: round engine failed: {cause}", file=sys.stderr)
            code = 1
        else:
            rounds = running.engine.settings.rounds  # the study's, when it gives them
            log.info("all %d rounds done: the study's training rounds (its statistics and "
                     "final evaluation rounds, and any aborted round, come on top)", rounds,
                     extra={"event": "study_finished", "rounds": rounds})
            log_convergence(running.engine.store)
            if exit_when_finished:
                # Let waiting sites hear that the federation is finished.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=linger_seconds)
            else:
                log.info("study finished: still serving status and the final model "
                         "until stopped (--exit-when-finished to exit instead)")
                await stop.wait()
    else:
        engine_task.cancel()
    await running.stop(grace=2.0)
    return code
