"""Liveness during training, with real processes over mTLS: a site
that stops answering while it trains holds the round a few heartbeats, not until
`train_seconds` passes. Each test stops one of five sites once it logs that it is
training, and checks that the round completed without it within 3 heartbeat intervals
(plus stated slack) after the last live upload, on the coordinator's log timestamps.
A link taken down is tested in tests/network/test_liveness_netns.py."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import Federation
from tests.e2e.liveness import assert_liveness_bound

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SITES = ["site-a", "site-b", "site-c", "site-d", "site-e"]
HEARTBEAT_SECONDS = 2.0
# train_seconds is far beyond the bound: without heartbeats the round would wait ~120 s.
LIVENESS = ("--phase-seconds", "30", "--train-seconds", "120", "--selection-seconds", "0.5",
            "--model-dim", "5000", "--min-sites", "5", "--rounds", "1",
            "--heartbeat-seconds", str(HEARTBEAT_SECONDS))
# Every site "trains" for a few seconds (bench.transport_site's double): the window in
# which the test stops one of them.
TRAINING = {"MEDFED_TRANSPORT_TRAIN_SECONDS": "3"}


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[Federation]:
    fed = Federation(tmp_path, SITES, env=TRAINING)
    yield fed
    fed.stop()


def start_and_wait_for_training(federation: Federation, victim: str) -> None:
    federation.start_coordinator(*LIVENESS)
    for site in SITES:
        federation.start_site(site)
    federation.site_procs[victim].wait_event("training_started", round_number=1, timeout=300)


def test_a_site_frozen_mid_training_is_dropped_after_missed_heartbeats(
    federation: Federation,
) -> None:
    start_and_wait_for_training(federation, "site-c")
    frozen = federation.site_procs["site-c"]
    frozen.proc.send_signal(signal.SIGSTOP)  # alive, connections open, silent
    try:
        assert federation.coordinator is not None
        assert_liveness_bound(federation.coordinator, round_number=1, gone="site-c",
                              interval=HEARTBEAT_SECONDS)
        survivors = federation.assert_exact_sum(1)
        assert survivors == ["site-a", "site-b", "site-d", "site-e"]
    finally:
        frozen.proc.send_signal(signal.SIGCONT)


def test_a_site_killed_mid_training_is_dropped_after_missed_heartbeats(
    federation: Federation,
) -> None:
    start_and_wait_for_training(federation, "site-d")
    # No RPC of site-d is in flight while it trains: nothing resets on the coordinator's
    # side, so only the missing heartbeats tell it the site is gone.
    federation.site_procs["site-d"].kill9()
    assert federation.coordinator is not None
    assert_liveness_bound(federation.coordinator, round_number=1, gone="site-d",
                          interval=HEARTBEAT_SECONDS)
    assert federation.assert_exact_sum(1) == ["site-a", "site-b", "site-c", "site-e"]


def test_a_site_frozen_mid_upload_is_dropped_and_a_slow_uploader_kept(
    federation: Federation,
) -> None:
    """Liveness holds while a masked input streams: site-c stops mid-upload (after its
    first chunk) and is then frozen, so its stream stays open but it beats no more;
    site-e stalls mid-upload for 2.5 silence limits while its heartbeats go on, then
    finishes. site-c is dropped within the heartbeat bound (not after
    `upload_idle_seconds`), site-e's input is in the sum."""
    federation.start_coordinator(*LIVENESS)
    for site in ("site-a", "site-b", "site-d"):
        federation.start_site(site)
    frozen = federation.start_site("site-c", "--debug-pause-after", "1:upload")
    slow_pause = 2.5 * HEARTBEAT_SECONDS * 3
    slow = federation.start_site("site-e", "--debug-pause-after", "1:upload",
                                 "--debug-pause-seconds", str(slow_pause))
    frozen.wait_event("paused", round=1, phase="upload", timeout=300)
    frozen.proc.send_signal(signal.SIGSTOP)  # its upload stream stays open, silent
    try:
        slow.wait_event("paused", round=1, phase="upload", timeout=300)
        assert federation.coordinator is not None
        assert_liveness_bound(federation.coordinator, round_number=1, gone="site-c",
                              interval=HEARTBEAT_SECONDS)
        assert federation.assert_exact_sum(1) == ["site-a", "site-b", "site-d", "site-e"]
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
