"""A ledger no one can quietly reset: the anchor, explicit restore, and one clear error
for every ledger I/O fault (real files, real keys, the real CLI in a subprocess)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from common.core.errors import LedgerForkError, LedgerIntegrityError, LedgerUnavailable
from common.privacy.accountant import Segment
from common.privacy.ledger import (
    PrivacyLedger,
    anchor_path_for,
    check_history,
    export_ledger,
    read_anchor,
    restore_ledger,
    verify_ledger,
)
from common.privacy.signed import LedgerSigner, SignedHistory
from common.protocol.pki import load_certificate
from tests.privacy.conftest import Pki

DELTA = 1e-5
SEGMENT = Segment(1.0, 0.01, 50)
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def open_ledger(path: Path, signer: LedgerSigner) -> PrivacyLedger:
    return PrivacyLedger(path, site_id="hospital-a", budget_epsilon=5.0, delta=DELTA,
                         privacy_unit="patient", signer=signer)


def grow(ledger: PrivacyLedger, rounds: range) -> None:
    for number in rounds:
        ledger.reserve(number, [SEGMENT], now=T0 + timedelta(hours=number))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "common.commands.privacy", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )


def assert_one_clear_line(result: subprocess.CompletedProcess[str], path: Path) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("medfed: error:") and str(path) in lines[0]


# --- the anchor ---------------------------------------------------------------------------


def test_anchor_follows_every_commit(tmp_path: Path, pki_material: Pki) -> None:
    ledger = open_ledger(tmp_path / "l", pki_material.signer_a)
    anchor = read_anchor(anchor_path_for(ledger.path))
    assert anchor is not None and anchor.seq == 0
    grow(ledger, range(1, 4))
    anchor = read_anchor(anchor_path_for(ledger.path))
    assert anchor is not None and (anchor.seq, anchor.head_hash) == (3, ledger.head_hash())
    check_history(ledger.path, site_id="hospital-a")  # the history its anchor records


def test_missing_ledger_with_history_is_not_recreated(tmp_path: Path, pki_material: Pki) -> None:
    path = tmp_path / "l"
    grow(open_ledger(path, pki_material.signer_a), range(1, 3))
    path.unlink()
    # The site's check at start (no terms needed) refuses it as the open does.
    with pytest.raises(LedgerUnavailable) as checked:
        check_history(path, site_id="hospital-a")
    with pytest.raises(LedgerUnavailable) as info:
        open_ledger(path, pki_material.signer_a)
    message = str(info.value)
    assert str(checked.value) == message
    assert str(path) in message and "records 2 entries" in message
    assert "medfed ledger restore" in message and "medfed ledger export" in message
    assert not path.exists()  # nothing recreated at zero


def test_older_copy_or_rewritten_ledger_is_refused(tmp_path: Path, pki_material: Pki) -> None:
    path = tmp_path / "l"
    ledger = open_ledger(path, pki_material.signer_a)
    grow(ledger, range(1, 3))
    backup = tmp_path / "backup"
    shutil.copyfile(path, backup)
    grow(ledger, range(3, 5))
    # Put the older copy back (the anchor says 4 entries).
    path.unlink()
    Path(f"{path}-wal").unlink(missing_ok=True)
    shutil.copyfile(backup, path)
    with pytest.raises(LedgerForkError, match="holds 2 entries but its anchor records 4"):
        check_history(path, site_id="hospital-a")
    with pytest.raises(LedgerForkError, match="holds 2 entries but its anchor records 4"):
        open_ledger(path, pki_material.signer_a)
    # A different (validly signed) history of the same length: a fork.
    path.unlink()
    fork = open_ledger(tmp_path / "fork", pki_material.signer_a)
    grow(fork, range(11, 15))
    shutil.copyfile(tmp_path / "fork", path)
    with pytest.raises(LedgerForkError, match="rewritten"):
        check_history(path, site_id="hospital-a")
    with pytest.raises(LedgerForkError, match="rewritten"):
        open_ledger(path, pki_material.signer_a)


# --- restore --------------------------------------------------------------------------------


@pytest.fixture
def lost_ledger(tmp_path: Path, pki_material: Pki) -> Iterator[tuple[Path, bytes]]:
    """A site that recorded 3 entries, exported them, then lost its ledger file."""
    path = tmp_path / "state" / "privacy-ledger.db"
    path.parent.mkdir()
    grow(open_ledger(path, pki_material.signer_a), range(1, 4))
    export = export_ledger(path).to_bytes()
    for leftover in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        leftover.unlink(missing_ok=True)
    yield path, export


def test_restore_rebuilds_a_verified_ledger_the_site_can_reopen(
    lost_ledger: tuple[Path, bytes], tmp_path: Path, pki_material: Pki
) -> None:
    path, export = lost_ledger
    source = tmp_path / "export.json"
    source.write_bytes(export)
    result = run_cli("ledger", "restore", "--from", str(source), "--ledger", str(path),
                     "--ca", str(pki_material.ca), "--site", "hospital-a")
    assert result.returncode == 0, result.stderr
    assert "restored 3 signed entries" in result.stdout and "LOWER bound" in result.stdout
    assert verify_ledger(path).ok
    ledger = open_ledger(path, pki_material.signer_a)
    assert len(ledger.entries()) == 3
    grow(ledger, range(4, 5))  # and it goes on from there
    assert export_ledger(path).head_seq == 4


def test_restore_refuses_a_history_shorter_than_the_anchor_or_min_seq(
    lost_ledger: tuple[Path, bytes], pki_material: Pki
) -> None:
    path, export = lost_ledger
    full = SignedHistory.from_bytes(export)
    shorter = SignedHistory(full.terms, full.entries[:2], full.certificates)
    with pytest.raises(LedgerForkError, match="known to have reached seq 3"):
        restore_ledger(shorter, path)
    assert not path.exists()
    anchor_path_for(path).unlink()  # even without the anchor, --min-seq holds the floor
    with pytest.raises(LedgerForkError, match="reached seq 3"):
        restore_ledger(shorter, path, min_seq=3)
    # --min-seq is a floor, not proof that nothing was cut from the end: with no anchor
    # and no receipt, the restore needs the explicit override.
    with pytest.raises(LedgerIntegrityError, match="nothing shows that this export"):
        restore_ledger(full, path, min_seq=3)
    restore_ledger(full, path, min_seq=3, accept_unverified_head=True)
    with pytest.raises(LedgerUnavailable, match="never overwrites"):
        restore_ledger(full, path)


def test_restore_refuses_an_edited_or_foreign_export(
    lost_ledger: tuple[Path, bytes], tmp_path: Path, pki_material: Pki
) -> None:
    path, export = lost_ledger
    # Lower an epsilon in the export and fix its entry_hash: the signature still fails.
    history = SignedHistory.from_bytes(export)
    from dataclasses import replace

    edited = replace(history.entries[1], epsilon_after=0.01)
    forged = SignedHistory(history.terms, (history.entries[0], edited, *history.entries[2:]),
                           history.certificates)
    with pytest.raises(LedgerIntegrityError, match="does not verify"):
        restore_ledger(forged, path)
    with pytest.raises(LedgerIntegrityError, match="for site 'hospital-a', not 'hospital-b'"):
        restore_ledger(history, path, site_id="hospital-b")
    # A byte edited in the file itself: one clear line from the CLI.
    source = tmp_path / "bad.json"
    source.write_bytes(export.replace(b'"round":2', b'"round":9', 1))
    result = run_cli("ledger", "restore", "--from", str(source), "--ledger", str(path))
    assert_one_clear_line(result, source)
    assert not path.exists()


def test_restore_into_a_missing_folder_names_it_and_creates_nothing(
    lost_ledger: tuple[Path, bytes], tmp_path: Path, pki_material: Pki
) -> None:
    """`--ledger restored/privacy-ledger.db` where restored/ does not exist: one clear
    line naming that folder (not "disappeared while restoring ... restore it"), and no
    folder is created (a mistyped path must not hold the site's only ledger)."""
    _, export = lost_ledger
    source = tmp_path / "export.json"
    source.write_bytes(export)
    missing = tmp_path / "restored"
    target = missing / "privacy-ledger.db"
    result = run_cli("ledger", "restore", "--from", str(source), "--ledger", str(target),
                     "--ca", str(pki_material.ca), "--site", "hospital-a")
    assert_one_clear_line(result, missing)
    assert f"the folder {missing} for the restored ledger" in result.stderr
    assert "does not exist" in result.stderr and "disappeared" not in result.stderr
    assert not missing.exists()
    # An --anchor in a missing folder likewise; created, the same restore succeeds.
    missing.mkdir(mode=0o700)
    elsewhere = tmp_path / "nowhere" / "anchor"
    result = run_cli("ledger", "restore", "--from", str(source), "--ledger", str(target),
                     "--anchor", str(elsewhere))
    assert_one_clear_line(result, elsewhere.parent)
    assert not target.exists() and not elsewhere.parent.exists()
    result = run_cli("ledger", "restore", "--from", str(source), "--ledger", str(target),
                     "--ca", str(pki_material.ca), "--site", "hospital-a",
                     "--accept-unverified-head")
    assert result.returncode == 0, result.stderr
    assert verify_ledger(target).ok


def test_export_bytes_are_canonical(lost_ledger: tuple[Path, bytes]) -> None:
    _, export = lost_ledger
    assert SignedHistory.from_bytes(export).to_bytes() == export


# --- I/O faults -------------------------------------------------------------------------


@pytest.fixture
def ledger_file(tmp_path: Path, pki_material: Pki) -> Iterator[Path]:
    folder = tmp_path / "state"
    folder.mkdir()
    path = folder / "privacy-ledger.db"
    grow(open_ledger(path, pki_material.signer_a), range(1, 3))
    yield path
    for target in (folder, path):  # let pytest clean up
        if target.exists():
            target.chmod(stat.S_IRWXU)


def test_corrupt_file(ledger_file: Path, pki_material: Pki) -> None:
    ledger_file.write_bytes(b"this is not SQLite" * 100)
    Path(f"{ledger_file}-wal").unlink(missing_ok=True)
    Path(f"{ledger_file}-shm").unlink(missing_ok=True)
    with pytest.raises(LedgerUnavailable) as info:
        open_ledger(ledger_file, pki_material.signer_a)
    assert str(ledger_file) in str(info.value) and "medfed ledger restore" in str(info.value)
    assert_one_clear_line(run_cli("ledger", "show", "--ledger", str(ledger_file)), ledger_file)
    assert_one_clear_line(run_cli("ledger", "verify", "--ledger", str(ledger_file)),
                          ledger_file)


def test_read_only_file(ledger_file: Path, pki_material: Pki) -> None:
    ledger = open_ledger(ledger_file, pki_material.signer_a)
    ledger_file.chmod(stat.S_IRUSR)
    with pytest.raises(LedgerUnavailable, match="read-only") as info:
        ledger.reserve(9, [SEGMENT], now=T0)
    assert str(ledger_file) in str(info.value)
    with pytest.raises(LedgerUnavailable, match="read-only"):
        open_ledger(ledger_file, pki_material.signer_a)


def test_read_only_folder(ledger_file: Path, pki_material: Pki) -> None:
    ledger_file.parent.chmod(stat.S_IRUSR | stat.S_IXUSR)
    with pytest.raises(LedgerUnavailable, match=r"folder .* is read-only") as info:
        open_ledger(ledger_file, pki_material.signer_a)
    assert str(ledger_file) in str(info.value)


def test_missing_table(ledger_file: Path, pki_material: Pki) -> None:
    with sqlite3.connect(ledger_file) as connection:
        connection.execute("DROP TABLE ledger_entries")
    with pytest.raises(LedgerUnavailable, match="damaged") as info:
        open_ledger(ledger_file, pki_material.signer_a)
    assert str(ledger_file) in str(info.value)
    assert_one_clear_line(run_cli("ledger", "show", "--ledger", str(ledger_file)), ledger_file)


def test_file_deleted_while_running(ledger_file: Path, pki_material: Pki) -> None:
    ledger = open_ledger(ledger_file, pki_material.signer_a)
    for leftover in (ledger_file, Path(f"{ledger_file}-wal"), Path(f"{ledger_file}-shm")):
        leftover.unlink(missing_ok=True)
    with pytest.raises(LedgerUnavailable) as info:
        ledger.reserve(9, [SEGMENT], now=T0)
    assert str(ledger_file) in str(info.value)
    with pytest.raises(LedgerUnavailable):
        ledger.spent()
    assert not ledger_file.exists()  # never silently recreated empty


def test_damaged_anchor(ledger_file: Path, pki_material: Pki) -> None:
    anchor_path_for(ledger_file).write_text("{not json")
    with pytest.raises(LedgerUnavailable, match="anchor") as info:
        open_ledger(ledger_file, pki_material.signer_a)
    assert str(anchor_path_for(ledger_file)) in str(info.value)


def test_ca_file_loading_is_real(pki_material: Pki) -> None:
    # The restore/verify --ca option loads a PEM CA certificate (sanity for the fixtures).
    assert load_certificate(pki_material.ca).subject
    assert os.path.isfile(pki_material.ca)
