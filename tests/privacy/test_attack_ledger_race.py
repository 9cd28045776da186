"""A ledger's terms changed under a running site: the site (a real process holding its
state folder as `site_agent.runner.run_site` does, with its ledger open) went on
enforcing its old budget of 8 after the ledger was carried to 4, and `ledger verify`
passed the result. Now `ledger carry|migrate|restore` refuse while the site holds its
folder, `reserve` re-reads the ledger's terms in its own transaction, and `verify`
fails a spend above the budget. Real SQLite ledgers, real keys, the real CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from common.core.errors import ConfigError
from common.privacy.accountant import Segment
from common.privacy.carry import carried_history, carry_ledger
from common.privacy.ledger import (
    PrivacyLedger,
    anchor_path_for,
    export_ledger,
    read_ledger,
    verify_ledger,
    write_new_ledger,
)
from common.privacy.signed import LedgerTerms
from common.protocol import pki
from tests.privacy.conftest import Pki

DELTA = 1e-5
# Three rounds compose to epsilon 3.80, a fourth to 4.31, a sixth to 5.21 (PRV).
SEGMENT = Segment(1.0, 0.05, 40)
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

# A site agent's hold on its state folder and ledger (`run_site`, then `open_ledger`),
# recording one round's spend per line read, as the agent does before a release.
RUNNING_SITE = """
import datetime as dt
import json
import sys
from pathlib import Path

from common.core.errors import MedfedError
from common.privacy.accountant import Segment
from common.privacy.ledger import LedgerSigner, PrivacyLedger
from common.core.state_lock import StateLock

state, cert, key = (Path(arg) for arg in sys.argv[1:4])
lock = StateLock.acquire(state, role="site hospital-a")
ledger = PrivacyLedger(state / "privacy-ledger.db", site_id="hospital-a", budget_epsilon=8.0,
                       delta=1e-5, privacy_unit="patient",
                       signer=LedgerSigner.from_files(cert, key))
print(json.dumps({"held": str(state)}), flush=True)
for line in sys.stdin:
    number = int(line)
    try:
        entry = ledger.reserve(number, [Segment(1.0, 0.05, 40)],
                               now=dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
                               + dt.timedelta(hours=number))
        print(json.dumps({"epsilon": entry.epsilon_after}), flush=True)
    except MedfedError as exc:
        print(json.dumps({"refused": f"{type(exc).__name__}: {exc}"}), flush=True)
"""


class RunningSite:
    """The site process: `spend(n)` has it record round n's release on its ledger."""

    def __init__(self, state: Path, root: Path) -> None:
        cert, key = pki.site_paths(root, "hospital-a")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RUNNING_SITE, str(state), str(cert), str(key)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        assert self.reply() == {"held": str(state)}

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the site process exited ({self.proc.wait(30)})"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def spend(self, number: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{number}\n")
        self.proc.stdin.flush()
        return self.reply()

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    folder = tmp_path / "state"
    folder.mkdir(mode=0o700)
    return folder


@pytest.fixture
def site(state: Path, pki_material: Pki) -> Iterator[RunningSite]:
    running = RunningSite(state, pki_material.root)
    yield running
    running.stop()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "common.commands.privacy", *args],
                          capture_output=True, text=True, timeout=300, check=False)


def site_keys(pki_material: Pki) -> tuple[str, str]:
    cert, key = pki.site_paths(pki_material.root, "hospital-a")
    return str(cert), str(key)


def test_attack_carry_beside_a_running_site(
    state: Path, site: RunningSite, pki_material: Pki
) -> None:
    for number in (1, 2, 3):
        assert "epsilon" in site.spend(number)
    ledger = state / "privacy-ledger.db"
    before = export_ledger(ledger)
    cert, key = site_keys(pki_material)
    result = run_cli("ledger", "carry", "--ledger", str(ledger), "--budget-epsilon", "4",
                     "--cert", cert, "--key", key)
    assert result.returncode == 2, result.stdout
    assert "Traceback" not in result.stderr
    assert f"state folder {state} is in use by site hospital-a (pid {site.proc.pid}" in (
        result.stderr)
    assert "`medfed ledger carry` needs the site agent stopped" in result.stderr
    # Nothing moved: the running site's ledger, its terms and its anchor are as they were.
    after = export_ledger(ledger)
    assert after.terms == before.terms and after.head_hash == before.head_hash
    assert not ledger.with_name(f"{ledger.name}.terms-1").exists()
    # The site goes on under the terms it opened, within them.
    assert site.spend(4)["epsilon"] == pytest.approx(4.31, abs=0.01)

    # Stopped, the same carry goes through, and the site starts under the new budget.
    site.stop()
    result = run_cli("ledger", "carry", "--ledger", str(ledger), "--budget-epsilon", "5",
                     "--cert", cert, "--key", key)
    assert result.returncode == 0, result.stderr
    assert read_ledger(ledger)[0].budget_epsilon == 5.0


