"""A study's life as operators see it, with real processes over
mutual TLS: `medfed status` with a monitor certificate during and after a study, a
finished study that is not an outage (the coordinator stays up, Health SERVING, the
finished metric set, sites told "finished"), and who may call status."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.commands.status import fetch_status
from common.protocol.tls import TlsFiles, channel_credentials_from_files
from tests.e2e.conftest import process_tails
from tests.e2e.harness import REPO, Federation, run_medfed

# One federation for the module (one worker under xdist): who may ask for status is
# asked of the coordinator before its study starts, then the study runs.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240),
              pytest.mark.xdist_group("study_lifecycle")]

SITES = ["site-a", "site-b", "site-c"]
SETTINGS = ("--phase-seconds", "60", "--train-seconds", "20", "--selection-seconds", "0.5",
            "--model-dim", "2000", "--min-sites", "3", "--rounds", "1")


@pytest.fixture(scope="module")
def federation(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Federation]:
    """The coordinator of a one-round study that stays up when it is finished, its PKI
    holding an `ops` monitor certificate; no site started yet. Everything started is
    stopped at the end, after printing the end of each process's output if a test of
    the module failed."""
    fed = Federation(tmp_path_factory.mktemp("lifecycle"), SITES)
    failed = request.session.testsfailed
    try:
        run_medfed("pki", "issue", "--dir", str(fed.pki), "--monitor", "ops")
        fed.start_coordinator(*SETTINGS, exit_when_finished=False)
        yield fed
    finally:
        started = fed.processes()
        if request.session.testsfailed > failed and started:
            print("\nprocess output at the failure:\n" + process_tails(started))
        fed.stop()


def status_cli(fed: Federation, *args: str, cert: Path, key: Path
               ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "common.commands.status", "status",
         "--coordinator", f"127.0.0.1:{fed.port}", "--tls-ca", str(fed.pki / "ca.crt"),
         "--tls-cert", str(cert), "--tls-key", str(key), *args],
        capture_output=True, text=True, cwd=REPO, check=False,
    )


def monitor_files(fed: Federation) -> TlsFiles:
    return TlsFiles.for_monitor(fed.pki, "ops")


def status(fed: Federation) -> dict[str, object]:
    files = monitor_files(fed)
    return fetch_status(f"127.0.0.1:{fed.port}", ca=files.ca, cert=files.cert, key=files.key,
                        timeout=10)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def test_only_monitor_certificates_may_ask_for_status(federation: Federation) -> None:
    """A site certificate is refused (the status names every hospital and its budget),
    and so is the coordinator's own (server-only) certificate. Asked before the study
    starts (the next test asks for status during and after it)."""
    pki = federation.pki
    site = status_cli(federation, cert=pki / "sites" / "site-a.crt",
                      key=pki / "sites" / "site-a.key")
    assert site.returncode != 0
    assert "monitor certificate" in site.stderr
    server = status_cli(federation, cert=pki / "coordinator.crt", key=pki / "coordinator.key")
    assert server.returncode != 0
    assert "Traceback" not in server.stderr and "medfed: error" in server.stderr


def test_status_during_and_after_a_study_that_stays_up(federation: Federation) -> None:
    coordinator = federation.coordinator
    assert coordinator is not None
    metrics_port = int(coordinator.wait_event("listening")["metrics_port"])

    before = status(federation)
    assert before["phase"] == "selecting" and before["current_round"] == 0
    assert before["completed_rounds"] == 0 and not before["finished"]
    assert before["eta_seconds"] is None  # no completed round to estimate from
    assert "medfed_coordinator_study_finished 0.0" in scrape(metrics_port)

    # site-c stops for 10 s after its round-1 keys are advertised: the round is then in
    # flight, waiting in share_keys for it (the phase deadline is 60 s), when status is
    # asked (one call, right after the pause is seen); then it goes on and the round
    # completes.
    federation.start_site("site-a")
    federation.start_site("site-b")
    paused = federation.start_site("site-c", "--debug-pause-after", "1:advertise_keys",
                                   "--debug-pause-seconds", "10")
    paused.wait_event("paused", timeout=120)
    during = status(federation)
    assert during["current_round"] == 1 and during["phase"] == "share_keys"
    states = {s["site_id"]: s["state"] for s in during["sites"]}  # type: ignore[attr-defined]
    assert states == {site: "in_round" for site in SITES}
    for site in during["sites"]:  # type: ignore[attr-defined]
        assert site["last_contact_seconds_ago"] is not None
        assert site["epsilon_budget"] == 0  # the deterministic double: no DP ledger

    coordinator.wait_log("all 1 rounds done", timeout=180)
    # Sites hear "finished" and exit 0 while the coordinator stays up.
    for site in SITES:
        assert federation.site_procs[site].wait_exit(timeout=90) == 0
    assert coordinator.alive

    after = status(federation)
    assert after["finished"] and after["phase"] == "finished"
    assert after["completed_rounds"] == after["total_rounds"] >= 1
    assert after["eta_seconds"] == 0
    assert "medfed_coordinator_study_finished 1.0" in scrape(metrics_port)
    files = monitor_files(federation)
    with grpc.secure_channel(f"127.0.0.1:{federation.port}",
                             channel_credentials_from_files(files)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING

    text = status_cli(federation, cert=files.cert, key=files.key)
    assert text.returncode == 0, text.stderr
    assert "study finished" in text.stdout and "site-a" in text.stdout
    as_json = status_cli(federation, "--json", cert=files.cert, key=files.key)
    assert json.loads(as_json.stdout.strip().splitlines()[-1])["finished"] is True

    coordinator.stop()
    assert coordinator.proc.returncode == 0
