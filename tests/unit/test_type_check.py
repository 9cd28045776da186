"""The product type-checks under `mypy --strict` (pyproject.toml's [tool.mypy]).

Run here rather than as a serial step before the suite: on a fresh clone mypy takes
about a minute of one core with no cache, and inside pytest it runs beside the other
tests instead of in front of them. `make lint` runs the same command."""

from __future__ import annotations

import subprocess
import sys

from tests.e2e.harness import REPO

CHECKED = ("common", "coordinator", "site_agent", "demo")


def test_the_product_type_checks_under_strict_mypy() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", *CHECKED],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, f"mypy found problems:\n{done.stdout}{done.stderr}"
    assert "Success: no issues found" in done.stdout, done.stdout
