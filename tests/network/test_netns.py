"""One secure round across network namespaces: the coordinator in
one namespace, three site agents in three others, real processes, mTLS over veth links.

Topology, all of it inside namespaces this test creates (nothing is added to the host's
namespace, so test traffic cannot leave the machine)::

    site ns i: eth0 10.213.77.(10+i)/24 --veth-- vc<i> (bridge br0 10.213.77.1/24): coordinator ns

Each site's uplink is rate-limited with `tc tbf`. Delay and loss (`tc netem`) would
be the better impairment, but sch_netem is not available on this machine; tbf is, and
the test only relies on it when `tc` accepts it.

Skipped unless running as root with a working `ip netns add`. Namespaces are deleted in
the fixture's teardown, also on failure.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from bench.instrumented import instrumented_argv
from common.core.processes import ManagedProcess
from common.protocol import pki
from tests.e2e.harness import REPO, transport_site_argv
from tests.network.conftest import read_aggregate, ring_sum

pytestmark = pytest.mark.timeout(120)

SITES = ("site-a", "site-b", "site-c")
SUBNET = "10.213.77"
COORDINATOR_IP = f"{SUBNET}.1"
MODEL_DIM = 5000
UPLINK_RATE = "50mbit"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", *args], check=check, capture_output=True, text=True
    )


def in_ns(namespace: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, *argv]


def netns_usable() -> bool:
    """Root, iproute2, and the kernel lets us create a namespace."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"mfprobe{os.getpid()}"
    if ip("netns", "add", probe, check=False).returncode != 0:
        return False
    ip("netns", "del", probe, check=False)
    return True


@dataclass(frozen=True)
class Topology:
    coordinator_ns: str
    site_ns: dict[str, str]
    site_ip: dict[str, str]
    shaped: bool  # True when every site uplink has a tbf qdisc


