"""Refused calls leave a trace (review: "the coordinator refuses certificates silently").

`RequireCertificateRole` refuses a revoked or unknown-status certificate before any
servicer runs; the coordinator must still log each refusal at warning level (reason,
certificate subject / serial / fingerprint, method; repeats rate-limited) and count it
in `medfed_coordinator_grpc_requests_total{method,code}`. Real coordinator, real
sockets, real mTLS; the CRL is a real file that is revoked into or deleted.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import hashes
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.instrumented import flat_model
from common.commands.status import fetch_status, refusal_hint
from common.core.config import CoordinatorSettings
from common.core.errors import ConfigError
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.protocol import pki, tls
from coordinator.metrics import CoordinatorMetrics
from coordinator.refusals import RefusalLog, method_label
from coordinator.service import start
from tests.pki.credentials import monitor_credentials, site_credentials

SECURITY_LOGGER = "medfed.coordinator.security"


@pytest.fixture
def monitor_pki(pki_dir: Path, now: dt.datetime) -> Path:
    pki.issue_monitor(pki_dir, "ops", now=now)
    return pki_dir


@pytest.fixture
def security_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.WARNING, logger=SECURITY_LOGGER)
    yield caplog


def refusals(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == SECURITY_LOGGER and getattr(r, "event", "") == "call_refused"]


def settings_for(pki_dir: Path, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(
        pki=pki_dir, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0",
        state=tmp_path / "state", rounds=1, min_sites=3,
    )


def grpc_requests(metrics_port: int) -> dict[tuple[str, str], float]:
    """`medfed_coordinator_grpc_requests_total` as scraped: (method, code) -> count."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "medfed_coordinator_grpc_requests_total":
                out[(sample.labels["method"], sample.labels["code"])] = sample.value
    return out


def fingerprint(cert_path: Path) -> str:
    return pki.load_certificate(cert_path).fingerprint(hashes.SHA256()).hex()


async def code_of(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def health_check(channel: grpc.aio.Channel) -> object:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


def test_a_revoked_site_is_logged_once_and_counted_every_time(
    monitor_pki: Path, tmp_path: Path, security_log: pytest.LogCaptureFixture
) -> None:
    """A revoked hospital retrying Enroll: one warning line (reason, subject, serial,
    fingerprint, method, peer), every call in the metric; a monitor's Status counted."""
    pki.revoke_site(monitor_pki, "h1", now=dt.datetime.now(dt.UTC))
    site_cert, _ = pki.site_paths(monitor_pki, "h1")

    async def scenario() -> dict[tuple[str, str], float]:
        running = await start(settings_for(monitor_pki, tmp_path),
                              model_without_study=flat_model(8))
        try:
            address = f"127.0.0.1:{running.port}"
            async with grpc.aio.secure_channel(
                address, site_credentials(monitor_pki, "h1")
            ) as channel:
                stub = pb_grpc.FederationStub(channel)  # type: ignore[no-untyped-call]
                for _ in range(3):
                    enroll = stub.Enroll(pb.EnrollRequest(), timeout=5)
                    assert await code_of(enroll) == grpc.StatusCode.PERMISSION_DENIED
                assert await code_of(health_check(channel)) == grpc.StatusCode.PERMISSION_DENIED
            monitor = monitor_credentials(monitor_pki, "ops")
            async with grpc.aio.secure_channel(address, monitor) as channel:
                status = pb_grpc.MonitorStub(channel).Status(  # type: ignore[no-untyped-call]
                    pb.StatusRequest(), timeout=5)
                assert await code_of(status) == grpc.StatusCode.OK
            return await asyncio.to_thread(grpc_requests, running.metrics_port)
        finally:
            await running.stop()

    counted = asyncio.run(scenario())
    assert counted[("Enroll", "PERMISSION_DENIED")] == 3
    assert counted[("Health.Check", "PERMISSION_DENIED")] == 1
    assert counted[("Status", "OK")] == 1
    lines = refusals(security_log)
    # Same certificate, same reason: Enroll x3 and Health x1 are one line.
    assert len(lines) == 1, [r.getMessage() for r in lines]
    line = lines[0]
    assert line.levelno == logging.WARNING
    message = line.getMessage()
    assert "Enroll" in message and "PERMISSION_DENIED" in message
    assert "'h1' has been revoked" in message and "127.0.0.1" in message
    assert vars(line)["fingerprint_sha256"] == fingerprint(site_cert)
    assert fingerprint(site_cert) in message and "h1" in vars(line)["subject"]
    serial = format(pki.load_certificate(site_cert).serial_number, "x")
    assert vars(line)["serial"] == serial and vars(line)["method"] == "Enroll"


def test_repeats_are_rate_limited_per_certificate_and_reason(
    pki_dir: Path, security_log: pytest.LogCaptureFixture
) -> None:
    """Within the window only the first refusal is logged; the next line after it says
    how many were left out; another certificate gets its own line at once."""
    now = [1000.0]
    metrics = CoordinatorMetrics()
    reporter = RefusalLog(metrics, window_seconds=60, clock=lambda: now[0])
    revoked_at = dt.datetime.now(dt.UTC)
    pki.revoke_site(pki_dir, "h1", now=revoked_at)
    pki.revoke_site(pki_dir, "h2", now=revoked_at)

    async def scenario() -> None:
        verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
        server = grpc.aio.server(
            interceptors=[tls.RequireCertificateRole(verifier, on_refused=reporter)])
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(pki_dir))
        await server.start()
        address = f"127.0.0.1:{port}"
        try:
            async with (
                grpc.aio.secure_channel(address, site_credentials(pki_dir, "h1")) as h1,
                grpc.aio.secure_channel(address, site_credentials(pki_dir, "h2")) as h2,
            ):
                for _ in range(5):
                    assert await code_of(health_check(h1)) == grpc.StatusCode.PERMISSION_DENIED
                assert len(refusals(security_log)) == 1
                assert await code_of(health_check(h2)) == grpc.StatusCode.PERMISSION_DENIED
                assert len(refusals(security_log)) == 2  # another certificate: logged
                now[0] += 61
                assert await code_of(health_check(h1)) == grpc.StatusCode.PERMISSION_DENIED
        finally:
            await server.stop(None)

    asyncio.run(scenario())
    lines = refusals(security_log)
    assert [vars(r)["suppressed"] for r in lines] == [0, 0, 4]
    assert "4 identical refusals not logged" in lines[2].getMessage()
    total = metrics.registry.get_sample_value(
        "medfed_coordinator_grpc_requests_total",
        {"method": "Health.Check", "code": "PERMISSION_DENIED"})
    assert total == 7  # every refusal counted, logged or not


