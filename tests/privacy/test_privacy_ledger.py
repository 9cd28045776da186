"""The site's ledger on real SQLite files: write-ahead reserve, budget, restart, tampering."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from common.errors import BudgetExhausted, ConfigError, LedgerIntegrityError, StateError
from common.privacy.accountant import Segment, compose_epsilon
from common.privacy.ledger import (
    PrivacyLedger,
    entry_hash,
    header_hash,
    read_ledger,
    verify_ledger,
)

DELTA = 1e-5
ROUND_SEGMENT = Segment(1.0, 0.01, 100)  # cheap for PRV, ~0.73 epsilon for one round
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def open_ledger(path: Path, **overrides: object) -> PrivacyLedger:
    options: dict[str, object] = {
        "site_id": "hospital-a",
        "budget_epsilon": 3.0,
        "delta": DELTA,
        "accountant": "prv",
        "privacy_unit": "patient",
    }
    options.update(overrides)
    return PrivacyLedger(path, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def four_round_ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ledger with rounds 0..3 committed (built once, copied per test)."""
    path = tmp_path_factory.mktemp("ledger") / "site.ledger"
    ledger = open_ledger(path)
    for round_number in range(4):
        ledger.reserve(round_number, [ROUND_SEGMENT], now=T0 + timedelta(hours=round_number))
    return path