def test_migrate_and_restore_beside_a_running_site_are_refused(
    state: Path, site: RunningSite, pki_material: Pki, tmp_path: Path
) -> None:
    assert "epsilon" in site.spend(1)
    ledger = state / "privacy-ledger.db"
    cert, key = site_keys(pki_material)
    migrated = run_cli("ledger", "migrate", "--ledger", str(ledger), "--cert", cert,
                       "--key", key)
    export = tmp_path / "export.json"
    export.write_bytes(export_ledger(ledger).to_bytes())
    restored = run_cli("ledger", "restore", "--from", str(export), "--ledger",
                       str(state / "restored.db"), "--accept-unverified-head")
    for result, command in ((migrated, "migrate"), (restored, "restore")):
        assert result.returncode == 2, result.stdout
        assert f"in use by site hospital-a (pid {site.proc.pid}" in result.stderr
        assert f"`medfed ledger {command}` needs the site agent stopped" in result.stderr
    assert not (state / "restored.db").exists()


def test_attack_carry_committed_under_a_running_site_is_refused_by_its_next_reserve(
    state: Path, site: RunningSite, pki_material: Pki
) -> None:
    """A carry that did not go through the lock (another host on a shared folder, a
    tool of its own): the running site's next reserve reads the carried terms in its
    write transaction and refuses; before, it charged its old budget of 8 and took the
    new ledger to 4.31 and beyond."""
    for number in (1, 2, 3):
        assert "epsilon" in site.spend(number)
    ledger = state / "privacy-ledger.db"
    kept = ledger.with_name(f"{ledger.name}.terms-1")
    ledger.rename(kept)
    anchor_path_for(ledger).rename(anchor_path_for(kept))
    carry_ledger(kept, ledger, terms=LedgerTerms("hospital-a", 4.0, DELTA, "prv", "patient"),
                 signer=pki_material.signer_a, now=T0)
    carried = export_ledger(ledger)

    answer = site.spend(4)
    assert "refused" in answer, answer
    assert "LedgerUnavailable" in answer["refused"]
    assert "now holds other terms" in answer["refused"]
    assert "budget_epsilon 4.0 (opened with 8.0)" in answer["refused"]
    assert export_ledger(ledger).head_hash == carried.head_hash  # nothing recorded
    assert verify_ledger(ledger).ok


def test_attack_spend_above_the_budget_fails_verify(
    tmp_path: Path, pki_material: Pki
) -> None:
    """What the raced site left behind: a ledger under budget 4 whose signed entries
    take the spend to 5.21. `verify` (and `show`) fail it; a carry into a budget below
    the spend is refused, one that covers it is the way forward."""
    old = PrivacyLedger(tmp_path / "old.db", site_id="hospital-a", budget_epsilon=8.0,
                        delta=DELTA, privacy_unit="patient", signer=pki_material.signer_a)
    for number in range(1, 7):
        old.reserve(number, [SEGMENT], now=T0 + timedelta(hours=number))
    four = dataclasses.replace(old.terms, budget_epsilon=4.0)
    over = carried_history(old.terms, tuple(old.entries()), four, pki_material.signer_a,
                           now=T0)
    raced = tmp_path / "state" / "privacy-ledger.db"
    raced.parent.mkdir()
    write_new_ledger(raced, over)

    result = run_cli("ledger", "verify", "--ledger", str(raced), "--ca", str(pki_material.ca))
    assert result.returncode == 1, result.stdout
    assert "INTEGRITY FAILURE" in result.stderr
    assert "entry seq=4: the spend after it, epsilon 4.3" in result.stderr
    assert "above the ledger's budget 4" in result.stderr
    shown = run_cli("ledger", "show", "--ledger", str(raced))
    assert shown.returncode == 1 and "above the ledger's budget 4" in shown.stdout
    assert not verify_ledger(raced, check_budget=False).problems  # chain and signatures hold

    with pytest.raises(ConfigError, match=r"above the new budget 4: .* at least 5\.2075"):
        carry_ledger(old.path, tmp_path / "four.db", terms=four,
                     signer=pki_material.signer_a, now=T0)
    done = carry_ledger(raced, tmp_path / "six.db",
                        terms=dataclasses.replace(four, budget_epsilon=6.0),
                        signer=pki_material.signer_a, now=T0)
    assert verify_ledger(done.path).ok
