"""New ledger terms never start a site at zero: the old history opens the new ledger and
the new budget's refusal counts it. Real SQLite ledgers, real keys, the real CLI."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from common.core.errors import BudgetExhausted, ConfigError
from common.privacy.accountant import Segment, account
from common.privacy.carry import carry_ledger
from common.privacy.ledger import PrivacyLedger, ledger_notes, verify_ledger
from common.privacy.receipts import read_receipts
from common.privacy.signed import LedgerSigner, LedgerTerms
from common.protocol import pki
from tests.privacy.conftest import Pki

DELTA = 1e-5
SEGMENT = Segment(1.5, 0.02, 100)
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def open_ledger(path: Path, signer: LedgerSigner, *, budget: float, delta: float = DELTA,
                accountant: str = "prv", receipts: Path | None = None) -> PrivacyLedger:
    return PrivacyLedger(path, site_id="hospital-a", budget_epsilon=budget, delta=delta,
                         accountant=accountant, privacy_unit="patient", signer=signer,
                         receipts_dir=receipts)


def spend(ledger: PrivacyLedger, rounds: range) -> None:
    for number in rounds:
        ledger.reserve(number, [SEGMENT], now=T0 + timedelta(hours=number))


def test_a_lowered_budget_starts_at_the_old_spend_and_refuses_accordingly(
    tmp_path: Path, pki_material: Pki
) -> None:
    receipts = tmp_path / "offbox"
    receipts.mkdir()
    path = tmp_path / "privacy-ledger.db"
    old = open_ledger(path, pki_material.signer_a, budget=5.0, receipts=receipts)
    spend(old, range(1, 4))
    old_spent = old.spent()
    assert old_spent == pytest.approx(account([SEGMENT] * 3, delta=DELTA).epsilon)

    # The site config now says 1.15: the old ledger refuses, naming the carry command.
    with pytest.raises(ConfigError, match="medfed ledger carry"):
        open_ledger(path, pki_material.signer_a, budget=1.15, receipts=receipts)

    cert, key = pki.site_paths(pki_material.root, "hospital-a")
    done = subprocess.run(
        [sys.executable, "-m", "common.commands.privacy", "ledger", "carry", "--ledger", str(path),
         "--budget-epsilon", "1.15", "--cert", str(cert), "--key", str(key),
         "--receipts", str(receipts)],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    kept = tmp_path / "privacy-ledger.db.terms-1"
    assert f"kept as {kept}" in done.stdout
    assert verify_ledger(kept).ok  # the old ledger, unchanged, still verifies

    new = open_ledger(path, pki_material.signer_a, budget=1.15, receipts=receipts)
    assert new.spent() == pytest.approx(old_spent)  # same delta and accountant: same figure
    assert [e.mechanisms for e in new.entries()] == [(SEGMENT,)] * 3
    assert verify_ledger(path).ok  # signatures, chain and every epsilon recomposed
    assert any(n.startswith("CARRIED: opens with the 3 entries") for n in ledger_notes(path))
    receipt = read_receipts(receipts, "hospital-a")
    assert receipt is not None and receipt.receipt.entries == 3
    assert receipt.receipt.header_hash == new.terms.header_hash

    # A fourth round would cost 0.63 on a fresh ledger; here it takes the total to 1.23.
    with pytest.raises(BudgetExhausted, match=r"budget 1\.15"):
        new.reserve(4, [SEGMENT], now=T0 + timedelta(hours=4))
    fresh = open_ledger(tmp_path / "fresh.db", pki_material.signer_a, budget=1.15)
    fresh.reserve(4, [SEGMENT], now=T0)  # what a reset to zero would have allowed


def test_a_new_delta_and_accountant_recompose_the_whole_carried_history(
    tmp_path: Path, pki_material: Pki
) -> None:
    old = open_ledger(tmp_path / "old.db", pki_material.signer_a, budget=5.0)
    spend(old, range(1, 4))
    terms = LedgerTerms("hospital-a", 3.0, 1e-6, "rdp", "patient")
    done = carry_ledger(old.path, tmp_path / "new.db", terms=terms,
                        signer=pki_material.signer_a, now=T0)
    expected = account([SEGMENT] * 3, delta=1e-6, accountant="rdp").epsilon
    assert done.spent == pytest.approx(expected) and done.spent > done.old_spent
    assert done.old_head_hash == old.head_hash()
    new = open_ledger(done.path, pki_material.signer_a, budget=3.0, delta=1e-6,
                      accountant="rdp")
    assert new.spent() == pytest.approx(expected)
    spend(new, range(4, 5))
    assert new.spent() == pytest.approx(
        account([SEGMENT] * 4, delta=1e-6, accountant="rdp").epsilon)


def test_a_carry_across_privacy_units_is_refused(tmp_path: Path, pki_material: Pki) -> None:
    old = open_ledger(tmp_path / "old.db", pki_material.signer_a, budget=5.0)
    spend(old, range(1, 2))
    terms = LedgerTerms("hospital-a", 5.0, DELTA, "prv", "record")
    with pytest.raises(ConfigError, match="neighbour relation"):
        carry_ledger(old.path, tmp_path / "new.db", terms=terms,
                     signer=pki_material.signer_a, now=T0)
    assert not (tmp_path / "new.db").exists()


def test_a_carried_query_entry_keeps_the_query_it_answered(
    tmp_path: Path, pki_material: Pki
) -> None:
    """A "query" entry names its query in its signed body; its re-recording must too (an
    entry without it is not a ledger entry: the carried ledger would not read back)."""
    from common.privacy.mechanisms import Gaussian
    from common.privacy.signed import QueryRef

    old = open_ledger(tmp_path / "old.db", pki_material.signer_a, budget=5.0)
    spend(old, range(1, 2))
    asked = QueryRef("cohort-size", "ab" * 32)
    old.reserve(2, [Gaussian(40.0, 1.0)], now=T0, purpose="query", query=asked)
    terms = LedgerTerms("hospital-a", 6.0, DELTA, "prv", "patient")
    done = carry_ledger(old.path, tmp_path / "new.db", terms=terms,
                        signer=pki_material.signer_a, now=T0)
    new = open_ledger(done.path, pki_material.signer_a, budget=6.0)
    assert [(e.purpose, e.query) for e in new.entries()] == [("training", None),
                                                             ("query", asked)]
    assert verify_ledger(done.path).ok
