"""`medfed status` between rounds, with real processes over mutual TLS: a site frozen
(SIGSTOP) while its WaitForRound long-poll is open stops beating and is shown `silent`
within the heartbeat window while the live sites stay `waiting`; thawed (SIGCONT) it
beats again, is `waiting`, and takes part in the next round. Status is polled until a
deadline, never slept on."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.status_cli import fetch_status
from common.tls import MonitorTlsFiles
from tests.e2e.harness import Federation, run_medfed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SITES = ["site-a", "site-b", "site-c", "site-d"]
HEARTBEAT_SECONDS = 2.0
SETTINGS = ("--phase-seconds", "30", "--train-seconds", "30", "--selection-seconds", "0.5",
            "--model-dim", "2000", "--min-sites", "4", "--rounds", "2",
            "--heartbeat-seconds", str(HEARTBEAT_SECONDS))


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[Federation]:
    fed = Federation(tmp_path, SITES)
    run_medfed("pki", "issue", "--dir", str(fed.pki), "--monitor", "ops")
    yield fed
    fed.stop()


def site_states(fed: Federation) -> dict[str, str]:
    files = MonitorTlsFiles.from_pki_dir(fed.pki, "ops")
    status = fetch_status(f"127.0.0.1:{fed.port}", ca=files.ca, cert=files.cert,
                          key=files.key, timeout=10)
    return {s["site_id"]: s["state"] for s in status["sites"]}  # type: ignore[attr-defined]


def until(fed: Federation, condition: Callable[[dict[str, str]], bool], *,
          timeout: float) -> dict[str, str]:
    """Ask for status until `condition` holds on the site states, or fail at `timeout`."""
    end = time.monotonic() + timeout
    states = site_states(fed)
    while not condition(states):
        assert time.monotonic() < end, f"status never matched; last: {states}"
        states = site_states(fed)
    return states


def test_a_site_frozen_between_rounds_is_silent_then_waiting_again(
    federation: Federation,
) -> None:
    federation.start_coordinator(*SETTINGS, exit_when_finished=False)
    for site in ("site-a", "site-b", "site-c"):
        federation.start_site(site)
    # site-d leaves after round 1: round 2 (4 sites) cannot open, the others wait.
    federation.start_site("site-d", "--exit-after-rounds", "1")
    federation.site_procs["site-d"].wait_exit(timeout=180)
    live = ("site-a", "site-b", "site-c")
    until(federation, lambda s: all(s[site] == "waiting" for site in live), timeout=60)

    frozen = federation.site_procs["site-c"]
    frozen.proc.send_signal(signal.SIGSTOP)  # its long-poll stays open; it beats no more
    try:
        states = until(federation, lambda s: s["site-c"] == "silent"
                       and s["site-a"] == s["site-b"] == "waiting", timeout=60)
        assert states["site-c"] == "silent"
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    until(federation, lambda s: all(s[site] == "waiting" for site in live), timeout=60)

    # The thawed site is a member like any other: round 2 runs with it.
    federation.start_site("site-d")
    assert federation.coordinator is not None
    federation.coordinator.wait_log("all 2 rounds done", timeout=180)
    assert federation.assert_exact_sum(2) == SITES
