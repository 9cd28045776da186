"""`medfed status` between rounds, with real processes over mutual TLS: a site frozen
(SIGSTOP) while its WaitForRound long-poll is open stops beating and is shown `silent`
within the heartbeat window while the live sites stay `waiting`; thawed (SIGCONT) it
beats again, is `waiting`, and takes part in the next round. Status is polled until a
deadline, never slept on."""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence

import pytest

from tests.e2e.harness import Federation

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SITES = ["site-a", "site-b", "site-c", "site-d"]
HEARTBEAT_SECONDS = 2.0
SETTINGS = ("--phase-seconds", "30", "--train-seconds", "30", "--selection-seconds", "0.5",
            "--model-dim", "2000", "--min-sites", "4", "--rounds", "2",
            "--heartbeat-seconds", str(HEARTBEAT_SECONDS))



def test_a_site_frozen_between_rounds_is_silent_then_waiting_again(
    monitored_federation: Callable[[Sequence[str]], Federation],
) -> None:
    federation = monitored_federation(SITES)
    federation.start_coordinator(*SETTINGS, exit_when_finished=False)
    for site in ("site-a", "site-b", "site-c"):
        federation.start_site(site)
    # site-d leaves after round 1: round 2 (4 sites) cannot open, the others wait.
    federation.start_site("site-d", "--exit-after-rounds", "1")
    federation.site_procs["site-d"].wait_exit(timeout=180)
    live = ("site-a", "site-b", "site-c")
    federation.until_states(lambda s: all(s[site] == "waiting" for site in live), timeout=60)

    frozen = federation.site_procs["site-c"]
    frozen.proc.send_signal(signal.SIGSTOP)  # its long-poll stays open; it beats no more
    try:
        states = federation.until_states(
            lambda s: s["site-c"] == "silent" and s["site-a"] == s["site-b"] == "waiting",
            timeout=60)
        assert states["site-c"] == "silent"
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    federation.until_states(lambda s: all(s[site] == "waiting" for site in live), timeout=60)

    # The thawed site is a member like any other: round 2 runs with it.
    federation.start_site("site-d")
    assert federation.coordinator is not None
    federation.coordinator.wait_log("all 2 rounds done", timeout=180)
    assert federation.assert_exact_sum(2) == SITES
