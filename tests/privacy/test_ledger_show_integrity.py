"""`medfed ledger show` refuses to present a tampered ledger as normal (review: with
its last row deleted, `show` printed a smaller `spent` and exited 0; only `verify`
said INTEGRITY FAILURE). Real SQLite ledgers, signed by a real site certificate,
edited with plain SQL as an intruder would; `show` runs in a real process."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from common.privacy.accountant import Segment
from common.privacy.ledger import PrivacyLedger, anchor_path_for
from common.privacy.mechanisms import canonical_json
from tests.privacy.conftest import Pki

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
ROUNDS = 4


@pytest.fixture
def ledger(tmp_path: Path, pki_material: Pki) -> Path:
    """A site's ledger (rounds 0..3) with its anchor beside it, as the agent leaves it."""
    path = tmp_path / "state" / "privacy-ledger.db"
    path.parent.mkdir()
    book = PrivacyLedger(path, site_id="hospital-a", budget_epsilon=8.0, delta=1e-5,
                         accountant="rdp", privacy_unit="patient",
                         signer=pki_material.signer_a)
    for number in range(ROUNDS):
        book.reserve(number, [Segment(1.0, 0.01, 100)], now=T0 + timedelta(hours=number))
    assert anchor_path_for(path).exists()
    return path


def show(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "common.commands.privacy", "ledger", "show", "--ledger", str(path),
         *extra],
        capture_output=True, text=True, timeout=120, check=False,
    )


def spent(path: Path) -> float:
    result = show(path, "--json")
    return float(json.loads(result.stdout)["spent_epsilon"])


def delete_last_row(path: Path) -> None:
    with sqlite3.connect(path, isolation_level=None) as connection:
        connection.execute("DELETE FROM ledger_entries WHERE seq = ?", (ROUNDS,))


def edit_epsilon(path: Path, seq: int, value: float) -> None:
    with sqlite3.connect(path, isolation_level=None) as connection:
        body = json.loads(connection.execute(
            "SELECT body FROM ledger_entries WHERE seq = ?", (seq,)).fetchone()[0])
        body["epsilon_after"] = value
        connection.execute("UPDATE ledger_entries SET body = ? WHERE seq = ?",
                           (canonical_json(body).decode(), seq))


def delete_last_row_and_fix_header(path: Path) -> None:
    """The careful intruder: the header's count and head made to match the shorter
    chain. Only the anchor file beside the ledger still knows."""
    with sqlite3.connect(path, isolation_level=None) as connection:
        previous = connection.execute(
            "SELECT entry_hash FROM ledger_entries WHERE seq = ?", (ROUNDS - 1,)).fetchone()[0]
        connection.execute("DELETE FROM ledger_entries WHERE seq = ?", (ROUNDS,))
        connection.execute("UPDATE ledger_header SET entry_count = ?, head_hash = ?",
                           (ROUNDS - 1, previous))


def test_an_untouched_ledger_shows_as_before(ledger: Path) -> None:
    result = show(ledger)
    assert result.returncode == 0, result.stderr
    assert "INTEGRITY" not in result.stdout + result.stderr
    assert result.stdout.startswith("ledger ") and "spent" in result.stdout
    as_json = show(ledger, "--json")
    assert as_json.returncode == 0
    integrity = json.loads(as_json.stdout)["integrity"]
    assert integrity["ok"] is True and integrity["problems"] == []


@pytest.mark.parametrize(
    ("tamper", "named", "readable"),
    [
        (delete_last_row, "header records 4 entries but 3 are present", True),
        # An edited field no longer matches its entry hash: the entry cannot be read.
        (lambda path: edit_epsilon(path, 2, 0.01), "entry seq=2: unreadable", False),
        (delete_last_row_and_fix_header, "anchor records 4", True),
    ],
    ids=["delete_last_row", "edit_epsilon", "delete_last_row_and_fix_header"],
)
def test_a_tampered_ledger_fails_loudly(
    ledger: Path, tamper: Callable[[Path], None], named: str, readable: bool
) -> None:
    honest = spent(ledger)
    tamper(ledger)
    result = show(ledger)
    assert result.returncode == 1, result.stdout + result.stderr
    # First line of stdout, before any figure, and again on stderr.
    assert result.stdout.splitlines()[0].startswith("INTEGRITY FAILURE: ")
    assert named in result.stdout.splitlines()[0]
    assert "NOT trustworthy" in result.stdout and "medfed ledger verify" in result.stdout
    assert "INTEGRITY FAILURE" in result.stderr and named in result.stderr
    as_json = show(ledger, "--json")
    assert as_json.returncode == 1
    shown = json.loads(as_json.stdout)
    assert shown["integrity"]["ok"] is False
    assert any(named in problem for problem in shown["integrity"]["problems"])
    if readable:
        # The understated figure is still printed for the investigation, flagged.
        assert shown["spent_epsilon"] < honest and "spent" in result.stdout
    else:
        assert "spent_epsilon" not in shown and "nothing else can be shown" in result.stdout

