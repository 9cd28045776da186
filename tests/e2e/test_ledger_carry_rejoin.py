"""A site that carries its ledger into new terms rejoins its federation without an
operator at the coordinator, over real processes and mutual TLS: it trained a round (the
coordinator's replica holds its entries), stops, runs `medfed ledger carry`, starts
again, sends its whole carried history, is accepted (`ledger_carried`) and trains the
next round on top of the carried spend."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from common.pki import site_paths
from common.privacy.ledger import export_ledger, ledger_notes
from common.privacy.replica import export_from_state
from common.privacy.signed import SignedHistory
from common.processes import ManagedProcess, medfed_argv
from tests.e2e.harness import REPO, StudyProcesses, list_members, make_pki
from tests.study.helpers import hospital_csvs, study_toml

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

SITES = ["alpha", "beta", "gamma"]
NEW_BUDGET = "9"  # the sites' default is 8


def test_a_carried_ledger_is_accepted_and_trains_the_next_round(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    pki = make_pki(tmp_path, SITES)
    study_path = tmp_path / "study.toml"
    study_path.write_text(study_toml("ledger-carry", rounds=2))
    list_members(study_path, pki, SITES)
    files = hospital_csvs(tmp_path, SITES)
    run = StudyProcesses(tmp_path, study=study_path, pki=pki, processes=processes)
    coordinator = run.start_coordinator()

    # alpha trains round 1 and leaves (the coordinator, min 3 sites, waits for it).
    alpha = run.start_site("alpha", files["alpha"], "--exit-after-rounds", "1")
    others = [run.start_site(site, files[site]) for site in SITES[1:]]
    assert alpha.wait_exit(timeout=900) == 0, alpha.tail(30)
    ledger = run.site_state("alpha") / "privacy-ledger.db"
    before = export_ledger(ledger)
    replicated = SignedHistory.from_bytes(export_from_state("alpha", state=run.state))
    assert [e.entry_hash for e in replicated.entries] == [e.entry_hash for e in before.entries]
    spent = before.entries[-1].epsilon_after

    # The site's officer carries the ledger into a new budget, the site stopped.
    cert, key = site_paths(pki, "alpha")
    done = subprocess.run(
        medfed_argv("ledger", "carry", "--ledger", str(ledger), "--budget-epsilon",
                    NEW_BUDGET, "--cert", str(cert), "--key", str(key)),
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    carried = export_ledger(ledger)
    assert carried.terms != before.terms
    assert len(carried.entries) == len(before.entries)
    assert carried.head_hash != before.head_hash  # what the old replica called a fork
    assert any(note.startswith("CARRIED: ") for note in ledger_notes(ledger))

    # It starts again with the new budget: accepted, and it trains round 2.
    back = run.start_site("alpha", files["alpha"], "--budget-epsilon", NEW_BUDGET)
    event = coordinator.wait_event("ledger_carried", timeout=600, site="alpha")
    assert event["old_head"] == before.head_hash and event["new_head"] == carried.head_hash
    assert event["spent_before"] == pytest.approx(spent)
    assert back.wait_exit(timeout=900) == 0, back.tail(30)
    for proc in others:
        assert proc.wait_exit(timeout=300) == 0, proc.tail(30)
    # Its first report of the carried head was refused as a fork (the replica held the
    # old terms); the whole history it then sent was accepted as a carry.
    events = [line.get("event") for line in coordinator.lines
              if line.get("site") == "alpha" and str(line.get("event", "")).startswith("ledger_")]
    assert events == ["ledger_fork", "ledger_carried"]

    final = export_ledger(ledger)
    assert final.terms == carried.terms
    assert [e.entry_hash for e in final.entries[: len(carried.entries)]] == [
        e.entry_hash for e in carried.entries
    ]
    trained_before = max(e.round for e in before.entries if e.purpose == "training")
    assert max(e.round for e in final.entries if e.purpose == "training") > trained_before
    assert final.entries[-1].epsilon_after > spent  # composed on top of the carried spend
    replica = SignedHistory.from_bytes(export_from_state("alpha", state=run.state))
    # The replica holds the carried history and the round-2 entries after it.
    assert replica.terms == final.terms and len(replica.entries) > len(carried.entries)
    assert [e.entry_hash for e in replica.entries] == [
        e.entry_hash for e in final.entries[: len(replica.entries)]
    ]
