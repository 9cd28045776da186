"""A full disk, a read-only copy and a damaged file are three different things.

Real SQLite files on real filesystems: the read-only copy is a read-only bind mount
(or, when not root, a 0444 file in a 0555 folder), the full disk a small tmpfs
filled with zeros, the damaged file one with its bytes overwritten. Only damage calls
for "move it aside and restore it"; a full disk says so and leaves the ledger intact;
an auditor reads a read-only copy as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from common.core.errors import LedgerUnavailable
from common.privacy.accountant import Segment
from common.privacy.ledger import PrivacyLedger, anchor_path_for, export_ledger, verify_ledger
from tests.privacy.conftest import Pki

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
ROUNDS = 4
TMPFS_BYTES = 256 << 10
RESTORE_ADVICE = ("move it aside", "ledger restore")


def _open(path: Path, pki_material: Pki) -> PrivacyLedger:
    return PrivacyLedger(path, site_id="hospital-a", budget_epsilon=8.0, delta=1e-5,
                         accountant="rdp", privacy_unit="patient",
                         signer=pki_material.signer_a)


def _spend(book: PrivacyLedger, rounds: range) -> None:
    for number in rounds:
        book.reserve(number, [Segment(1.0, 0.01, 100)], now=T0 + timedelta(hours=number))


@pytest.fixture
def ledger(tmp_path: Path, pki_material: Pki) -> Path:
    """A site's ledger (rounds 0..3) with its anchor beside it, as the agent leaves it."""
    path = tmp_path / "state" / "privacy-ledger.db"
    path.parent.mkdir()
    _spend(_open(path, pki_material), range(ROUNDS))
    return path


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here (needs root / CAP_SYS_ADMIN): "
                    f"{done.stderr.strip() or done.returncode}")


@pytest.fixture
def read_only_copy(ledger: Path, tmp_path: Path) -> Iterator[Path]:
    """An auditor's snapshot: the ledger and its anchor in a folder nobody can write."""
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for source in (ledger, anchor_path_for(ledger)):
        shutil.copy2(source, snapshot / source.name)
    if os.geteuid() != 0:
        # chmod is enough when not root; root writes through it, so it gets a mount.
        for copied in snapshot.iterdir():
            copied.chmod(0o444)
        snapshot.chmod(0o555)
        yield snapshot / ledger.name
        snapshot.chmod(0o755)
        return
    view = tmp_path / "auditor"
    view.mkdir()
    _mount("--bind", "-o", "ro", str(snapshot), str(view))
    try:
        if os.access(view, os.W_OK):
            pytest.skip(f"the bind mount {view} came up writable")
        yield view / ledger.name
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "small-disk"
    folder.mkdir()
    _mount("-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", str(folder))
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> Path:
    """Write zeros until the filesystem refuses with ENOSPC; returns the filler file."""
    filler = folder / "filler"
    with (open(filler, "wb", buffering=0) as handle,
          pytest.raises(OSError, match="No space left")):
        while True:
            handle.write(b"\0" * 4096)
    return filler


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "common.commands.privacy", "ledger", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_show_and_verify_read_an_intact_read_only_copy(read_only_copy: Path) -> None:
    shown = cli("show", "--json", "--ledger", str(read_only_copy))
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert report["integrity"]["ok"] is True, report["integrity"]
    assert len(report["entries"]) == ROUNDS
    verified = cli("verify", "--ledger", str(read_only_copy))
    assert verified.returncode == 0, verified.stderr
    assert f"OK ({ROUNDS} entries" in verified.stdout
    assert len(export_ledger(read_only_copy).entries) == ROUNDS
    # Nothing was written beside it (no -wal / -shm in the read-only folder).
    assert sorted(p.name for p in read_only_copy.parent.iterdir()) == sorted(
        [read_only_copy.name, anchor_path_for(read_only_copy).name])


def test_a_site_on_a_read_only_copy_is_told_read_only_not_damaged(
    read_only_copy: Path, pki_material: Pki
) -> None:
    with pytest.raises(LedgerUnavailable) as refused:
        _open(read_only_copy, pki_material)
    message = str(refused.value)
    assert "read-only" in message
    assert not any(advice in message for advice in RESTORE_ADVICE), message


def test_a_full_disk_is_reported_as_disk_full_and_the_ledger_stays_intact(
    ledger: Path, small_disk: Path, pki_material: Pki
) -> None:
    path = small_disk / ledger.name
    for source in (ledger, anchor_path_for(ledger)):
        shutil.copy2(source, small_disk / source.name)
    book = _open(path, pki_material)
    filler = fill(small_disk)
    with pytest.raises(LedgerUnavailable) as refused:
        _spend(book, range(ROUNDS, ROUNDS + 1))
    message = str(refused.value)
    assert message.startswith(f"disk full at {small_disk}"), message
    assert "intact" in message
    assert not any(advice in message for advice in RESTORE_ADVICE), message
    filler.unlink()
    report = verify_ledger(path, anchor_path=anchor_path_for(path))
    assert report.ok and report.entries_checked == ROUNDS, report.problems
    _spend(book, range(ROUNDS, ROUNDS + 1))  # space freed: the site records again
    assert len(book.entries()) == ROUNDS + 1


@pytest.mark.parametrize(("offset", "what"), [(0, "its SQLite header"),
                                              (4096, "a page inside")])
def test_a_corrupted_file_keeps_the_move_aside_and_restore_advice(
    ledger: Path, offset: int, what: str
) -> None:
    with open(ledger, "r+b") as handle:
        handle.seek(offset)
        handle.write(b"\xa5" * 4096)
    verified = cli("verify", "--ledger", str(ledger))
    assert verified.returncode != 0, f"{what}: {verified.stdout}"
    assert "move it aside" in verified.stderr, f"{what}: {verified.stderr}"
    assert "disk full" not in verified.stderr and "read-only" not in verified.stderr
