"""Hospital mode without DP-SGD beneath: the budget bounds every patient.

The attack (found by review): a hospital-unit ledger charged only the add/remove-one-unit
composition (model updates at S). A patient added or removed inside a hospital that stays
in the round moves its clipped update by up to 2S (replace relation), so the per-patient
figure the privacy officer relies on went past the budget (the demo: 13.73 against 8)
while the ledger still accepted rounds. A ledger created with `charge = "record_level"`
(what a site opens in hospital mode) is charged that per-patient figure: the refusal
comes before a patient's epsilon crosses the budget, and the study plans z for it.
A ledger written before the term keeps its header hash and its recorded epsilons.
Real SQLite ledgers, real keys, the real CLI."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from common.core.errors import BudgetExhausted, ConfigError
from common.privacy import hospital, layered
from common.privacy.accountant import compose_epsilon
from common.privacy.ledger import PrivacyLedger, read_ledger, verify_ledger
from common.privacy.mechanisms import Gaussian, Mechanism, canonical_json
from common.privacy.signed import (
    CHARGE_RECORD_LEVEL,
    CHARGE_UNIT,
    LedgerSigner,
    LedgerTerms,
    sha256_hex,
)
from common.protocol import pki
from common.study import study_from_mapping
from common.study.hospital_terms import study_terms
from site_agent import dp_release
from tests.privacy.conftest import Pki
from tests.study.helpers import study_mapping

NOW = datetime(2026, 11, 26, tzinfo=UTC)
DELTA = 1e-5
BUDGET = 8.0
CLIP = 1.0
DIM = 4096
ACCOUNTANT = "rdp"
VECTORS = Path(__file__).parents[1] / "vectors" / "privacy_ledger_hashes.json"
# The ledger_header table as every ledger before the `charge` term was created.
OLD_HEADER_TABLE = (
    "CREATE TABLE ledger_header ("
    " id INTEGER PRIMARY KEY CHECK (id = 1), format TEXT NOT NULL, site_id TEXT NOT NULL,"
    " budget_epsilon REAL NOT NULL, delta REAL NOT NULL, accountant TEXT NOT NULL,"
    " privacy_unit TEXT NOT NULL, header_hash TEXT NOT NULL, entry_count INTEGER NOT NULL,"
    " head_hash TEXT NOT NULL)"
)
Pairs = list[tuple[str, tuple[Mechanism, ...]]]


def _study(**privacy: object) -> object:
    return study_from_mapping(
        study_mapping(unit="hospital", update_clip_norm=CLIP, epsilon=BUDGET, delta=DELTA,
                      **privacy),
        source="test")


def _round(z: float) -> Mechanism:
    """One hospital round's ledger mechanism as a site plans it: 3 sites, the study's
    floor of 3 minus 1 colluder adding noise."""
    ring = hospital.ring_plan(hospital.HospitalTerms(CLIP, z), dim=DIM, max_sites=3)
    return hospital.mechanism(hospital.site_plan(ring, n_noise=2))


def _open(path: Path, signer: LedgerSigner, *, charge: str,
          budget: float = BUDGET) -> PrivacyLedger:
    return PrivacyLedger(path, site_id="hospital-a", budget_epsilon=budget, delta=DELTA,
                         accountant=ACCOUNTANT, privacy_unit="hospital", charge=charge,
                         signer=signer)


def _spend_until_refused(
    ledger: PrivacyLedger, z: float, *, rounds: int,
) -> tuple[BudgetExhausted, tuple[str, tuple[Mechanism, ...]]]:
    """The count, then training rounds each with its evaluation histogram, until the
    ledger refuses one (a coordinator announcing rounds beyond the study's): the refusal
    and the (purpose, mechanisms) it refused."""
    count_std = dp_release.gaussian_std_for(epsilon=0.5, delta=DELTA, accountant=ACCOUNTANT)
    ledger.reserve(0, [Gaussian(count_std, 1.0)], now=NOW, purpose="count")
    evaluation = dp_release.evaluation_mechanism(noise_std=5.0, n_noise=2, bins=10)
    for number in range(1, rounds + 1):
        at = NOW + timedelta(hours=number)
        for purpose, mechanism in (("training", _round(z)), ("evaluation", evaluation)):
            try:
                ledger.reserve(number, [mechanism], now=at, purpose=purpose)
            except BudgetExhausted as refused:
                return refused, (purpose, (mechanism,))
            # After every accepted release the per-patient figure is within the budget.
            figures = hospital.guarantees(_pairs(ledger), delta=DELTA, accountant=ACCOUNTANT)
            if ledger.charge == CHARGE_RECORD_LEVEL:
                assert figures.per_patient <= BUDGET
                assert ledger.spent() == pytest.approx(figures.per_patient, rel=1e-9)
    raise AssertionError(f"the ledger accepted all {rounds} rounds")


def _pairs(ledger: PrivacyLedger) -> Pairs:
    return [(e.purpose, e.mechanisms) for e in ledger.entries()]


def test_attack_rounds_past_the_plan_never_take_a_patient_past_the_budget(
    tmp_path: Path, pki_material: Pki
) -> None:
    z = study_terms(_study()).noise_multiplier
    ledger = _open(tmp_path / "ledger.db", pki_material.signer_a, charge=CHARGE_RECORD_LEVEL)
    refused, pending = _spend_until_refused(ledger, z, rounds=200)
    history = _pairs(ledger)
    assert sum(purpose == "training" for purpose, _ in history) >= 3  # the study's rounds
    # The charged history, composed per patient (the model updates at 2S with every
    # other release), independently of the ledger: within the budget.
    doubled = [layered.replaced(m) if purpose == "training" else m  # type: ignore[arg-type]
               for purpose, ms in history for m in ms]
    per_patient = compose_epsilon(doubled, delta=DELTA, accountant=ACCOUNTANT)
    assert per_patient <= BUDGET
    assert ledger.spent() == pytest.approx(per_patient, rel=1e-9)
    # The refusal names the per-patient figure the refused release would have brought.
    found = re.search(r"would bring epsilon to ([0-9.]+) > budget 8", str(refused))
    assert found is not None and "per-patient" in str(refused)
    over = layered.record_level([*history, pending], delta=DELTA,
                                accountant=ACCOUNTANT).epsilon
    assert float(found.group(1)) == pytest.approx(over, abs=1e-4)
    assert over > BUDGET

    # The same rounds on a ledger charged the old way (add/remove one hospital at S):
    # it accepts rounds until that figure reaches 8, by when a patient's is far past it.
    old = _open(tmp_path / "old.db", pki_material.signer_a, charge=CHARGE_UNIT)
    _spend_until_refused(old, z, rounds=200)
    old_figures = hospital.guarantees(_pairs(old), delta=DELTA, accountant=ACCOUNTANT)
    assert old.spent() <= BUDGET < old_figures.per_patient


def test_the_study_plans_z_for_the_per_patient_charge() -> None:
    study = _study()
    privacy = study.privacy  # type: ignore[attr-defined]
    left = (privacy.epsilon - privacy.statistics_epsilon - privacy.count_epsilon) * (
        1 - hospital.EVALUATION_RESERVE)
    rounds = study.study.rounds  # type: ignore[attr-defined]
    at_s = hospital.plan_noise_multiplier(epsilon=left, delta=DELTA, rounds=rounds)
    z = study_terms(study).noise_multiplier
    assert z == pytest.approx(2 * at_s, rel=1e-3)
    # The study's rounds at that z, composed at 2S, fit what the plan gave them.
    per_patient = compose_epsilon([layered.replaced(_round(z))] * rounds,  # type: ignore[arg-type]
                                  delta=DELTA, accountant=ACCOUNTANT)
    assert per_patient <= left * 1.02
    # DP-SGD beneath bounds a patient on its own path: the rounds stay planned at S.
    beneath = _study(record_level="record", record_epsilon=4.0)
    assert study_terms(beneath).noise_multiplier == pytest.approx(at_s, rel=1e-3)


def _old_ledger(path: Path, signer: LedgerSigner) -> PrivacyLedger:
    """A hospital-unit ledger as the code before the `charge` term wrote it: no charge in
    its header, no charge column, epsilons composed at S."""
    ledger = _open(path, signer, charge=CHARGE_UNIT)
    z = 1.36
    ledger.reserve(1, [_round(z)], now=NOW)
    ledger.reserve(2, [_round(z)], now=NOW)
    with sqlite3.connect(path) as conn:
        conn.execute("ALTER TABLE ledger_header RENAME TO header_with_charge")
        conn.execute(OLD_HEADER_TABLE)
        conn.execute(
            "INSERT INTO ledger_header SELECT id, format, site_id, budget_epsilon, delta, "
            "accountant, privacy_unit, header_hash, entry_count, head_hash "
            "FROM header_with_charge")
        conn.execute("DROP TABLE header_with_charge")
    return ledger


def test_a_ledger_written_before_the_term_still_verifies_and_is_carried(
    tmp_path: Path, pki_material: Pki
) -> None:
    # The header hash of terms without a charge is the pinned one, byte for byte.
    vector = json.loads(VECTORS.read_text())["format2"]
    terms = LedgerTerms(**vector["terms"])
    assert terms.charge == CHARGE_UNIT and "charge" not in terms.to_json_dict()
    assert terms.header_hash == vector["header_hash"]
    charged_terms = LedgerTerms(**vector["terms"], charge=CHARGE_RECORD_LEVEL)
    assert charged_terms.header_hash != terms.header_hash
    assert LedgerTerms.from_json_dict(charged_terms.to_json_dict()) == charged_terms
    with pytest.raises(ConfigError, match="charge"):
        LedgerTerms.from_json_dict({**terms.to_json_dict(), "charge": CHARGE_UNIT})

    path = tmp_path / "privacy-ledger.db"
    old = _old_ledger(path, pki_material.signer_a)
    with sqlite3.connect(path) as conn:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(ledger_header)")}
    assert "charge" not in columns
    header, entries = read_ledger(path)
    assert header.charge == CHARGE_UNIT
    expected_hash = sha256_hex(canonical_json({
        "format": "medfed-privacy-ledger/2", "site_id": "hospital-a",
        "budget_epsilon": BUDGET, "delta": DELTA, "accountant": ACCOUNTANT,
        "privacy_unit": "hospital"}))
    assert header.header_hash == expected_hash == entries[0].prev_hash
    report = verify_ledger(path)  # chain, signatures, every epsilon recomposed at S
    assert report.ok, report.problems
    at_s = compose_epsilon([m for e in entries for m in e.mechanisms], delta=DELTA,
                           accountant=ACCOUNTANT)
    assert entries[-1].epsilon_after == pytest.approx(at_s, rel=1e-9)
    old_spent = old.spent()
    reopened = _open(path, pki_material.signer_a, charge=CHARGE_UNIT)
    assert reopened.spent() == old_spent

    # A site in hospital mode opens it with the per-patient charge: refused, naming the way.
    with pytest.raises(ConfigError, match="--charge record_level"):
        _open(path, pki_material.signer_a, charge=CHARGE_RECORD_LEVEL)

    cert, key = pki.site_paths(pki_material.root, "hospital-a")
    carry = [sys.executable, "-m", "common.commands.privacy", "ledger", "carry", "--ledger",
             str(path), "--charge", CHARGE_RECORD_LEVEL, "--cert", str(cert), "--key", str(key)]
    # At the per-patient charge the history spent more than the old budget: a carry that
    # kept that budget would record a spend above it, so the budget must be raised.
    kept = subprocess.run(carry, capture_output=True, text=True, timeout=300, check=False)
    assert kept.returncode == 2 and "is above the new budget" in kept.stderr, kept.stderr
    done = subprocess.run([*carry, "--budget-epsilon", str(2 * BUDGET)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert verify_ledger(path.with_name(path.name + ".terms-1")).ok  # kept as it was
    new = _open(path, pki_material.signer_a, charge=CHARGE_RECORD_LEVEL, budget=2 * BUDGET)
    assert verify_ledger(path).ok
    figures = hospital.guarantees(_pairs(new), delta=DELTA, accountant=ACCOUNTANT)
    assert new.spent() == pytest.approx(figures.per_patient, rel=1e-9)
    assert new.spent() > old_spent


def test_ledger_show_says_the_per_patient_figure_is_charged(
    tmp_path: Path, pki_material: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    from common.commands.privacy import main as privacy_main

    ledger = _open(tmp_path / "ledger.db", pki_material.signer_a, charge=CHARGE_RECORD_LEVEL)
    ledger.reserve(1, [_round(2.7)], now=NOW)
    assert privacy_main(["ledger", "show", "--ledger", str(ledger.path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["charge"] == CHARGE_RECORD_LEVEL
    assert summary["spent_epsilon"] == pytest.approx(summary["per_patient_epsilon"], rel=1e-9)
    assert summary["budget_charge"].startswith("the per-patient epsilon")
    with pytest.raises(ConfigError, match="charge"):
        PrivacyLedger(tmp_path / "p.db", site_id="hospital-a", budget_epsilon=BUDGET,
                      delta=DELTA, privacy_unit="patient", charge=CHARGE_RECORD_LEVEL,
                      signer=pki_material.signer_a)
