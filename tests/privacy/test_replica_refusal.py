"""A site whose ledger was reset is refused with FAILED_PRECONDITION
(the coordinator's replica of its signed entries is what the report is checked against)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import grpc
import pytest

from common.core.errors import LedgerForkError
from common.core.sqldb import Database
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import Gaussian
from common.privacy.replica import LedgerReplica
from common.rounds import wire
from tests.privacy.conftest import Pki

NOW = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)


def test_reset_ledger_is_refused_as_a_fork(tmp_path: Path, pki_material: Pki) -> None:
    def ledger(folder: Path) -> PrivacyLedger:
        folder.mkdir()
        return PrivacyLedger(folder / "l.db", site_id="hospital-a", budget_epsilon=8.0,
                             delta=1e-5, signer=pki_material.signer_a)

    from common.protocol.pki import load_certificate

    replica = LedgerReplica(Database(f"sqlite:///{tmp_path / 'state.db'}"),
                            ca_certificate=load_certificate(pki_material.ca))
    first = ledger(tmp_path / "a")
    first.reserve(0, [Gaussian(40.0, 1.0)], now=NOW, purpose="count")
    replica.extend("hospital-a", first.export().to_bytes(), now=NOW)
    status = first.status()
    assert replica.check_head("hospital-a", entries=status.ledger_entries,
                              head_hash=status.ledger_head)
    reset = ledger(tmp_path / "b").status()  # deleted ledger + anchor: back at zero
    with pytest.raises(LedgerForkError) as caught:
        replica.check_head("hospital-a", entries=reset.ledger_entries,
                           head_hash=reset.ledger_head)
    assert wire.status_for(caught.value) is grpc.StatusCode.FAILED_PRECONDITION