@contextlib.contextmanager
def build_topology(sites: Sequence[str]) -> Iterator[Topology]:
    """The namespaces, bridge and shaped veth links above for `sites` (deleted on
    exit, also on failure). Skips the test unless namespaces can be created."""
    if not netns_usable():
        pytest.skip("needs root and a working `ip netns add`")
    tag = str(os.getpid() % 100_000)  # names unique per test process
    coordinator_ns = f"mfc{tag}"
    site_ns = {site: f"mfs{tag}-{i}" for i, site in enumerate(sites)}
    site_ip = {site: f"{SUBNET}.{10 + i}" for i, site in enumerate(sites)}
    created: list[str] = []
    try:
        for namespace in (coordinator_ns, *site_ns.values()):
            ip("netns", "add", namespace)
            created.append(namespace)
            ip("-n", namespace, "link", "set", "lo", "up")
        ip("-n", coordinator_ns, "link", "add", "br0", "type", "bridge")
        ip("-n", coordinator_ns, "addr", "add", f"{COORDINATOR_IP}/24", "dev", "br0")
        ip("-n", coordinator_ns, "link", "set", "br0", "up")
        shaped = True
        for i, site in enumerate(sites):
            port = f"vc{i}"
            # Created in the coordinator's namespace with its peer in the site's: the
            # host namespace never sees either end.
            ip("-n", coordinator_ns, "link", "add", port, "type", "veth",
               "peer", "name", "eth0", "netns", site_ns[site])
            ip("-n", coordinator_ns, "link", "set", port, "master", "br0")
            ip("-n", coordinator_ns, "link", "set", port, "up")
            ip("-n", site_ns[site], "addr", "add", f"{site_ip[site]}/24", "dev", "eth0")
            ip("-n", site_ns[site], "link", "set", "eth0", "up")
            tbf = subprocess.run(
                in_ns(site_ns[site], "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                      "rate", UPLINK_RATE, "burst", "64kb", "latency", "200ms"),
                check=False, capture_output=True,
            )
            shaped = shaped and tbf.returncode == 0
        yield Topology(coordinator_ns, site_ns, site_ip, shaped)
    finally:
        # Deleting a namespace removes the veths and the bridge inside it.
        for namespace in reversed(created):
            ip("netns", "del", namespace, check=False)


@pytest.fixture
def topology() -> Iterator[Topology]:
    with build_topology(SITES) as built:
        yield built


def uplink_bytes_sent(namespace: str) -> int:
    """Bytes the site's tbf qdisc let through (its upload direction)."""
    shown = subprocess.run(
        in_ns(namespace, "tc", "-s", "qdisc", "show", "dev", "eth0"),
        check=True, capture_output=True, text=True,
    ).stdout
    match = re.search(r"qdisc tbf .*?Sent (\d+) bytes", shown, re.DOTALL)
    if match is None:
        raise AssertionError(f"no tbf statistics in: {shown}")
    return int(match.group(1))


def make_pki(root: Path, sites: Sequence[str]) -> Path:
    """The coordinator certificate names its namespace IP (and nothing else): ROOT/pki as
    `medfed pki init` and `medfed pki issue --coordinator IP / --site SITE` write it,
    through the same library calls in this process (the commands themselves run in
    tests/pki/test_pki_cli.py and the README tests)."""
    pki_dir = root / "pki"
    pki.init_ca(pki_dir)
    now = dt.datetime.now(dt.UTC)
    pki.issue_coordinator(pki_dir, [COORDINATOR_IP], now=now)
    for site in sites:
        pki.issue_site(pki_dir, site, now=now)
    return pki_dir


def test_secure_round_between_network_namespaces(topology: Topology, tmp_path: Path) -> None:
    pki_dir = make_pki(tmp_path, SITES)
    logs = tmp_path / "logs"
    processes: list[ManagedProcess] = []
    try:
        coordinator = ManagedProcess(
            "coordinator",
            in_ns(topology.coordinator_ns, *instrumented_argv(
                "coordinator", "serve", "--pki", str(pki_dir),
                "--listen", f"{COORDINATOR_IP}:0", "--metrics-listen", "127.0.0.1:0",
                "--state", str(tmp_path / "coordinator"), "--debug-write-aggregates",
                "--exit-when-finished", "--linger-seconds", "3", "--rounds", "1",
                "--min-sites", str(len(SITES)),
                "--model-dim", str(MODEL_DIM), "--phase-seconds", "10",
                "--train-seconds", "30", "--selection-seconds", "0.5",
            )),
            log_dir=logs, cwd=REPO,
        )
        processes.append(coordinator)
        port = int(coordinator.wait_event("listening", timeout=60)["port"])
        for site in SITES:
            processes.append(ManagedProcess(
                site,
                in_ns(topology.site_ns[site], *transport_site_argv(
                    "site", "run", "--pki", str(pki_dir), "--site", site,
                    "--coordinator", f"{COORDINATOR_IP}:{port}",
                    "--metrics-listen", "127.0.0.1:0", "--state", str(tmp_path / "sites" / site),
                    "--debug-write-updates",
                )),
                log_dir=logs, cwd=REPO,
            ))
        coordinator.wait_log("all 1 rounds done", timeout=90)
        for proc in processes[1:]:
            assert proc.wait_exit(timeout=30) == 0, proc.tail()
        # serve() lingers, then RunningCoordinator.stop() closes gRPC, exporter, store.
        assert coordinator.wait_exit(timeout=30) == 0, coordinator.tail()
    finally:
        for proc in processes:
            proc.stop()

    aggregate, survivors = read_aggregate(tmp_path / "coordinator", 1)
    assert survivors == SITES
    updates = [
        np.fromfile(tmp_path / "sites" / s / "debug-updates" / "round-000001.u32", dtype="<u4")
        for s in SITES
    ]
    assert np.array_equal(aggregate, ring_sum(updates))
    if topology.shaped:
        # Every site's masked vector (4 bytes per element) went out through its shaped
        # uplink, i.e. over the namespace link, not some other path.
        for site in SITES:
            assert uplink_bytes_sent(topology.site_ns[site]) > 4 * MODEL_DIM
