"""A ledger no one can quietly reset, with real processes over
mutual TLS: a site that trained a round loses its ledger (deleted; replaced by a shorter
valid history; replaced by a fresh one over the site's state or over a lost state) and
is refused each time, by itself or by the
coordinator's replica with FAILED_PRECONDITION; `medfed ledger export` at the
coordinator and `medfed ledger restore` at the site recover it, and the site rejoins and
trains on with its spend intact."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from common.pki import load_certificate
from common.privacy.ledger import anchor_path_for, export_ledger, read_anchor, restore_ledger
from common.privacy.ledger_verify import verify_ledger
from common.privacy.signed import SignedHistory
from common.processes import ManagedProcess, medfed_argv
from tests.e2e.harness import REPO, StudyProcesses, list_members, make_pki
from tests.study.helpers import hospital_csvs, study_toml

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

SITES = ["alpha", "beta", "gamma"]
REFUSED = 2  # `medfed site run` on a MedfedError: one line on stderr, exit code 2


def medfed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(medfed_argv(*args), cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)


def last_epsilon(history: SignedHistory) -> float:
    return history.entries[-1].epsilon_after if history.entries else 0.0


def test_reset_ledgers_are_refused_and_a_restore_keeps_the_spend(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    pki = make_pki(tmp_path, SITES)
    study_path = tmp_path / "study.toml"
    study_path.write_text(study_toml("ledger-reset", rounds=2))
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
    restore_ledger(shorter, elsewhere)
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
    result = medfed("ledger", "restore", "--from", str(export), "--ledger", str(ledger),
                    "--ca", str(pki / "ca.crt"), "--site", "alpha")
    assert result.returncode == 0, result.stderr
    assert "LOWER bound" in result.stdout
    restored = export_ledger(ledger)
    assert [e.entry_hash for e in restored.entries] == [e.entry_hash for e in trained.entries]
    assert last_epsilon(restored) == spent  # the spend is back, not reset
    # What `medfed ledger verify --ca` checks (that command runs in tests/privacy and the
    # demo test), in this process: a `medfed` process costs seconds of CPU to start.
    verified = verify_ledger(ledger, ca_certificate=load_certificate(pki / "ca.crt"),
                             anchor_path=anchor)
    assert verified.ok and verified.ca_checked and verified.epsilons_recomposed, \
        verified.problems

    # The site rejoins, trains round 2 and the study finishes for everyone.
    back = site("alpha")
    assert back.wait_exit(timeout=900) == 0, back.tail(30)
    for proc in others:
        assert proc.wait_exit(timeout=300) == 0, proc.tail(30)
    final = export_ledger(ledger)
    assert [e.entry_hash for e in final.entries[: len(trained.entries)]] == [
        e.entry_hash for e in trained.entries
    ]
    assert [e.round for e in final.entries if e.purpose == "training"] == [
        *(e.round for e in trained.entries if e.purpose == "training"),
        max(e.round for e in final.entries),
    ]
    assert last_epsilon(final) > spent  # composed on top of the restored history
