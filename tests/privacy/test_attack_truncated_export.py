"""A validly signed but truncated (or forked) history cannot lower a site's ledger: the
site's signed head receipts, kept off the state folder and inside its own backups, are
checked at restore and when the ledger opens. Real SQLite ledgers, real keys, the real
CLI in a subprocess."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from common.core.errors import LedgerForkError, LedgerIntegrityError, LedgerUnavailable
from common.privacy.accountant import Segment
from common.privacy.ledger import (
    PrivacyLedger,
    anchor_path_for,
    export_ledger,
    restore_ledger,
)
from common.privacy.receipts import HeadReceipt, read_receipts, receipt_path
from common.privacy.signed import LedgerSigner, SignedHistory
from common.protocol import pki
from tests.privacy.conftest import Pki

DELTA = 1e-5
SEGMENT = Segment(1.0, 0.01, 50)
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def open_ledger(path: Path, signer: LedgerSigner, receipts: Path | None) -> PrivacyLedger:
    return PrivacyLedger(path, site_id="hospital-a", budget_epsilon=5.0, delta=DELTA,
                         privacy_unit="patient", signer=signer, receipts_dir=receipts)


def grow(ledger: PrivacyLedger, rounds: range) -> None:
    for number in rounds:
        ledger.reserve(number, [SEGMENT], now=T0 + timedelta(hours=number))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "common.commands.privacy", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )


def four_entries(tmp_path: Path, signer: LedgerSigner) -> tuple[Path, Path, SignedHistory]:
    """A site with 4 entries and an off-box receipts folder; returns (state, receipts,
    full history)."""
    state, receipts = tmp_path / "state", tmp_path / "offbox"
    state.mkdir()
    receipts.mkdir()
    ledger = open_ledger(state / "privacy-ledger.db", signer, receipts)
    grow(ledger, range(1, 5))
    return state, receipts, export_ledger(ledger.path)


def truncated(history: SignedHistory, keep: int) -> SignedHistory:
    """What a coordinator (or anyone holding an export) can make: the first `keep`
    entries, every signature still valid."""
    return dataclasses.replace(history, entries=history.entries[:keep], head_receipt=None)


def lose_state(state: Path) -> None:
    shutil.rmtree(state)
    state.mkdir()


def test_a_truncated_signed_export_is_refused_at_restore(
    tmp_path: Path, pki_material: Pki
) -> None:
    state, receipts, full = four_entries(tmp_path, pki_material.signer_a)
    receipt = read_receipts(receipts, "hospital-a")
    assert receipt is not None and receipt.receipt.entries == 4
    assert receipt.receipt.epsilon_spent == pytest.approx(full.entries[-1].epsilon_after)
    lose_state(state)
    short = truncated(full, 1)
    export = tmp_path / "export.json"
    export.write_bytes(short.to_bytes())
    ledger = state / "privacy-ledger.db"

    # The export alone verifies: nothing in it shows entries are missing.
    with pytest.raises(LedgerForkError) as info:
        restore_ledger(short, ledger, receipts=[receipt])
    assert "holds 1 entries" in str(info.value)
    assert str(receipt_path(receipts, "hospital-a")) in str(info.value)
    assert not ledger.exists()

    result = run_cli("ledger", "restore", "--from", str(export), "--ledger", str(ledger),
                     "--ca", str(pki_material.ca), "--receipts", str(receipts))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert str(receipt_path(receipts, "hospital-a")) in result.stderr
    assert "records 4" in result.stderr and "--accept-lower-bound" in result.stderr
    assert not ledger.exists()

    # The complete history passes and says which receipt proved it.
    export_full = tmp_path / "full.json"
    export_full.write_bytes(full.to_bytes())
    result = run_cli("ledger", "restore", "--from", str(export_full), "--ledger", str(ledger),
                     "--ca", str(pki_material.ca), "--receipts", str(receipts))
    assert result.returncode == 0, result.stderr
    assert f"signed head receipt {receipt_path(receipts, 'hospital-a')} (4 entries)" in (
        result.stdout)
    reopened = open_ledger(ledger, pki_material.signer_a, receipts)
    assert len(reopened.entries()) == 4


def test_a_forked_signed_export_is_refused_at_restore(
    tmp_path: Path, pki_material: Pki
) -> None:
    """The key holder re-signs a different history of the same length: the receipt's
    head is not in it."""
    state, receipts, _ = four_entries(tmp_path, pki_material.signer_a)
    other_state = tmp_path / "fork"
    other_state.mkdir()
    fork = open_ledger(other_state / "l.db", pki_material.signer_a, None)
    for number in range(1, 5):
        fork.reserve(number, [Segment(5.0, 0.01, 10)], now=T0 + timedelta(hours=number))
    lose_state(state)
    receipt = read_receipts(receipts, "hospital-a")
    assert receipt is not None
    with pytest.raises(LedgerForkError, match="a fork"):
        restore_ledger(export_ledger(fork.path), state / "privacy-ledger.db",
                       receipts=[receipt])


def test_a_truncated_site_backup_is_refused_by_its_own_receipt(
    tmp_path: Path, pki_material: Pki
) -> None:
    """No receipts folder at hand: the backup the site wrote carries its signed head
    receipt, so dropping entries from it is refused; dropping the receipt as well is the
    one thing no file alone shows: the restore refuses it unless told to accept an
    unverified head, and the ledger then says so."""
    state, _, _ = four_entries(tmp_path, pki_material.signer_a)
    cert, key = pki.site_paths(pki_material.root, "hospital-a")
    backup = tmp_path / "backup.json"
    done = run_cli("ledger", "backup", "--ledger", str(state / "privacy-ledger.db"),
                   "--cert", str(cert), "--key", str(key), "--out", str(backup))
    assert done.returncode == 0, done.stderr
    raw = json.loads(backup.read_bytes())
    assert raw["head_receipt"]["entries"] == 4
    lose_state(state)
    raw["entries"] = raw["entries"][:1]
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(raw))
    ledger = state / "privacy-ledger.db"
    result = run_cli("ledger", "restore", "--from", str(cut), "--ledger", str(ledger))
    assert result.returncode == 2
    assert "carried by the export itself" in result.stderr and "records 4" in result.stderr

    # A receipt edited to claim less does not verify.
    raw["head_receipt"]["entries"] = 1
    cut.write_text(json.dumps(raw))
    result = run_cli("ledger", "restore", "--from", str(cut), "--ledger", str(ledger))
    assert result.returncode == 2 and "does not verify" in result.stderr

    del raw["head_receipt"]
    cut.write_text(json.dumps(raw))
    result = run_cli("ledger", "restore", "--from", str(cut), "--ledger", str(ledger))
    assert result.returncode == 2 and "nothing shows that this export" in result.stderr
    assert not ledger.exists()
    result = run_cli("ledger", "restore", "--from", str(cut), "--ledger", str(ledger),
                     "--accept-unverified-head")
    assert result.returncode == 0, result.stderr
    assert "completeness was NOT verified" in result.stdout
    assert "WARNING: COMPLETENESS NOT VERIFIED" in result.stderr


def test_accept_lower_bound_restores_and_records_the_warning(
    tmp_path: Path, pki_material: Pki
) -> None:
    state, receipts, full = four_entries(tmp_path, pki_material.signer_a)
    lose_state(state)
    export = tmp_path / "export.json"
    export.write_bytes(truncated(full, 1).to_bytes())
    ledger = state / "privacy-ledger.db"
    result = run_cli("ledger", "restore", "--from", str(export), "--ledger", str(ledger),
                     "--receipts", str(receipts), "--accept-lower-bound")
    assert result.returncode == 0, result.stderr
    assert "WARNING: LOWER THAN A SIGNED HEAD RECEIPT" in result.stderr
    original = receipt_path(receipts, "hospital-a")
    kept = original.with_name(original.name + ".superseded")
    assert kept.is_file() and HeadReceipt.from_bytes(kept.read_bytes()).entries == 4
    shown = run_cli("ledger", "show", "--ledger", str(ledger))
    assert shown.returncode == 0, shown.stderr
    assert "WARNING: LOWER THAN A SIGNED HEAD RECEIPT" in shown.stdout
    assert "records 4 entries" in shown.stdout
    # The site opens the restored ledger and its receipt follows it again.
    reopened = open_ledger(ledger, pki_material.signer_a, receipts)
    assert len(reopened.entries()) == 1
    now = read_receipts(receipts, "hospital-a")
    assert now is not None and now.receipt.entries == 1


def test_a_site_whose_state_folder_was_lost_refuses_to_start_at_zero(
    tmp_path: Path, pki_material: Pki
) -> None:
    state, receipts, full = four_entries(tmp_path, pki_material.signer_a)
    lose_state(state)
    with pytest.raises(LedgerUnavailable, match=r"signed head receipt .* records 4 entries"):
        open_ledger(state / "privacy-ledger.db", pki_material.signer_a, receipts)
    # An older copy put back (ledger and anchor alike) is refused too.
    write = state / "privacy-ledger.db"
    restore_ledger(truncated(full, 2), write, accept_unverified_head=True)
    with pytest.raises(LedgerForkError, match="holds 2 entries"):
        open_ledger(write, pki_material.signer_a, receipts)


def test_a_receipt_from_another_ca_or_site_is_not_trusted(
    tmp_path: Path, pki_material: Pki
) -> None:
    _, receipts, full = four_entries(tmp_path, pki_material.signer_a)
    path = receipt_path(receipts, "hospital-a")
    forged = open_ledger(tmp_path / "x.db", pki_material.impostor_a, None).receipt()
    path.write_bytes(forged.to_bytes())
    ca = pki.load_certificate(pki_material.ca)
    with pytest.raises(LedgerIntegrityError, match="does not verify"):
        read_receipts(receipts, "hospital-a", ca_certificate=ca)
    receipt_path(receipts, "hospital-b").write_bytes(path.read_bytes())
    with pytest.raises(LedgerIntegrityError, match="not 'hospital-b'"):
        read_receipts(receipts, "hospital-b")
    del full


def test_attack_truncated_export_restored_with_defaults(
    tmp_path: Path, pki_material: Pki
) -> None:
    """The shipped defaults (no receipts folder), the whole state folder lost, and an
    export cut to 1 of its 4 entries (every signature still valid): the restore has
    nothing to check the head against, says so and refuses; only the explicit override
    restores it, and the ledger then carries the warning for good."""
    state = tmp_path / "state"
    state.mkdir()
    ledger = state / "privacy-ledger.db"
    grow(open_ledger(ledger, pki_material.signer_a, None), range(1, 5))
    full = export_ledger(ledger)
    lose_state(state)
    export = tmp_path / "export.json"
    export.write_bytes(truncated(full, 1).to_bytes())

    with pytest.raises(LedgerIntegrityError, match="nothing shows that this export"):
        restore_ledger(truncated(full, 1), ledger)
    result = run_cli("ledger", "restore", "--from", str(export), "--ledger", str(ledger),
                     "--ca", str(pki_material.ca), "--site", "hospital-a")
    assert result.returncode == 2, result.stdout
    assert "Traceback" not in result.stderr
    assert "nothing shows that this export of site hospital-a is complete" in result.stderr
    assert "no signed head receipt" in result.stderr and "--receipts DIR" in result.stderr
    assert "--accept-unverified-head" in result.stderr
    assert not ledger.exists() and not anchor_path_for(ledger).exists()

    result = run_cli("ledger", "restore", "--from", str(export), "--ledger", str(ledger),
                     "--ca", str(pki_material.ca), "--site", "hospital-a",
                     "--accept-unverified-head")
    assert result.returncode == 0, result.stderr
    assert "WARNING: COMPLETENESS NOT VERIFIED: restored 1 entries" in result.stderr
    assert "its completeness was NOT verified" in result.stdout
    for command in ("show", "verify"):
        shown = run_cli("ledger", command, "--ledger", str(ledger))
        assert shown.returncode == 0, shown.stderr
        assert "WARNING: COMPLETENESS NOT VERIFIED" in shown.stdout
    assert len(open_ledger(ledger, pki_material.signer_a, None).entries()) == 1
