"""Selection with real processes over mutual TLS: a site frozen (SIGSTOP) while its
WaitForRound long-poll is open keeps that poll open but stops beating; once silent for
`heartbeat_misses` intervals it is not selected (the coordinator says so), so the next
round opens with the live sites only. Thawed (SIGCONT), it beats again and is selected
for the round after. Waits are on log events and status, never sleeps."""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence

import pytest

from tests.e2e.harness import Federation

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SITES = ["site-a", "site-b", "site-c", "site-d"]
SETTINGS = ("--phase-seconds", "30", "--train-seconds", "30", "--selection-seconds", "10",
            "--model-dim", "2000", "--min-sites", "3", "--rounds", "2",
            "--heartbeat-seconds", "1")



def test_a_site_frozen_in_its_long_poll_is_not_selected(
    monitored_federation: Callable[[Sequence[str]], Federation],
) -> None:
    federation = monitored_federation(SITES)
    coordinator = federation.start_coordinator(*SETTINGS)
    # Two sites wait (min_sites 3: no round opens); site-d freezes in its long-poll.
    federation.start_site("site-a")
    frozen = federation.start_site("site-d")
    federation.until_states(lambda s: s.get("site-a") == s.get("site-d") == "waiting", timeout=60)
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        left_out = coordinator.wait_event("site_silent_not_selected", site="site-d",
                                          timeout=60)
        assert "not selected until it beats again" in str(left_out["msg"])
        federation.start_site("site-b")
        federation.start_site("site-c")
        coordinator.wait_log("round 1 open", timeout=120)
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    first = coordinator.wait_event("round_completed", round_number=1, timeout=120)
    assert first["participants"] == "site-a,site-b,site-c"
    assert first["dropped"] == ""
    # Thawed, it beats again and the next round selects it.
    coordinator.wait_event("site_selectable_again", site="site-d", timeout=60)
    second = coordinator.wait_event("round_completed", round_number=2, timeout=120)
    assert second["participants"] == ",".join(SITES)
    assert federation.assert_exact_sum(2) == SITES
