"""Clear errors, nothing lost, with real processes and sockets: a
gRPC or metrics port already in use, invalid TOML, a site whose TLS handshake can
never succeed; JSON logs stay JSON even when gRPC's C core writes to stderr; the text
log format is for people."""

from __future__ import annotations

import datetime as dt
import json
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.instrumented import instrumented_argv
from common.core.processes import ManagedProcess, medfed_argv
from common.protocol.pki import init_ca, issue_site
from tests.e2e.harness import REPO, Federation, make_pki, transport_site_argv

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    """One PKI for the module (issuing it is the slow part); each test stops the
    coordinator it started."""
    fed = Federation(tmp_path_factory.mktemp("operator-errors"), ["site-a"])
    yield fed
    fed.stop()


def serve_argv(fed: Federation, *extra: str, state: str = "second") -> list[str]:
    return instrumented_argv("coordinator", "serve", "--pki", str(fed.pki),
                             "--state", str(fed.root / state), "--model-dim", "100", *extra)


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120,
                          check=False)


def test_a_second_coordinator_on_the_same_port_fails_clearly(federation: Federation) -> None:
    """gRPC sets SO_REUSEPORT by default: without turning it off a second coordinator
    would bind the same port. Its C core logs the bind failure to fd 2 itself; in the
    JSON format that line arrives as a JSON record like every other line."""
    first = federation.start_coordinator("--model-dim", "100", "--log-format", "text",
                                         exit_when_finished=False)
    listening = first.wait_log("coordinator listening")
    assert "text" in listening  # a plain line for people, not a JSON object
    second = run(serve_argv(federation, "--listen", f"127.0.0.1:{federation.port}",
                            "--metrics-listen", "127.0.0.1:0"))
    assert second.returncode != 0
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line parses
    messages = " ".join(str(r.get("msg", "")) for r in records)
    assert f"127.0.0.1:{federation.port}" in messages and "already in use" in messages
    assert any(r.get("logger") == "grpc.core" for r in records), second.stderr
    assert "Traceback" not in second.stderr
    assert first.alive
    first.stop()
    assert first.proc.returncode == 0


def test_a_busy_metrics_port_fails_clearly(federation: Federation) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run(serve_argv(federation, "--listen", "127.0.0.1:0",
                                "--metrics-listen", f"127.0.0.1:{port}"))
    assert result.returncode != 0
    assert f"127.0.0.1:{port}" in result.stderr and "metrics_listen" in result.stderr
    assert "Traceback" not in result.stderr


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    config = tmp_path / "broken.toml"
    config.write_text('rounds = 3\nlisten = "127.0.0.1:0\n')
    result = run(medfed_argv("coordinator", "serve", "--config", str(config)))
    assert result.returncode == 2
    assert str(config) in result.stderr and "not valid TOML" in result.stderr
    assert "Traceback" not in result.stderr


def _site_failing_tls(fed: Federation, name: str, *, pki: Path,
                      coordinator: str) -> ManagedProcess:
    """site-a of `pki` dialling `coordinator`, giving up after 3 TLS failures."""
    return ManagedProcess(
        f"site-a-{name}",
        transport_site_argv("site", "run", "--pki", str(pki), "--site", "site-a",
                            "--coordinator", coordinator, "--metrics-listen", "127.0.0.1:0",
                            "--state", str(fed.root / f"{name}-site")),
        env={"MEDFED_SITE_RECONNECT__MAX_TLS_FAILURES": "3",
             "MEDFED_SITE_RECONNECT__MAX_BACKOFF_SECONDS": "1"},
        log_dir=fed.logs, cwd=REPO,
    )


def _tls_give_up_text(site: ManagedProcess) -> str:
    """The agent's log text once it stopped (non-zero) after its bounded TLS tries."""
    assert site.wait_exit(timeout=120) != 0
    site.stop()
    text = " ".join(str(line.get("msg", line.get("text", ""))) for line in site.lines)
    assert "TLS handshake" in text and "3 times" in text, site.tail()
    return text


def test_a_site_of_another_ca_gives_up_after_bounded_tries(federation: Federation) -> None:
    """The coordinator presents a certificate our CA did not sign: every handshake
    fails the same way, so the agent stops after max_tls_failures and says why."""
    coordinator = federation.start_coordinator("--model-dim", "100",
                                               exit_when_finished=False)
    other = make_pki(federation.root / "other", ["site-a"])
    site = _site_failing_tls(federation, "other-ca", pki=other,
                             coordinator=f"127.0.0.1:{federation.port}")
    try:
        _tls_give_up_text(site)
    finally:
        site.stop()
        coordinator.stop()


def test_a_host_name_the_coordinator_certificate_lacks_gives_up_naming_its_hosts(
    federation: Federation,
) -> None:
    """The coordinator's certificate holds 127.0.0.1 and localhost; the site dials
    127.0.0.2 (the same machine): every handshake fails gRPC's hostname check, which
    retrying cannot heal, so the agent stops after max_tls_failures naming the hosts."""
    coordinator = federation.start_coordinator("--model-dim", "100", "--listen", "0.0.0.0:0",
                                               exit_when_finished=False)
    site = _site_failing_tls(federation, "wrong-name", pki=federation.pki,
                             coordinator=f"127.0.0.2:{federation.port}")
    try:
        text = _tls_give_up_text(site)
        assert "Hostname Verification" in text, site.tail()
        assert "does not name '127.0.0.2'" in text, site.tail()
        assert "holds localhost, 127.0.0.1" in text, site.tail()
        assert "Traceback" not in text
    finally:
        site.stop()
        coordinator.stop()


def test_an_expired_site_certificate_stops_the_agent_naming_it(federation: Federation) -> None:
    """Checked before any connection: the agent exits at once, naming the file and
    the expiry (a handshake would only say that the peer hung up)."""
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=400)
    pki = federation.root / "old-pki"  # a CA still valid, that issued a 1-day certificate
    init_ca(pki, validity_days=3650, now=long_ago)
    issue_site(pki, "site-old", validity_days=1, now=long_ago)
    result = run(transport_site_argv(
        "site", "run", "--pki", str(pki), "--site", "site-old",
        "--coordinator", "127.0.0.1:9", "--metrics-listen", "127.0.0.1:0",
        "--state", str(federation.root / "old-site"),
    ))
    assert result.returncode != 0
    assert "site-old.crt" in result.stderr and "expired" in result.stderr
    assert "Traceback" not in result.stderr


def _sites_waiting(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("medfed_coordinator_sites_active "):
                return float(line.split()[1])
    return 0.0


def test_a_site_waiting_for_a_round_exits_cleanly_on_sigterm(federation: Federation) -> None:
    """`systemctl stop` / `docker stop` while the coordinator holds the site's wait for
    a round (a long poll of up to 30 s): the site cancels the wait and exits 0, rather
    than sitting it out until the stop gives up and kills it (exit -9)."""
    coordinator = federation.start_coordinator("--model-dim", "100", "--min-sites", "2",
                                               exit_when_finished=False)
    try:
        metrics_port = int(coordinator.wait_event("listening")["metrics_port"])
        site = federation.start_site("site-a")
        site.wait_log("enrolled in federation", timeout=120)
        # The coordinator counts the site as waiting only while its poll is held open.
        waiting = threading.Event()
        while not waiting.is_set() and site.alive:
            if _sites_waiting(metrics_port) >= 1:
                waiting.set()
            else:
                waiting.wait(0.2)
        assert waiting.is_set(), site.tail(20)
        site.stop()
        assert site.proc.returncode == 0, site.tail(20)
    finally:
        coordinator.stop()
