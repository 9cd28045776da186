"""End-to-end: a coordinator and 5 site agents as separate OS processes on 127.0.0.1
with mutual TLS. Every round's unmasked aggregate is compared with
the sum of the surviving sites' plaintext updates (written under test-only flags)."""

from __future__ import annotations

import os
import queue
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import Federation

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SITES = ["site-a", "site-b", "site-c", "site-d", "site-e"]
FAST = ("--phase-seconds", "3", "--train-seconds", "20", "--selection-seconds", "0.5",
        "--model-dim", "5000", "--min-sites", "5")
# Two dropouts among 5 sites need t = 3, i.e. a threat model with no colluding site
# (t > T and 2t > n + T): configured on both sides, since sites check it too.
TOLERATE_TWO = {
    "MEDFED_COORDINATOR_AGGREGATION__MAX_COLLUDING_SITES": "0",
    "MEDFED_SITE_POLICY__MAX_COLLUDING_SITES": "0",
}


@pytest.fixture
def federation(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Federation]:
    env = TOLERATE_TWO if request.node.get_closest_marker("tolerate_two") else {}
    fed = Federation(tmp_path, SITES, env=env)
    yield fed
    fed.stop()


def round_statuses(fed: Federation) -> dict[int, str]:
    with sqlite3.connect(fed.root / "coordinator" / "coordinator.db") as db:
        return dict(db.execute("SELECT round_number, status FROM rounds").fetchall())


def test_three_rounds_without_faults(federation: Federation) -> None:
    coordinator = federation.start_coordinator(*FAST, "--rounds", "3")
    for site in SITES:
        federation.start_site(site)
    coordinator.wait_log("all 3 rounds done", timeout=180)
    for round_number in (1, 2, 3):
        assert federation.assert_exact_sum(round_number) == SITES
    for site in SITES:
        assert federation.site_procs[site].wait_exit(timeout=60) == 0
    assert round_statuses(federation) == {1: "completed", 2: "completed", 3: "completed"}
    # The study's end says whether the model was still improving (from the DP AUCs).
    convergence = coordinator.wait_event("study_convergence")
    assert "still_improving" in convergence and "study convergence:" in str(convergence["msg"])
    # Sites label rounds by the coordinator's round number (what `medfed status` shows
    # in brackets), never as "k of N": they cannot know the study's training round k.
    site = federation.site_procs["site-a"]
    for n in (1, 2, 3):
        done = str(site.wait_event("site_round_done", round_number=n)["msg"])
        assert done.startswith(
            f"round number {n} (training; the study plans 3 training rounds) done:"), done


@pytest.mark.tolerate_two
def test_round_completes_when_one_site_dies_after_masked_input_and_one_before(
    federation: Federation,
) -> None:
    coordinator = federation.start_coordinator(*FAST, "--rounds", "1")
    for site in SITES[:3]:
        federation.start_site(site)
    after_input = federation.start_site("site-d", "--debug-pause-after", "1:masked_input")
    before_input = federation.start_site("site-e", "--debug-pause-after", "1:share_keys")
    before_input.wait_event("paused", phase="share_keys", timeout=120)
    before_input.kill9()  # sent its shares, never its masked input
    after_input.wait_event("paused", phase="masked_input", timeout=120)
    after_input.kill9()  # its masked input is in the sum; it never unmasks
    coordinator.wait_log("round 1 completed", timeout=120)
    survivors = federation.assert_exact_sum(1)
    # site-d's input made it into the sum (its self-mask was removed with the others'
    # shares); site-e's pairwise masks were removed via its reconstructed key.
    assert survivors == ["site-a", "site-b", "site-c", "site-d"]


def test_next_round_completes_after_coordinator_is_killed_mid_round(
    federation: Federation,
) -> None:
    coordinator = federation.start_coordinator(*FAST, "--rounds", "3")
    for site in SITES[1:]:
        federation.start_site(site)
    # site-a holds round 2 open after its AdvertiseKeys: the coordinator dies mid-round.
    paused = federation.start_site(
        "site-a", "--debug-pause-after", "2:advertise_keys", "--debug-pause-seconds", "2"
    )
    coordinator.wait_log("round 1 completed", timeout=120)
    paused.wait_event("paused", round=2, phase="advertise_keys", timeout=120)
    port = federation.port
    coordinator.kill9()
    restarted = federation.start_coordinator(*FAST, "--rounds", "3", port=port)
    restarted.wait_log("round 2 was in flight at a crash: abandoned", timeout=60)
    restarted.wait_log("all 3 rounds done", timeout=180)
    statuses = round_statuses(federation)
    assert statuses[2] == "abandoned"
    assert [n for n, s in sorted(statuses.items()) if s == "completed"] == [1, 3, 4]
    assert not federation.has_aggregate(2)  # nothing was unmasked from the abandoned round
    for round_number in (1, 3, 4):
        assert federation.assert_exact_sum(round_number) == SITES
    # The third training round is round number 4: a site says so, not "round 4 of 3".
    last = federation.site_procs["site-b"].wait_event("site_round_done", round_number=4)
    assert str(last["msg"]).startswith(
        "round number 4 (training; the study plans 3 training rounds) done:"), last


def test_no_site_logs_done_when_the_coordinator_dies_between_the_sum_and_its_record(
    federation: Federation,
) -> None:
    """Round 2's debug aggregate file is a pipe nobody reads: the coordinator blocks
    writing it after Unmask closed (every share in, the sum computed) and before the
    round is recorded. Held there until every site's Unmask call ran out of time (a
    coordinator that answered on the share alone would have had that long to answer),
    then killed: no site reports round 2 as done, the restarted coordinator records it
    abandoned, and round 3 is done everywhere."""
    aggregates = federation.root / "coordinator" / "aggregates"
    aggregates.mkdir(parents=True)
    pipe = aggregates / "round-000002.u32"
    os.mkfifo(pipe)
    # More than a pipe's buffer (64 KiB): the write blocks while nobody reads.
    args = (*FAST, "--model-dim", "50000", "--rounds", "2")
    coordinator = federation.start_coordinator(*args)
    for site in SITES:
        federation.start_site(site)
    opened: queue.Queue[int] = queue.Queue()
    # Returns once the coordinator opened the pipe to write round 2's sum.
    threading.Thread(target=lambda: opened.put(os.open(pipe, os.O_RDONLY)),
                     daemon=True).start()
    reader = opened.get(timeout=180)
    try:
        for site in SITES:
            federation.site_procs[site].wait_event(
                "round_unconfirmed", round_number=2, code="DEADLINE_EXCEEDED", timeout=120)
        port = federation.port
        coordinator.kill9()
    finally:
        os.close(reader)
    restarted = federation.start_coordinator(*args, port=port)
    restarted.wait_log(
        "round 2 was abandoned at a crash after its sum was or may have been unmasked",
        timeout=60)
    restarted.wait_log("all 2 rounds done", timeout=180)
    assert round_statuses(federation) == {1: "completed", 2: "abandoned", 3: "completed"}
    for site in SITES:
        proc = federation.site_procs[site]
        assert proc.wait_exit(timeout=60) == 0
        done = [line["round_number"] for line in proc.lines
                if line.get("event") == "site_round_done"]
        assert done == [1, 3], (site, done)
