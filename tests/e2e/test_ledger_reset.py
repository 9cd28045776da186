"""A ledger no one can quietly reset, and one carried into new terms, with real processes
over mutual TLS, in one federation (a three-round study):

* a site that trained a round loses its ledger (deleted; replaced by a shorter valid
  history; replaced by a fresh one over the site's state or over a lost state) and is
  refused each time, by itself or by the coordinator's replica with FAILED_PRECONDITION;
  `medfed ledger export` at the coordinator and `medfed ledger restore` at the site
  recover it, and the site rejoins and trains on with its spend intact;
* that site then carries its ledger into new terms (`medfed ledger carry`, stopped),
  starts again, sends its whole carried history, is accepted without an operator at the
  coordinator (`ledger_carried`) and trains the next round on top of the carried spend.

One federation for both: each part needs a site that trained and left while the others
wait, and a federation of real DP sites costs a process start of torch and Opacus per
site."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from common.core.processes import ManagedProcess, medfed_argv
from common.privacy.ledger import (
    anchor_path_for,
    export_ledger,
    ledger_notes,
    read_anchor,
    restore_ledger,
)
from common.privacy.ledger_verify import verify_ledger
from common.privacy.replica import export_from_state
from common.privacy.signed import SignedHistory
from common.protocol.pki import load_certificate, site_paths
from tests.e2e.harness import REPO, StudyProcesses, list_members, make_pki
from tests.study.helpers import hospital_csvs, study_toml

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

SITES = ["alpha", "beta", "gamma"]
REFUSED = 2  # `medfed site run` on a MedfedError: one line on stderr, exit code 2
NEW_BUDGET = "9"  # the sites' default is 8


def medfed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(medfed_argv(*args), cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)


def last_epsilon(history: SignedHistory) -> float:
    return history.entries[-1].epsilon_after if history.entries else 0.0


def test_reset_ledgers_are_refused_a_restore_keeps_the_spend_and_a_carry_rejoins(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    pki = make_pki(tmp_path, SITES)
    study_path = tmp_path / "study.toml"
    study_path.write_text(study_toml("ledger-reset", rounds=3))
    list_members(study_path, pki, SITES)
    files = hospital_csvs(tmp_path, SITES)
    run = StudyProcesses(tmp_path, study=study_path, pki=pki, processes=processes)
    coordinator = run.start_coordinator()
    state = run.state

    def site(name: str, *extra: str) -> ManagedProcess:
        return run.start_site(name, files[name], *extra)

    def refusal(proc: ManagedProcess) -> str:
        """The one error line of a site that refused to go on (exit code 2)."""
        line = proc.wait_log("medfed: error:", timeout=300)
        assert proc.wait_exit(timeout=120) == REFUSED, proc.tail(30)
        proc.stop()  # joins its output readers: every line is in
        texts = [str(item.get("msg", item.get("text", ""))) for item in proc.lines]
        assert not any("Traceback" in text for text in texts)
        return str(line.get("msg", line.get("text", "")))

    # alpha takes part in the statistics round and training round 1, then leaves; the
    # coordinator (min 3 sites) waits for it to come back for round 2.
    alpha = site("alpha", "--exit-after-rounds", "1")
    others = [site("beta"), site("gamma")]
    assert alpha.wait_exit(timeout=900) == 0, alpha.tail(30)
    ledger = run.site_state("alpha") / "privacy-ledger.db"
    anchor = anchor_path_for(ledger)
    trained = export_ledger(ledger)
    purposes = [entry.purpose for entry in trained.entries]
    assert "training" in purposes and "statistics" in purposes
    spent = last_epsilon(trained)
    assert spent > 0
    assert read_anchor(anchor) is not None

    # 1. The ledger file is deleted (its anchor stays): the site refuses to start at zero,
    # naming the file and the way out.
    ledger.unlink()
    message = refusal(site("alpha"))
    assert str(ledger) in message and "refuses to start again at zero" in message
    assert "medfed ledger export --site" in message and "medfed ledger restore" in message
    assert not ledger.exists()

    # 2. It is replaced by a shorter history that verifies on its own: refused (the
    # anchor records more entries).
    shorter = SignedHistory(trained.terms, trained.entries[:-1], trained.certificates)
    elsewhere = tmp_path / "older" / "privacy-ledger.db"
    elsewhere.parent.mkdir()
    restore_ledger(shorter, elsewhere, accept_unverified_head=True)
    elsewhere.replace(ledger)
    message = refusal(site("alpha"))
    assert str(ledger) in message and "older, truncated or reset copy" in message
    assert "medfed ledger restore" in message
    ledger.unlink()

    # 3. Ledger and anchor both gone, the rest of the state still there (the DP cohort
    # count it released once): the site refuses to start a new ledger over that history.
    anchor.unlink()
    message = refusal(site("alpha"))
    assert str(ledger) in message and "shows history" in message
    assert "cohort-count.json" in message and "medfed ledger restore" in message
    assert not ledger.exists() and not anchor.exists()

    # 3b. The whole state folder lost, the certificate kept: only the coordinator's
    # replica knows. It refuses the fresh ledger with FAILED_PRECONDITION; the site stops.
    count_file = ledger.parent / "cohort-count.json"
    saved_count = count_file.read_bytes()
    count_file.unlink()
    message = refusal(site("alpha"))
    assert "FAILED_PRECONDITION" in message and "medfed ledger restore" in message
    fork = coordinator.wait_event("ledger_fork", timeout=60, site="alpha")
    assert "alpha" in str(fork.get("msg", ""))
    assert len(export_ledger(ledger).entries) < len(trained.entries)  # the fresh ledger
    # The operator moves the fresh ledger aside and puts back the state folder's backup.
    ledger.unlink()
    anchor.unlink(missing_ok=True)
    (ledger.parent / "cohort-count.json").write_bytes(saved_count)

    # 4. Recovery: export the replica at the coordinator, restore it at the site.
    export = tmp_path / "alpha-export.json"
    result = medfed("ledger", "export", "--site", "alpha", "--state", str(state),
                    "--out", str(export))
    assert result.returncode == 0, result.stderr
    # This site kept no receipts (the default) and its anchor went with the ledger:
    # nothing shows the export is complete, so the restore needs the explicit override,
    # and the coordinator's replica is what checks the head when the site enrols again.
    result = medfed("ledger", "restore", "--from", str(export), "--ledger", str(ledger),
                    "--ca", str(pki / "ca.crt"), "--site", "alpha")
    assert result.returncode == 2 and "--accept-unverified-head" in result.stderr
    result = medfed("ledger", "restore", "--from", str(export), "--ledger", str(ledger),
                    "--ca", str(pki / "ca.crt"), "--site", "alpha", "--accept-unverified-head")
    assert result.returncode == 0, result.stderr
    assert "LOWER bound" in result.stdout
    assert "COMPLETENESS NOT VERIFIED" in result.stderr
    restored = export_ledger(ledger)
    assert [e.entry_hash for e in restored.entries] == [e.entry_hash for e in trained.entries]
    assert last_epsilon(restored) == spent  # the spend is back, not reset
    # What `medfed ledger verify --ca` checks (that command runs in tests/privacy and the
    # demo test), in this process: a `medfed` process costs seconds of CPU to start.
    verified = verify_ledger(ledger, ca_certificate=load_certificate(pki / "ca.crt"),
                             anchor_path=anchor)
    assert verified.ok and verified.ca_checked and verified.epsilons_recomposed, \
        verified.problems

    # The site rejoins, trains round 2 and leaves again (the coordinator waits for it).
    back = site("alpha", "--exit-after-rounds", "1")
    assert back.wait_exit(timeout=900) == 0, back.tail(30)
    final = export_ledger(ledger)
    assert [e.entry_hash for e in final.entries[: len(trained.entries)]] == [
        e.entry_hash for e in trained.entries
    ]
    assert [e.round for e in final.entries if e.purpose == "training"] == [
        *(e.round for e in trained.entries if e.purpose == "training"),
        max(e.round for e in final.entries),
    ]
    assert last_epsilon(final) > spent  # composed on top of the restored history

    # 5. The site's officer carries the ledger into a new budget, the site stopped; the
    # coordinator's replica holds its entries.
    before = final
    replicated = SignedHistory.from_bytes(export_from_state("alpha", state=state))
    assert [e.entry_hash for e in replicated.entries] == [e.entry_hash for e in before.entries]
    spent = before.entries[-1].epsilon_after
    cert, key = site_paths(pki, "alpha")
    result = medfed("ledger", "carry", "--ledger", str(ledger), "--budget-epsilon",
                    NEW_BUDGET, "--cert", str(cert), "--key", str(key))
    assert result.returncode == 0, result.stderr
    carried = export_ledger(ledger)
    assert carried.terms != before.terms
    assert len(carried.entries) == len(before.entries)
    assert carried.head_hash != before.head_hash  # what the old replica called a fork
    assert any(note.startswith("CARRIED: ") for note in ledger_notes(ledger))

    # It starts again with the new budget: accepted, and it trains round 3; the study
    # finishes for everyone.
    heard = len(coordinator.lines)
    again = site("alpha", "--budget-epsilon", NEW_BUDGET)
    event = coordinator.wait_event("ledger_carried", timeout=600, site="alpha")
    assert event["old_head"] == before.head_hash and event["new_head"] == carried.head_hash
    assert event["spent_before"] == pytest.approx(spent)
    assert again.wait_exit(timeout=900) == 0, again.tail(30)
    for proc in others:
        assert proc.wait_exit(timeout=300) == 0, proc.tail(30)
    # Its first report of the carried head was refused as a fork (the replica held the
    # old terms); the whole history it then sent was accepted as a carry.
    events = [line.get("event") for line in coordinator.lines[heard:]
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
    replica = SignedHistory.from_bytes(export_from_state("alpha", state=state))
    # The replica holds the carried history and the round-3 entries after it.
    assert replica.terms == final.terms and len(replica.entries) > len(carried.entries)
    assert [e.entry_hash for e in replica.entries] == [
        e.entry_hash for e in final.entries[: len(replica.entries)]
    ]
