"""End-to-end: a coordinator whose storage fails mid-study.

Real processes over mTLS, as in test_federation_processes.py. The coordinator's state
folder is a small tmpfs mounted inside the test, so "disk full" is a real full
filesystem; the database error is a real SQLite lock held by another connection.
In both cases the coordinator must exit non-zero naming the cause, the sites must not
be told "finished" (they keep retrying), and a coordinator restarted on the same state
must resume the study with the sites rejoining.
"""

from __future__ import annotations

import errno
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.core.processes import ManagedProcess
from tests.e2e.harness import Federation
from tests.e2e.test_federation_processes import FAST, SITES, round_statuses

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TMPFS_BYTES = 8 << 20


def _mount_tmpfs(folder: Path) -> None:
    folder.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", str(folder)],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): "
                    f"{done.stderr.strip() or done.returncode}")


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[Federation]:
    state = tmp_path / "coordinator"  # the harness's coordinator state folder
    _mount_tmpfs(state)
    fed: Federation | None = None
    try:
        fed = Federation(tmp_path, SITES)
        yield fed
    finally:
        if fed is not None:
            fed.stop()
        subprocess.run(["umount", "-l", str(state)], check=False)


def fill(folder: Path) -> Path:
    """Write zeros until the filesystem refuses with ENOSPC; returns the filler file."""
    filler = folder / "filler"
    block = b"\0" * (64 << 10)
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(block)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return filler


def start_with_round_2_held(fed: Federation) -> tuple[ManagedProcess, int]:
    """Coordinator and 5 sites; returns once round 1 completed and round 2 is open,
    held by site-a pausing after its AdvertiseKeys."""
    coordinator = fed.start_coordinator(*FAST, "--rounds", "3")
    # Sites retry a lost coordinator with backoff capped at 2 s (30 s by default): they
    # rejoin the restarted one within seconds instead of after up to 30 s of jitter.
    config = fed.root / "site.toml"
    config.write_text("[reconnect]\nmax_backoff_seconds = 2.0\n")
    for site in SITES[1:]:
        fed.start_site(site, "--config", str(config))
    paused = fed.start_site(
        "site-a", "--config", str(config),
        "--debug-pause-after", "2:advertise_keys", "--debug-pause-seconds", "2"
    )
    coordinator.wait_log("round 1 completed", timeout=120)
    paused.wait_event("paused", round=2, phase="advertise_keys", timeout=120)
    return coordinator, fed.port


def expect_failure_then_resume(fed: Federation, coordinator: ManagedProcess, port: int,
                               causes: tuple[str, ...], *, repair: object) -> None:
    code = coordinator.wait_exit(timeout=120)
    assert code != 0, "a failed engine must not exit 0"
    failure = coordinator.wait_log("round engine failed", timeout=10)
    text = str(failure.get("msg", failure.get("text", "")))
    assert any(cause in text for cause in causes), text
    # The sites were not told "finished": each is still running and retrying.
    for site in SITES:
        proc = fed.site_procs[site]
        proc.wait_log("connection problem", timeout=60)
        assert proc.alive, f"{site} exited ({proc.proc.returncode}) after the failure"
        assert not any("federation finished" in str(line.get("msg", "")) for line in proc.lines)
    if callable(repair):
        repair()
    restarted = fed.start_coordinator(*FAST, "--rounds", "3", port=port)
    restarted.wait_log("round 2 was", timeout=60)  # abandoned, reported at recovery
    restarted.wait_log("all 3 rounds done", timeout=180)
    statuses = round_statuses(fed)
    assert statuses[2] == "abandoned"
    assert [n for n, s in sorted(statuses.items()) if s == "completed"] == [1, 3, 4]
    for round_number in (1, 3, 4):
        assert fed.assert_exact_sum(round_number) == SITES  # every site rejoined
    for site in SITES:
        assert fed.site_procs[site].wait_exit(timeout=60) == 0  # finished, for real


def test_full_disk_fails_loudly_and_the_restarted_coordinator_resumes(
    federation: Federation,
) -> None:
    coordinator, port = start_with_round_2_held(federation)
    filler = fill(federation.root / "coordinator")
    expect_failure_then_resume(
        federation, coordinator, port,
        ("No space left on device", "database or disk is full"),
        repair=filler.unlink,  # free the space
    )


def test_database_error_fails_loudly_and_nothing_is_lost(federation: Federation) -> None:
    coordinator, port = start_with_round_2_held(federation)
    # Another connection holds the write lock: the coordinator's next write (marking
    # round 2) fails with SQLite's own error once its busy timeout passes.
    holder = sqlite3.connect(federation.root / "coordinator" / "coordinator.db",
                             isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        expect_failure_then_resume(
            federation, coordinator, port, ("database is locked",), repair=holder.rollback
        )
    finally:
        holder.close()