def test_missing_crl_is_logged_and_status_names_the_crl_not_the_role(
    monitor_pki: Path, tmp_path: Path, security_log: pytest.LogCaptureFixture
) -> None:
    """crl.pem deleted under a running coordinator: it refuses everyone (fail closed),
    says why in its log and metric, and `medfed status` with a perfectly good monitor
    certificate points at the CRL, not at "you need a monitor certificate"."""
    files = tls.TlsFiles.for_monitor(monitor_pki, "ops")

    async def scenario() -> tuple[str, dict[tuple[str, str], float]]:
        running = await start(settings_for(monitor_pki, tmp_path),
                              model_without_study=flat_model(8))
        try:
            address = f"127.0.0.1:{running.port}"
            (monitor_pki / pki.CRL_FILE).unlink()
            with pytest.raises(ConfigError) as refused:
                await asyncio.to_thread(
                    fetch_status, address, ca=files.ca, cert=files.cert, key=files.key,
                    timeout=10)
            return str(refused.value), await asyncio.to_thread(
                grpc_requests, running.metrics_port)
        finally:
            await running.stop()

    message, counted = asyncio.run(scenario())
    assert "revocation status unknown" in message and "crl" in message.lower()
    assert "medfed pki crl" in message
    assert "status needs a monitor certificate" not in message
    assert counted[("Status", "PERMISSION_DENIED")] == 1
    [line] = refusals(security_log)
    assert "is missing" in vars(line)["reason"] and vars(line)["method"] == "Status"
    assert fingerprint(files.cert) in line.getMessage()


def test_status_hint_follows_the_stated_reason() -> None:
    assert "monitor certificate" in refusal_hint("a site certificate may not call this method")
    assert "revoked" in refusal_hint("certificate of monitor 'ops' has been revoked")
    crl = refusal_hint("revocation status unknown: CRL expired at 2026-01-01T00:00:00+00:00")
    assert "medfed pki crl" in crl and "monitor certificate:" not in crl


def test_method_labels_stay_bounded() -> None:
    assert method_label("/medfed.v1.Federation/Enroll") == "Enroll"
    assert method_label("/medfed.v1.Monitor/Status") == "Status"
    assert method_label("/grpc.health.v1.Health/Check") == "Health.Check"
    assert method_label(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    ) == "ServerReflection.ServerReflectionInfo"
