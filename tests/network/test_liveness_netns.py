"""Liveness when a site's network link goes down while it trains or mid-upload:
the coordinator and four site agents in their own network namespaces (the topology of
test_netns.py), real processes over mTLS. Once the victim logs that it is training (or
has paused its upload stream after the first chunk, its heartbeats going on), its link
is taken down (`ip link set eth0 down` in its namespace): no reset reaches the
coordinator, only silence. The round completes without it within 3 heartbeat intervals
(plus stated slack) after the last live upload, on the coordinator's log timestamps.

Skipped unless running as root with a working `ip netns add`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.instrumented import instrumented_argv
from common.core.processes import ManagedProcess
from tests.e2e.harness import REPO, transport_site_argv
from tests.e2e.liveness import assert_liveness_bound
from tests.network.conftest import read_aggregate, ring_sum
from tests.network.test_netns import COORDINATOR_IP, build_topology, in_ns, ip, make_pki

pytestmark = pytest.mark.timeout(600)

SITES = ("site-a", "site-b", "site-c", "site-d")
VICTIM = "site-b"
HEARTBEAT_SECONDS = 2.0
# Every site "trains" for a few seconds (the deterministic double of
# bench.transport_site): the window in which its link goes down.
SITE_ENV = {"MEDFED_TRANSPORT_TRAIN_SECONDS": "3"}


@pytest.mark.parametrize("moment", ["training", "upload"])
def test_a_site_whose_link_goes_down_mid_round_is_dropped(tmp_path: Path, moment: str) -> None:
    """`upload`: the victim's stream is open on the coordinator when its link goes down;
    it is dropped on missed heartbeats, not after `upload_idle_seconds`."""
    victim_args = ("--debug-pause-after", "1:upload") if moment == "upload" else ()
    with build_topology(SITES) as topology:
        pki_dir = make_pki(tmp_path, SITES)
        logs = tmp_path / "logs"
        processes: dict[str, ManagedProcess] = {}
        try:
            coordinator = ManagedProcess(
                "coordinator",
                in_ns(topology.coordinator_ns, *instrumented_argv(
                    "coordinator", "serve", "--pki", str(pki_dir),
                    "--listen", f"{COORDINATOR_IP}:0", "--metrics-listen", "127.0.0.1:0",
                    "--state", str(tmp_path / "coordinator"), "--debug-write-aggregates",
                    "--linger-seconds", "3", "--rounds", "1", "--min-sites", str(len(SITES)),
                    "--model-dim", "5000", "--phase-seconds", "30",
                    # Far beyond the bound: without heartbeats the round would wait ~120 s.
                    "--train-seconds", "120", "--selection-seconds", "0.5",
                    "--heartbeat-seconds", str(HEARTBEAT_SECONDS),
                )),
                log_dir=logs, cwd=REPO,
            )
            processes["coordinator"] = coordinator
            port = int(coordinator.wait_event("listening", timeout=120)["port"])
            for site in SITES:
                processes[site] = ManagedProcess(
                    site,
                    in_ns(topology.site_ns[site], *transport_site_argv(
                        "site", "run", "--pki", str(pki_dir), "--site", site,
                        "--coordinator", f"{COORDINATOR_IP}:{port}",
                        "--metrics-listen", "127.0.0.1:0",
                        "--state", str(tmp_path / "sites" / site),
                        "--debug-write-updates",
                        *(victim_args if site == VICTIM else ()),
                    )),
                    env=SITE_ENV, log_dir=logs, cwd=REPO,
                )
            if moment == "upload":
                processes[VICTIM].wait_event("paused", round=1, phase="upload", timeout=300)
            else:
                processes[VICTIM].wait_event("training_started", round_number=1, timeout=300)
            ip("-n", topology.site_ns[VICTIM], "link", "set", "eth0", "down")
            completed = assert_liveness_bound(coordinator, round_number=1, gone=VICTIM,
                                              interval=HEARTBEAT_SECONDS)
            assert completed["survivors"] == ",".join(s for s in SITES if s != VICTIM)
        finally:
            for proc in processes.values():
                proc.stop()

    aggregate, survivors = read_aggregate(tmp_path / "coordinator", 1)
    assert survivors == tuple(s for s in SITES if s != VICTIM)
    updates = [
        np.fromfile(tmp_path / "sites" / s / "debug-updates" / "round-000001.u32", dtype="<u4")
        for s in survivors
    ]
    assert np.array_equal(aggregate, ring_sum(updates))

