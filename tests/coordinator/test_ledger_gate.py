"""The coordinator's ledger gate (`coordinator.ledger_gate`): a site's reported ledger
head is checked against the replica of its signed entries, which only the federation
CA's site certificates may extend. Real PKI, real SQLite."""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path

import pytest

from common.core.config import CoordinatorSettings, load_settings
from common.core.errors import LedgerForkError, MedfedError
from common.core.sqldb import Database
from common.privacy.budget import BudgetReport
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import Gaussian
from common.privacy.signed import LedgerSigner
from common.protocol import pki
from coordinator.ledger_gate import LedgerGate

NOW = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)


def _ledger(folder: Path, signer: LedgerSigner) -> PrivacyLedger:
    folder.mkdir(parents=True)
    return PrivacyLedger(folder / "l.db", site_id="hospital-a", budget_epsilon=8.0,
                         delta=1e-5, signer=signer)


def _signer(root: Path) -> LedgerSigner:
    return LedgerSigner.from_files(*pki.site_paths(root, "hospital-a"))


def _reported(ledger: PrivacyLedger) -> BudgetReport:
    status = ledger.status()
    return BudgetReport(ledger_entries=status.ledger_entries, ledger_head=status.ledger_head)


@pytest.fixture(scope="module")
def federation_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    pki.init_ca(root)
    pki.issue_site(root, "hospital-a")
    return root


@pytest.fixture()
def gate(federation_pki: Path, tmp_path: Path) -> LedgerGate:
    settings = load_settings(CoordinatorSettings, overrides={
        "pki": federation_pki, "state": tmp_path,
    })
    return LedgerGate(Database(f"sqlite:///{tmp_path / 'state.db'}"), settings)


def test_a_head_that_extends_the_replica_passes_and_a_reset_is_refused(
    gate: LedgerGate, federation_pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    signer = _signer(federation_pki)
    assert gate.check_head("hospital-a", BudgetReport()) == 0  # never seen, nothing spent
    ledger = _ledger(tmp_path / "a", signer)
    ledger.reserve(0, [Gaussian(40.0, 1.0)], now=NOW, purpose="count")
    assert gate.replicate("hospital-a", ledger.export().to_bytes(), now=NOW.timestamp()) == 1
    assert gate.check_head("hospital-a", _reported(ledger)) == 1
    assert gate.check_head("hospital-a", None) == 1  # no report: the replica's count
    reset = _ledger(tmp_path / "b", signer)  # ledger and anchor deleted: back at zero
    with caplog.at_level(logging.ERROR, logger="medfed.coordinator"), pytest.raises(
        LedgerForkError
    ):
        gate.check_head("hospital-a", _reported(reset))
    assert [r.__dict__.get("event") for r in caplog.records] == ["ledger_fork"]


def test_only_the_federation_ca_may_extend_a_replica(gate: LedgerGate, tmp_path: Path) -> None:
    """The gate reads the CA from the coordinator's PKI folder: a look-alike certificate
    for the same site name from another CA cannot write the site's history."""
    foreign = tmp_path / "foreign"
    pki.init_ca(foreign)
    pki.issue_site(foreign, "hospital-a")
    impostor = _ledger(tmp_path / "impostor", _signer(foreign))
    impostor.reserve(0, [Gaussian(40.0, 1.0)], now=NOW, purpose="count")
    with pytest.raises(MedfedError):
        gate.replicate("hospital-a", impostor.export().to_bytes(), now=NOW.timestamp())
    assert gate.check_head("hospital-a", None) == 0
