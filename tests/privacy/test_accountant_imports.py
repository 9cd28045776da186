"""Reporting an epsilon never imports torch or Opacus.

Every process that composes a ledger (a site, `medfed ledger show`/`verify`) imports the
accountant; torch alone costs seconds of CPU per process. Each check runs in a fresh
interpreter (`python -c`) and reads `sys.modules` after the work is done."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import Gaussian, Segment
from tests.privacy.conftest import Pki

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

HEAVY = ("torch", "opacus")
REPORT_HEAVY = (
    "import json, sys\n"
    f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
    "print('HEAVY=' + json.dumps(heavy))\n"
)


def _run(code: str) -> tuple[str, list[str]]:
    result = subprocess.run([sys.executable, "-c", code + REPORT_HEAVY], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines and lines[-1].startswith("HEAVY="), result.stdout
    return "\n".join(lines[:-1]), json.loads(lines[-1].removeprefix("HEAVY="))


def test_composing_in_every_accountant_imports_neither_torch_nor_opacus() -> None:
    output, heavy = _run(
        "from common.privacy import accountant as a\n"
        "from common.privacy.mechanisms import Gaussian, Segment\n"
        "history = [Segment(1.1, 0.02, 500), Gaussian(10.0, 1.0)]\n"
        "for name in ('prv', 'rdp'):\n"
        "    report = a.account(history, delta=1e-5, accountant=name)\n"
        "    print(report.accountant, report.epsilon)\n"
        "plan = a.plan_round_noise(history=history, budget_epsilon=8.0, delta=1e-5,\n"
        "                          sample_rate=0.02, steps_per_round=50, remaining_rounds=5)\n"
        "print('sigma', plan.noise_multiplier)\n"
    )
    prv_line, rdp_line, sigma_line = output.splitlines()
    assert prv_line.startswith("prv ") and float(prv_line.split()[1]) > 0
    assert rdp_line.startswith("rdp ") and float(rdp_line.split()[1]) > 0
    assert float(sigma_line.split()[1]) > 0
    assert heavy == []


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_ledger_show_and_verify_import_neither_torch_nor_opacus(
    tmp_path: Path, pki_material: Pki, accountant: str
) -> None:
    path = tmp_path / "privacy-ledger.db"
    ledger = PrivacyLedger(path, site_id="hospital-a", budget_epsilon=8.0, delta=1e-5,
                           accountant=accountant, privacy_unit="patient",
                           signer=pki_material.signer_a)
    ledger.reserve(0, [Gaussian(10.0, 1.0)], now=T0, purpose="count")
    for number in range(1, 4):
        ledger.reserve(number, [Segment(1.2, 0.02, 50)], now=T0 + timedelta(hours=number))
    spent = ledger.spent()
    output, heavy = _run(
        "from common.commands.cli import main\n"
        f"assert main(['ledger', 'show', '--ledger', {str(path)!r}, '--json']) == 0\n"
        f"assert main(['ledger', 'verify', '--ledger', {str(path)!r}]) == 0\n"
    )
    shown = json.loads(output[: output.rindex("}") + 1])
    assert float(shown["spent_epsilon"]) == pytest.approx(spent, rel=1e-12)
    assert heavy == []
