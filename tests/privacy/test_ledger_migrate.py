"""`medfed ledger migrate`: a real format-1 SQLite ledger (built here with the format-1
schema and hashes the migration module keeps) signed into format 2 with a real site
certificate key, with nothing lost; and a format-1 file refused everywhere else with
an error naming the file and the command."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from common.core.errors import ConfigError, LedgerIntegrityError, LedgerUnavailable
from common.privacy import migrate
from common.privacy.accountant import Segment, compose_epsilon
from common.privacy.ledger import (
    PrivacyLedger,
    anchor_path_for,
    export_ledger,
    read_anchor,
    read_ledger,
    verify_ledger,
)
from common.privacy.signed import LedgerSigner
from common.protocol import pki
from tests.privacy.conftest import Pki

DELTA = 1e-5
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
# Rounds of different noise, sampling rate and length, so a segment carried to the wrong
# entry would change the composed epsilon.
SEGMENTS = (Segment(1.0, 0.01, 100), Segment(1.3, 0.02, 50), Segment(0.9, 0.01, 120))
REPO = Path(__file__).resolve().parents[2]
VECTORS = REPO / "tests" / "vectors" / "privacy_ledger_hashes.json"


def write_format1_ledger(path: Path, site_id: str = "hospital-a") -> list[float]:
    """A ledger exactly as format 1 wrote it (unsigned, hash-chained, WAL), on SQLite."""
    genesis = migrate.header_hash(site_id=site_id, budget_epsilon=3.0, delta=DELTA,
                                  accountant="prv", privacy_unit="patient")
    epsilons = []
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        connection.execute("PRAGMA journal_mode=WAL")
        for statement in migrate.FORMAT1_SCHEMA.split(";"):
            if statement.strip():
                connection.execute(statement)
        previous = genesis
        for seq, segment in enumerate(SEGMENTS, start=1):
            epsilon = compose_epsilon(list(SEGMENTS[:seq]), delta=DELTA)
            epsilons.append(epsilon)
            segments = migrate.segments_to_json([segment])
            created = (T0 + timedelta(hours=seq)).isoformat()
            digest = migrate.entry_hash(seq=seq, round_number=seq - 1, segments_json=segments,
                                        epsilon_after=epsilon, accountant_used="prv",
                                        created_at=created, status="committed",
                                        prev_hash=previous)
            connection.execute(
                "INSERT INTO ledger_entries VALUES (?, ?, ?, ?, 'prv', ?, 'committed', ?, ?)",
                (seq, seq - 1, segments, epsilon, created, previous, digest),
            )
            previous = digest
        connection.execute(
            "INSERT INTO ledger_header VALUES (1, ?, ?, 3.0, ?, 'prv', 'patient', ?, ?, ?)",
            (migrate.LEDGER_FORMAT, site_id, DELTA, genesis, len(SEGMENTS), previous),
        )
    finally:
        connection.close()
    return epsilons


def format1_rows(path: Path) -> list[tuple[object, ...]]:
    connection = sqlite3.connect(path)
    try:
        return connection.execute(
            "SELECT seq, round, segments, epsilon_after, created_at FROM ledger_entries "
            "ORDER BY seq"
        ).fetchall()
    finally:
        connection.close()


def test_format1_ledger_is_refused_naming_the_file_and_the_command(
    tmp_path: Path, pki_material: Pki
) -> None:
    path = tmp_path / "old.ledger"
    write_format1_ledger(path)
    for attempt in (
        lambda: read_ledger(path),
        lambda: verify_ledger(path),
        lambda: export_ledger(path),
        lambda: PrivacyLedger(path, site_id="hospital-a", budget_epsilon=3.0, delta=DELTA,
                              accountant="prv", privacy_unit="patient",
                              signer=pki_material.signer_a),
    ):
        with pytest.raises(LedgerUnavailable) as info:
            attempt()
        assert str(path) in str(info.value)
        assert f"medfed ledger migrate --ledger {path}" in str(info.value)
    assert format1_rows(path)[0][0] == 1  # refused, not touched


def test_migration_carries_every_entry_and_the_composed_epsilon(
    tmp_path: Path, pki_material: Pki
) -> None:
    path = tmp_path / "site.ledger"
    epsilons = write_format1_ledger(path)
    before = format1_rows(path)
    done = migrate.migrate_ledger(path, pki_material.signer_a)
    assert done is not None and done.entries == len(SEGMENTS)
    assert done.spent_epsilon == epsilons[-1]

    header, entries = read_ledger(path)
    assert (header.site_id, header.budget_epsilon, header.delta, header.privacy_unit) == (
        "hospital-a", 3.0, DELTA, "patient"
    )
    assert [(e.seq, e.round, e.created_at) for e in entries] == [
        (row[0], row[1], row[4]) for row in before
    ]
    assert [e.mechanisms for e in entries] == [(s,) for s in SEGMENTS]
    assert [e.purpose for e in entries] == ["training"] * len(SEGMENTS)
    assert [e.epsilon_after for e in entries] == epsilons
    # The composed epsilon of the migrated history, recomputed from its mechanisms, is
    # the one format 1 recorded (verify recomposes every entry).
    assert compose_epsilon([m for e in entries for m in e.mechanisms], delta=DELTA) == (
        pytest.approx(epsilons[-1], rel=1e-9)
    )
    report = verify_ledger(path, ca_certificate=pki.load_certificate(pki_material.ca),
                           anchor_path=anchor_path_for(path))
    assert report.ok and report.epsilons_recomposed
    assert report.signatures_checked == len(SEGMENTS) and report.format == 2
    anchor = read_anchor(anchor_path_for(path))
    assert anchor is not None and (anchor.seq, anchor.head_hash) == (3, done.head_hash)

    # The original is kept, intact, for audit; no write-ahead log of it is left behind.
    assert format1_rows(done.backup_path) == before
    assert not Path(f"{path}-wal").exists()

    # The site opens and records on the migrated ledger; a second migrate is a no-op.
    ledger = PrivacyLedger(path, site_id="hospital-a", budget_epsilon=3.0, delta=DELTA,
                           accountant="prv", privacy_unit="patient",
                           signer=pki_material.signer_a)
    assert ledger.spent() == epsilons[-1]
    ledger.reserve(3, [SEGMENTS[0]], now=T0 + timedelta(days=1))
    assert migrate.migrate_ledger(path, pki_material.signer_a) is None
    assert verify_ledger(path).ok


def test_migration_refuses_another_sites_key_and_a_broken_chain(
    tmp_path: Path, pki_material: Pki
) -> None:
    path = tmp_path / "site.ledger"
    write_format1_ledger(path)
    with pytest.raises(ConfigError) as info:
        migrate.migrate_ledger(path, pki_material.signer_b)
    assert info.value.field == "signer" and "hospital-a" in str(info.value)
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        connection.execute("UPDATE ledger_entries SET epsilon_after = 0.01 WHERE seq = 3")
    finally:
        connection.close()
    with pytest.raises(LedgerIntegrityError, match="seq=3"):
        migrate.migrate_ledger(path, pki_material.signer_a)
    assert not path.with_name(path.name + migrate.BACKUP_SUFFIX).exists()
    assert not anchor_path_for(path).exists()
    assert format1_rows(path)[2][3] == 0.01


def test_migrate_command(tmp_path: Path, pki_material: Pki) -> None:
    path = tmp_path / "site.ledger"
    epsilons = write_format1_ledger(path)
    cert, key = pki.site_paths(pki_material.root, "hospital-a")
    command = [sys.executable, "-m", "common.commands.privacy", "ledger", "migrate",
               "--ledger", str(path), "--cert", str(cert), "--key", str(key)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert f"migrated {path} to format 2: 3 entries" in done.stdout
    assert f"{epsilons[-1]:.4f}" in done.stdout
    signer = LedgerSigner.from_files(cert, key)
    assert {e.cert_sha256 for e in read_ledger(path)[1]} == {signer.cert_sha256}
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120,
                           check=False)
    assert again.returncode == 0 and "already format 2" in again.stdout


def test_format1_hash_encoding_is_pinned() -> None:
    """Format-1 ledgers must keep migrating: their encoding may not drift."""
    vector = json.loads(VECTORS.read_text())
    header = dict(vector["header"])
    expected_header = header.pop("header_hash")
    assert migrate.header_hash(**header) == expected_header
    documented = json.dumps(
        {"format": "medfed-privacy-ledger/1", **header}, sort_keys=True, separators=(",", ":")
    )
    assert hashlib.sha256(documented.encode()).hexdigest() == expected_header
    entry = dict(vector["entry"])
    expected_entry = entry.pop("entry_hash")
    segments = entry.pop("segments")
    assert entry["segments_json"] == json.dumps(segments, separators=(",", ":"))
    assert migrate.entry_hash(**entry) == expected_entry