@pytest.fixture
def ledger_copy(four_round_ledger: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy.ledger"
    shutil.copyfile(four_round_ledger, target)
    wal = four_round_ledger.with_name(four_round_ledger.name + "-wal")
    if wal.exists():
        shutil.copyfile(wal, target.with_name(target.name + "-wal"))
    return target


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def count_entries(path: Path) -> int:
    with raw(path) as connection:
        return int(connection.execute("SELECT COUNT(*) FROM ledger_entries").fetchone()[0])


def test_reserve_is_write_ahead_and_durable(tmp_path: Path) -> None:
    path = tmp_path / "site.ledger"
    ledger = open_ledger(path)
    entry = ledger.reserve(7, [ROUND_SEGMENT], now=T0)
    # Another connection (as after a crash right after reserve) already sees the entry.
    with raw(path) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        row = connection.execute(
            "SELECT round, epsilon_after, status, entry_hash FROM ledger_entries"
        ).fetchone()
        header = connection.execute("SELECT entry_count, head_hash FROM ledger_header").fetchone()
    assert row == (7, entry.epsilon_after, "committed", entry.entry_hash)
    assert header == (1, entry.entry_hash)
    assert entry.prev_hash == header_hash(
        site_id="hospital-a",
        budget_epsilon=3.0,
        delta=DELTA,
        accountant="prv",
        privacy_unit="patient",
    )
    assert entry.epsilon_after == pytest.approx(compose_epsilon([ROUND_SEGMENT], delta=DELTA))
    assert entry.created_at == T0.isoformat()


def test_spent_composes_the_whole_history_not_the_sum(ledger_copy: Path) -> None:
    ledger = open_ledger(ledger_copy)
    assert ledger.history() == [ROUND_SEGMENT] * 4
    whole = compose_epsilon([Segment(1.0, 0.01, 400)], delta=DELTA)
    assert ledger.spent() == pytest.approx(whole, rel=1e-9)
    first_round = ledger.entries()[0].epsilon_after
    assert ledger.spent() < 4 * first_round
    assert ledger.remaining() == pytest.approx(3.0 - whole)
    preview = ledger.preview(4, [ROUND_SEGMENT])
    assert preview == pytest.approx(compose_epsilon([Segment(1.0, 0.01, 500)], delta=DELTA))
    status = ledger.status()
    assert (status.last_round, status.ledger_entries, status.exhausted) == (3, 4, False)
    assert status.ledger_head == ledger.head_hash()


def test_over_budget_round_raises_and_writes_nothing(ledger_copy: Path) -> None:
    ledger = open_ledger(ledger_copy)
    before = ledger.head_hash()
    big_round = [Segment(1.0, 0.01, 3000)]
    assert ledger.exhausted(big_round)
    assert not ledger.exhausted([ROUND_SEGMENT])
    with pytest.raises(BudgetExhausted, match="hospital-a"):
        ledger.reserve(4, big_round, now=T0)
    assert count_entries(ledger_copy) == 4
    assert ledger.head_hash() == before
    assert verify_ledger(ledger_copy).ok


def test_site_never_trains_past_its_budget(tmp_path: Path) -> None:
    ledger = open_ledger(tmp_path / "site.ledger", budget_epsilon=1.0)
    committed = []
    for round_number in range(10):
        if ledger.exhausted([ROUND_SEGMENT]):
            break
        committed.append(ledger.reserve(round_number, [ROUND_SEGMENT], now=T0))
    assert len(committed) == 2  # 0.73 after one round, 0.92 after two, 1.08 after three
    assert ledger.spent() <= 1.0
    with pytest.raises(BudgetExhausted):
        ledger.reserve(99, [ROUND_SEGMENT], now=T0)


def test_reserving_a_round_twice(ledger_copy: Path) -> None:
    ledger = open_ledger(ledger_copy)
    existing = ledger.entries()[2]
    again = ledger.reserve(2, [ROUND_SEGMENT], now=T0 + timedelta(days=3))
    assert again == existing
    assert count_entries(ledger_copy) == 4
    with pytest.raises(StateError, match="round 2"):
        ledger.reserve(2, [Segment(2.0, 0.01, 100)], now=T0)


def test_restart_resumes_history_and_refuses_changed_terms(ledger_copy: Path) -> None:
    resumed = open_ledger(ledger_copy)
    assert len(resumed.entries()) == 4
    entry = resumed.reserve(4, [ROUND_SEGMENT], now=T0)
    assert entry.seq == 5
    assert entry.epsilon_after == pytest.approx(
        compose_epsilon([Segment(1.0, 0.01, 500)], delta=DELTA), rel=1e-9
    )
    for field, value in [
        ("budget_epsilon", 30.0),
        ("delta", 1e-6),
        ("accountant", "rdp"),
        ("privacy_unit", "record"),
        ("site_id", "hospital-b"),
    ]:
        with pytest.raises(ConfigError) as info:
            open_ledger(ledger_copy, **{field: value})
        assert info.value.field == field
    assert verify_ledger(ledger_copy).ok


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        open_ledger(tmp_path / "a.ledger", privacy_unit="encounter")
    assert info.value.field == "privacy_unit"
    ledger = open_ledger(tmp_path / "b.ledger")
    with pytest.raises(ConfigError) as info:
        ledger.reserve(1, [ROUND_SEGMENT], now=datetime(2026, 1, 1))
    assert info.value.field == "now"
    with pytest.raises(ConfigError) as info:
        ledger.reserve(1, [], now=T0)
    assert info.value.field == "segments"


# --- tampering -------------------------------------------------------------------------


def edit_epsilon(path: Path) -> None:
    with raw(path) as connection:
        connection.execute("UPDATE ledger_entries SET epsilon_after = 0.1 WHERE seq = 3")


def edit_epsilon_and_rehash(path: Path) -> None:
    """A careful forger: lowers round 2's epsilon and recomputes every hash."""
    with raw(path) as connection:
        connection.execute("UPDATE ledger_entries SET epsilon_after = 0.5 WHERE seq = 2")
        rows = connection.execute(
            "SELECT seq, round, segments, epsilon_after, accountant_used, created_at, status "
            "FROM ledger_entries ORDER BY seq"
        ).fetchall()
        prev = connection.execute("SELECT header_hash FROM ledger_header").fetchone()[0]
        for seq, round_number, segments, epsilon, used, created, status in rows:
            digest = entry_hash(
                seq=seq,
                round_number=round_number,
                segments_json=segments,
                epsilon_after=epsilon,
                accountant_used=used,
                created_at=created,
                status=status,
                prev_hash=prev,
            )
            connection.execute(
                "UPDATE ledger_entries SET prev_hash = ?, entry_hash = ? WHERE seq = ?",
                (prev, digest, seq),
            )
            prev = digest
        connection.execute("UPDATE ledger_header SET head_hash = ?", (prev,))


def delete_middle(path: Path) -> None:
    with raw(path) as connection:
        connection.execute("DELETE FROM ledger_entries WHERE seq = 2")


def delete_last(path: Path) -> None:
    with raw(path) as connection:
        connection.execute("DELETE FROM ledger_entries WHERE seq = 4")


def swap_rows(path: Path) -> None:
    with raw(path) as connection:
        connection.execute("UPDATE ledger_entries SET seq = -1 WHERE seq = 2")
        connection.execute("UPDATE ledger_entries SET seq = 2 WHERE seq = 3")
        connection.execute("UPDATE ledger_entries SET seq = 3 WHERE seq = -1")


def insert_row(path: Path) -> None:
    """A forger slips a correctly hashed extra round in after entry 2 (shifting 3, 4)."""
    with raw(path) as connection:
        connection.execute("UPDATE ledger_entries SET seq = seq + 10 WHERE seq >= 3")
        connection.execute("UPDATE ledger_entries SET seq = seq - 9 WHERE seq >= 13")
        segments, epsilon, used, created, prev = connection.execute(
            "SELECT segments, epsilon_after, accountant_used, created_at, entry_hash "
            "FROM ledger_entries WHERE seq = 2"
        ).fetchone()
        digest = entry_hash(
            seq=3,
            round_number=10,
            segments_json=segments,
            epsilon_after=epsilon,
            accountant_used=used,
            created_at=created,
            status="committed",
            prev_hash=prev,
        )
        connection.execute(
            "INSERT INTO ledger_entries VALUES (3, 10, ?, ?, ?, ?, 'committed', ?, ?)",
            (segments, epsilon, used, created, prev, digest),
        )


def edit_budget(path: Path) -> None:
    with raw(path) as connection:
        connection.execute("UPDATE ledger_header SET budget_epsilon = 100.0")


TAMPERINGS: dict[str, tuple[Callable[[Path], None], str]] = {
    "edit_epsilon": (edit_epsilon, "entry seq=3"),
    "edit_epsilon_and_rehash": (edit_epsilon_and_rehash, "entry seq=2"),
    "delete_middle": (delete_middle, "entry seq=3"),
    "delete_last": (delete_last, "header"),
    "swap_rows": (swap_rows, "entry seq=2"),
    "insert_row": (insert_row, "entry seq=4"),
    "edit_budget": (edit_budget, "header"),
}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "common.privacy.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_untouched_ledger_verifies_including_recomposed_epsilons(ledger_copy: Path) -> None:
    report = verify_ledger(ledger_copy)
    assert report.ok and report.epsilons_recomposed
    assert report.entries_checked == 4
    assert report.head_hash == open_ledger(ledger_copy).head_hash()
    result = run_cli("ledger", "verify", "--ledger", str(ledger_copy), "--hashes-only")
    assert result.returncode == 0, result.stderr
    assert "OK (4 entries" in result.stdout


@pytest.mark.parametrize("name", sorted(TAMPERINGS))
def test_tampering_is_detected(name: str, ledger_copy: Path) -> None:
    tamper, first_problem = TAMPERINGS[name]
    tamper(ledger_copy)
    report = verify_ledger(ledger_copy)
    assert not report.ok
    assert str(report.problems[0]).startswith(first_problem)
    with pytest.raises(LedgerIntegrityError):
        report.raise_if_broken()
    # The site itself refuses to go on with a broken ledger (hash checks on open).
    if name != "edit_epsilon_and_rehash":
        with pytest.raises(LedgerIntegrityError):
            open_ledger(ledger_copy)
    result = run_cli("ledger", "verify", "--ledger", str(ledger_copy))
    assert result.returncode != 0
    assert "INTEGRITY FAILURE" in result.stderr
    assert f"first problem: {first_problem}" in result.stderr


def test_read_ledger_and_verify_refuse_missing_or_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(StateError):
        verify_ledger(tmp_path / "missing.ledger")
    foreign = tmp_path / "foreign.db"
    with raw(foreign) as connection:
        connection.execute("CREATE TABLE t (x INTEGER)")
    with pytest.raises(StateError):
        read_ledger(foreign)


VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "privacy_ledger_hashes.json"


def test_hash_format_is_pinned() -> None:
    """Existing ledgers must keep verifying: the canonical encoding may not drift."""
    import hashlib
    import json

    vector = json.loads(VECTORS.read_text())
    header = dict(vector["header"])
    expected_header = header.pop("header_hash")
    assert header_hash(**header) == expected_header
    # The documented encoding, spelled out independently of the product code.
    documented = json.dumps(
        {"format": "medfed-privacy-ledger/1", **header}, sort_keys=True, separators=(",", ":")
    )
    assert hashlib.sha256(documented.encode()).hexdigest() == expected_header
    entry = dict(vector["entry"])
    expected_entry = entry.pop("entry_hash")
    segments = entry.pop("segments")
    assert entry["segments_json"] == json.dumps(segments, separators=(",", ":"))
    assert entry_hash(**entry) == expected_entry
