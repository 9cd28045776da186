"""Files nested 100,000 levels deep where a site reads JSON from disk: a ledger export
or backup handed over for `medfed ledger restore`, a head receipt, the ledger's anchor,
a query approval pin, a query's release count. Each is refused with one clear error
naming the file (before, `ledger restore` ended in a RecursionError traceback). Real
files, the real CLI in a subprocess."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from common.core.errors import LedgerUnavailable, StateError
from common.core.parsing import MAX_DEPTH
from common.privacy.accountant import Segment
from common.privacy.ledger import PrivacyLedger, anchor_path_for, export_ledger
from site_agent.approvals import Approvals
from site_agent.query_releases import QueryReleases
from tests.privacy.conftest import Pki

DEEP = 100_000
NESTED = b'{"format":' + b"[" * DEEP + b"]" * DEEP + b"}"
NOW = datetime(2026, 3, 1, tzinfo=UTC)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "common.commands.privacy", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def one_clear_line(result: subprocess.CompletedProcess[str], names: Path) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and "RecursionError" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("medfed: error: "), result.stderr
    assert str(names) in lines[0]
    return lines[0]


def test_attack_deeply_nested_export(tmp_path: Path, pki_material: Pki) -> None:
    state = tmp_path / "state"
    state.mkdir()
    export = tmp_path / "export.json"
    export.write_bytes(NESTED)
    ledger = state / "privacy-ledger.db"
    line = one_clear_line(
        run_cli("ledger", "restore", "--from", str(export), "--ledger", str(ledger)), export)
    assert "not a ledger export" in line and f"nested deeper than {MAX_DEPTH} levels" in line
    assert not ledger.exists()

    # A nested head receipt given beside a genuine export: refused, naming the receipt.
    source = tmp_path / "site"
    source.mkdir()
    real = PrivacyLedger(source / "l.db", site_id="hospital-a", budget_epsilon=5.0,
                         delta=1e-5, privacy_unit="patient", signer=pki_material.signer_a)
    real.reserve(1, [Segment(1.0, 0.01, 10)], now=NOW)
    genuine = tmp_path / "genuine.json"
    genuine.write_bytes(export_ledger(real.path).to_bytes())
    receipt = tmp_path / "hospital-a.head-receipt.json"
    receipt.write_bytes(NESTED)
    line = one_clear_line(
        run_cli("ledger", "restore", "--from", str(genuine), "--ledger", str(ledger),
                "--receipt", str(receipt)), receipt)
    assert "nested deeper" in line and not ledger.exists()


def test_a_deeply_nested_anchor_pin_or_count_is_a_clear_error(
    tmp_path: Path, pki_material: Pki
) -> None:
    ledger = PrivacyLedger(tmp_path / "privacy-ledger.db", site_id="hospital-a",
                           budget_epsilon=5.0, delta=1e-5, privacy_unit="patient",
                           signer=pki_material.signer_a)
    anchor = anchor_path_for(ledger.path)
    anchor.write_bytes(NESTED)
    with pytest.raises(LedgerUnavailable, match=r"anchor .* is damaged \(nested deeper"):
        PrivacyLedger(ledger.path, site_id="hospital-a", budget_epsilon=5.0, delta=1e-5,
                      privacy_unit="patient", signer=pki_material.signer_a)

    approvals = Approvals(tmp_path)
    sha256 = "ab" * 32
    pin = approvals.query_path(sha256)
    pin.parent.mkdir(parents=True)
    pin.write_bytes(NESTED)
    with pytest.raises(StateError, match="is not JSON"):
        approvals.query(sha256)

    counts = QueryReleases.beside(approvals)
    counts.folder.mkdir(parents=True)
    counts.path(sha256).write_bytes(NESTED)
    with pytest.raises(StateError, match="nested deeper"):
        counts.count(sha256)
