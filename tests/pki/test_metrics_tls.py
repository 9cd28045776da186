"""The coordinator's /metrics over HTTPS, for monitor certificates only, on real sockets.

Decision (docs/operations.md, "Who may read /metrics"): `metrics_tls = "auto"` (the
default) serves HTTPS whenever `metrics_listen` reaches beyond loopback; the server
presents the coordinator's certificate and answers only a current, unrevoked monitor
certificate of the federation, the rule the gRPC port applies to Health and status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge

from bench.instrumented import flat_model
from common.core.config import CoordinatorSettings, is_loopback_host
from common.core.errors import ConfigError, PkiError
from common.protocol import metrics_http, pki
from common.protocol.metrics_http import MetricsTls, serve_metrics
from common.protocol.pki import Role
from common.protocol.tls import Refusal, TlsFiles
from coordinator.service import start


@pytest.fixture
def monitor_pki(pki_dir: Path, now: dt.datetime) -> Path:
    pki.issue_monitor(pki_dir, "prometheus", now=now)
    return pki_dir


@pytest.fixture
def refusals() -> list[Refusal]:
    return []


@pytest.fixture
def served(monitor_pki: Path, refusals: list[Refusal]) -> Iterator[int]:
    """A registry with one gauge behind `serve_metrics(..., tls=...)`: its port."""
    registry = CollectorRegistry()
    Gauge("medfed_test_marker", "A series only a monitor may read.", registry=registry).set(7)
    tls = MetricsTls(TlsFiles.for_coordinator(monitor_pki),
                     pki.PeerVerifier.from_pki_dir(monitor_pki), on_refused=refusals.append)
    server, port = serve_metrics("127.0.0.1:0", registry, tls=tls)
    try:
        yield port
    finally:
        server.shutdown()
        server.server_close()


def client_context(ca: Path, pair: tuple[Path, Path] | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if pair is not None:
        context.load_cert_chain(str(pair[0]), str(pair[1]))
    return context


def scrape(port: int, context: ssl.SSLContext) -> tuple[int, str]:
    """(HTTP status, body) of GET /metrics, verifying the server as 127.0.0.1."""
    url = f"https://127.0.0.1:{port}/metrics"
    try:
        with urllib.request.urlopen(url, context=context, timeout=30) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def refused_at_handshake(port: int, context: ssl.SSLContext) -> bool:
    """True when the connection fails before any HTTP answer (TLS 1.3 reports a refused
    client certificate on the client's first read, not in its handshake)."""
    try:
        scrape(port, context)
    except (urllib.error.URLError, ssl.SSLError, ConnectionError):
        return True
    return False


def test_a_monitor_certificate_scrapes_metrics_over_https(
    served: int, monitor_pki: Path, refusals: list[Refusal]
) -> None:
    status, body = scrape(served, client_context(
        monitor_pki / "ca.crt", pki.monitor_paths(monitor_pki, "prometheus")))
    assert status == 200
    assert "medfed_test_marker 7.0" in body
    assert refusals == []


def test_attack_plain_http_to_the_tls_port_reads_nothing(served: int) -> None:
    with pytest.raises((urllib.error.URLError, ConnectionError)) as raised:
        urllib.request.urlopen(f"http://127.0.0.1:{served}/metrics", timeout=30)
    assert not isinstance(raised.value, urllib.error.HTTPError)


def test_attack_a_scrape_without_a_client_certificate_is_refused(
    served: int, monitor_pki: Path
) -> None:
    assert refused_at_handshake(served, client_context(monitor_pki / "ca.crt", None))


def test_attack_a_monitor_of_another_ca_is_refused(
    served: int, monitor_pki: Path, foreign_dir: Path, now: dt.datetime
) -> None:
    pki.issue_monitor(foreign_dir, "prometheus", now=now)
    # It trusts our CA for the server, and presents a pair our CA never signed.
    context = client_context(monitor_pki / "ca.crt", pki.monitor_paths(foreign_dir, "prometheus"))
    assert refused_at_handshake(served, context)


def test_attack_a_site_certificate_cannot_read_metrics(
    served: int, monitor_pki: Path, refusals: list[Refusal]
) -> None:
    status, body = scrape(served, client_context(
        monitor_pki / "ca.crt", pki.site_paths(monitor_pki, "h1")))
    assert status == 403
    assert "medfed_test_marker" not in body
    assert "site certificate ('h1') may not read metrics" in body
    (refusal,) = refusals
    assert refusal.method == metrics_http.METRICS_PATH
    assert refusal.certificate is not None and "h1" in refusal.reason


def test_attack_a_revoked_monitor_is_refused_without_a_restart(
    served: int, monitor_pki: Path, now: dt.datetime
) -> None:
    context = client_context(monitor_pki / "ca.crt", pki.monitor_paths(monitor_pki, "prometheus"))
    assert scrape(served, context)[0] == 200
    pki.revoke(monitor_pki, Role.MONITOR, "prometheus", now=now)
    status, body = scrape(served, context)
    assert status == 403
    assert "revoked" in body and "medfed_test_marker" not in body


def test_attack_a_missing_crl_refuses_every_scrape(served: int, monitor_pki: Path) -> None:
    """Fail closed, as the gRPC port: revocation status unknown refuses everyone."""
    (monitor_pki / "crl.pem").unlink()
    status, body = scrape(served, client_context(
        monitor_pki / "ca.crt", pki.monitor_paths(monitor_pki, "prometheus")))
    assert status == 403
    assert "revocation status unknown" in body


def test_attack_a_stalled_handshake_does_not_hold_other_scrapes(
    served: int, monitor_pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that connects and never speaks TLS holds its own thread only: the
    handshake deadline is made longer than the scrape's timeout, so a server that shook
    hands in its accepting thread would fail the scrape below."""
    monkeypatch.setattr(metrics_http, "HANDSHAKE_SECONDS", 3600.0)
    context = client_context(monitor_pki / "ca.crt", pki.monitor_paths(monitor_pki, "prometheus"))
    with socket.create_connection(("127.0.0.1", served)):
        assert scrape(served, context)[0] == 200


def test_attack_a_connection_flood_holds_no_more_than_its_bound(
    monitor_pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections beyond MAX_CONNECTIONS are closed at once, not given a thread each."""
    monkeypatch.setattr(metrics_http, "HANDSHAKE_SECONDS", 3600.0)
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 2)
    tls = MetricsTls(TlsFiles.for_coordinator(monitor_pki),
                     pki.PeerVerifier.from_pki_dir(monitor_pki))
    server, port = serve_metrics("127.0.0.1:0", CollectorRegistry(), tls=tls)
    try:
        stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as third:
                assert third.recv(1) == b""  # closed by the server, not left waiting
        finally:
            for connection in stalled:
                connection.close()
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_certificate_that_is_not_the_coordinators_is_refused_at_start(
    monitor_pki: Path,
) -> None:
    """The start-up checks of the gRPC port: a pair that does not match fails naming it."""
    files = TlsFiles.for_coordinator(monitor_pki)
    mismatched = dataclasses.replace(files, key=pki.monitor_paths(monitor_pki, "prometheus")[1])
    tls = MetricsTls(mismatched, pki.PeerVerifier.from_pki_dir(monitor_pki))
    with pytest.raises(PkiError, match="does not match"):
        serve_metrics("127.0.0.1:0", CollectorRegistry(), tls=tls)


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(("listen", "setting", "over_tls"), [
    ("127.0.0.1:9464", "auto", False),
    ("localhost:9464", "auto", False),
    ("[::1]:9464", "auto", False),
    ("0.0.0.0:9464", "auto", True),
    ("[::]:9464", "auto", True),
    ("10.0.0.5:9464", "auto", True),
    ("coordinator:9464", "auto", True),
    ("127.0.0.1:9464", True, True),
    ("0.0.0.0:9464", False, False),
])
def test_metrics_are_https_by_default_beyond_loopback(
    tmp_path: Path, listen: str, setting: object, over_tls: bool
) -> None:
    settings = CoordinatorSettings(pki=tmp_path, state=tmp_path, metrics_listen=listen,
                                   metrics_tls=setting)
    assert settings.metrics_over_tls is over_tls


def test_the_default_setting_is_auto(tmp_path: Path) -> None:
    settings = CoordinatorSettings(pki=tmp_path, state=tmp_path)
    assert settings.metrics_tls == "auto" and settings.metrics_over_tls is False
    assert CoordinatorSettings(pki=tmp_path, state=tmp_path,
                               metrics_listen="0.0.0.0:9464").metrics_over_tls


def test_metrics_tls_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEDFED_COORDINATOR_METRICS_TLS", "true")
    assert CoordinatorSettings(pki=tmp_path, state=tmp_path).metrics_over_tls
    monkeypatch.setenv("MEDFED_COORDINATOR_METRICS_TLS", "sometimes")
    from common.core.config import load_settings

    with pytest.raises(ConfigError, match="metrics_tls"):
        load_settings(CoordinatorSettings, overrides={"pki": tmp_path, "state": tmp_path})


def test_loopback_hosts() -> None:
    assert is_loopback_host("127.0.0.2") and is_loopback_host("[::1]")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("localhost.example.org")


# --------------------------------------------------------------------------- the coordinator


def test_the_coordinator_serves_metrics_to_monitors_only_and_counts_refusals(
    monitor_pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`coordinator.service.start` itself, with metrics_tls = true: a monitor scrapes,
    a site is refused with 403, and that refusal is logged and counted."""
    settings = CoordinatorSettings(
        pki=monitor_pki, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0",
        metrics_tls=True, state=tmp_path / "state", rounds=1, min_sites=3,
    )
    monitor = client_context(monitor_pki / "ca.crt", pki.monitor_paths(monitor_pki, "prometheus"))
    site = client_context(monitor_pki / "ca.crt", pki.site_paths(monitor_pki, "h2"))

    async def scenario() -> None:
        running = await start(settings, model_without_study=flat_model(8))
        try:
            port = running.metrics_port
            assert (await asyncio.to_thread(scrape, port, site))[0] == 403
            status, body = await asyncio.to_thread(scrape, port, monitor)
            assert status == 200
            assert "medfed_coordinator_metrics_scrapes_refused_total 1.0" in body
            # A refused scrape is no gRPC call: it is not counted as one.
            assert 'code="PERMISSION_DENIED"' not in body
        finally:
            await running.stop()

    with caplog.at_level(logging.WARNING, logger="medfed.coordinator.security"):
        asyncio.run(scenario())
    (line,) = [r for r in caplog.records if getattr(r, "event", "") == "call_refused"]
    assert line.method == "/metrics" and "h2" in line.reason


def test_plain_http_beyond_loopback_is_warned_about(
    monitor_pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from coordinator.metrics import CoordinatorMetrics
    from coordinator.refusals import RefusalLog
    from coordinator.service import metrics_tls

    settings = CoordinatorSettings(pki=monitor_pki, state=tmp_path, metrics_tls=False,
                                   metrics_listen="0.0.0.0:9464")
    verifier = pki.PeerVerifier.from_pki_dir(monitor_pki)
    with caplog.at_level(logging.WARNING, logger="medfed.coordinator"):
        assert metrics_tls(settings, verifier,
                           on_refused=RefusalLog(CoordinatorMetrics())) is None
    assert any(getattr(r, "event", "") == "metrics_plain_http" for r in caplog.records)
