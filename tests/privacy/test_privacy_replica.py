"""The coordinator's replica of site ledgers on real SQLite files, with real site keys:
extend only by a verified suffix; fork, shrink and reset refused; export -> restore."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from common.core.errors import LedgerForkError, LedgerIntegrityError, ValidationError
from common.privacy.accountant import Segment
from common.privacy.ledger import PrivacyLedger, export_ledger, restore_ledger, verify_ledger
from common.privacy.mechanisms import Gaussian
from common.privacy.replica import LedgerReplica
from common.privacy.signed import LedgerSigner, SignedHistory
from common.protocol.pki import load_certificate
from tests.privacy.conftest import Pki

DELTA = 1e-5
SEGMENT = Segment(1.0, 0.01, 50)
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def site_ledger(path: Path, signer: LedgerSigner, site: str = "hospital-a") -> PrivacyLedger:
    return PrivacyLedger(path, site_id=site, budget_epsilon=5.0, delta=DELTA,
                         privacy_unit="patient", signer=signer)


def grow(ledger: PrivacyLedger, rounds: range) -> None:
    for number in rounds:
        ledger.reserve(number, [SEGMENT], now=T0 + timedelta(hours=number))


@pytest.fixture
def replica(tmp_path: Path, pki_material: Pki) -> LedgerReplica:
    return LedgerReplica.sqlite(tmp_path / "coordinator.db",
                                ca_certificate=load_certificate(pki_material.ca))


def test_extend_in_steps_and_survive_a_restart(
    tmp_path: Path, replica: LedgerReplica, pki_material: Pki
) -> None:
    ledger = site_ledger(tmp_path / "a.ledger", pki_material.signer_a)
    assert replica.extend("hospital-a", ledger.export(), now=T0).entries == 0  # terms only
    grow(ledger, range(1, 3))
    head = replica.extend("hospital-a", ledger.export(), now=T0)
    assert (head.entries, head.head_hash) == (2, ledger.head_hash())
    grow(ledger, range(3, 5))
    # A suffix starting right after the replica's head, as bytes (the RPC payload).
    head = replica.extend("hospital-a", ledger.export(after_seq=2).to_bytes(), now=T0)
    assert head.entries == 4
    # Re-sending overlapping entries is harmless.
    assert replica.extend("hospital-a", ledger.export(after_seq=1), now=T0).entries == 4
    replica.close()
    reopened = LedgerReplica.sqlite(tmp_path / "coordinator.db")
    assert reopened.head("hospital-a") == head
    assert reopened.export("hospital-a") == ledger.export().to_bytes()
    assert reopened.check_head("hospital-a", entries=4, head_hash=ledger.head_hash())


def test_certificate_replacement_and_mixed_purposes(
    tmp_path: Path, replica: LedgerReplica, pki_material: Pki
) -> None:
    path = tmp_path / "a.ledger"
    grow(site_ledger(path, pki_material.signer_a), range(1, 2))
    renewed = site_ledger(path, pki_material.signer_a_renewed)
    renewed.reserve(1, [Gaussian(30.0, 1.0)], now=T0, purpose="evaluation")
    assert replica.extend("hospital-a", renewed.export(), now=T0).entries == 2
    history = SignedHistory.from_bytes(replica.export("hospital-a"))
    assert len(history.certificates) == 2


def test_shrink_reset_and_fork_are_refused(
    tmp_path: Path, replica: LedgerReplica, pki_material: Pki
) -> None:
    ledger = site_ledger(tmp_path / "a.ledger", pki_material.signer_a)
    grow(ledger, range(1, 4))
    replica.extend("hospital-a", ledger.export(), now=T0)
    full = ledger.export()
    # Shrink: the site reports an older head.
    older = SignedHistory(full.terms, full.entries[:2], full.certificates)
    with pytest.raises(LedgerForkError, match="reports 2 ledger entries but the replica holds 3"):
        replica.extend("hospital-a", older, now=T0)
    with pytest.raises(LedgerForkError):
        replica.check_head("hospital-a", entries=2, head_hash=full.entries[1].entry_hash)
    # Reset: a fresh, empty ledger with the same terms.
    fresh = site_ledger(tmp_path / "fresh.ledger", pki_material.signer_a)
    with pytest.raises(LedgerForkError, match="reset"):
        replica.extend("hospital-a", fresh.export(), now=T0)
    # Fork: a different but validly signed history of the same site.
    grow(fresh, range(7, 11))
    with pytest.raises(LedgerForkError, match="differs from the replica's"):
        replica.extend("hospital-a", fresh.export(), now=T0)
    with pytest.raises(LedgerForkError, match="forked"):
        replica.check_head("hospital-a", entries=3, head_hash=fresh.export().entries[2].entry_hash)
    # Terms changed (a reset with a bigger budget): its entries do not re-record the
    # replica's releases (other rounds), so it is no carry (tests/privacy/
    # test_replica_carry.py: a real carry is accepted).
    bigger = PrivacyLedger(tmp_path / "big.ledger", site_id="hospital-a", budget_epsilon=50.0,
                           delta=DELTA, privacy_unit="patient", signer=pki_material.signer_a)
    grow(bigger, range(5, 9))
    with pytest.raises(LedgerForkError, match=r"other terms.*seq=1 has another round"):
        replica.extend("hospital-a", bigger.export(), now=T0)
    assert replica.head("hospital-a") is not None
    assert replica.head("hospital-a").entries == 3  # type: ignore[union-attr]


def test_gap_wrong_site_bad_signature_and_foreign_ca(
    tmp_path: Path, replica: LedgerReplica, pki_material: Pki
) -> None:
    ledger = site_ledger(tmp_path / "a.ledger", pki_material.signer_a)
    grow(ledger, range(1, 5))
    with pytest.raises(ValidationError, match="send the ledger entries from seq 1"):
        replica.extend("hospital-a", ledger.export(after_seq=2), now=T0)
    with pytest.raises(ValidationError, match="not 'hospital-b'"):
        replica.extend("hospital-b", ledger.export(), now=T0)
    full = ledger.export()
    lowered = replace(full.entries[1], epsilon_after=0.01)
    forged = SignedHistory(full.terms, (full.entries[0], lowered), full.certificates)
    with pytest.raises(LedgerIntegrityError, match="seq=2: signature does not verify"):
        replica.extend("hospital-a", forged, now=T0)
    impostor = site_ledger(tmp_path / "i.ledger", pki_material.impostor_a)
    grow(impostor, range(1, 2))
    with pytest.raises(LedgerIntegrityError, match="federation CA"):
        replica.extend("hospital-a", impostor.export(), now=T0)
    assert replica.head("hospital-a") is None  # nothing was written by any refusal


def test_export_from_the_coordinator_state_restores_the_site(
    tmp_path: Path, pki_material: Pki
) -> None:
    state = tmp_path / "coordinator-state"
    state.mkdir()
    replica = LedgerReplica.sqlite(state / "coordinator.db")
    site_path = tmp_path / "site" / "privacy-ledger.db"
    site_path.parent.mkdir()
    ledger = site_ledger(site_path, pki_material.signer_b, site="hospital-b")
    grow(ledger, range(1, 4))
    replica.extend("hospital-b", ledger.export(), now=T0)
    replica.close()
    lost = tmp_path / "lost.db"
    shutil.move(site_path, lost)  # the site loses its ledger (its anchor stays)
    out = tmp_path / "export.json"
    result = subprocess.run(
        [sys.executable, "-m", "common.commands.privacy", "ledger", "export", "--site",
         "hospital-b",
         "--state", str(state), "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    restore_ledger(SignedHistory.from_bytes(out.read_bytes()), site_path,
                   ca_certificate=load_certificate(pki_material.ca))
    assert verify_ledger(site_path).ok
    assert export_ledger(site_path).to_bytes() == out.read_bytes()
    assert len(site_ledger(site_path, pki_material.signer_b, site="hospital-b").entries()) == 3
    unknown = subprocess.run(
        [sys.executable, "-m", "common.commands.privacy", "ledger", "export", "--site", "nobody",
         "--database-url", f"sqlite:///{state / 'coordinator.db'}"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert unknown.returncode == 2 and "no ledger replica for 'nobody'" in unknown.stderr
