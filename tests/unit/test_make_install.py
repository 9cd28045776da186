"""What `make` installs into .venv is pinned and hash-checked on every path: uv from
requirements/bootstrap.lock, every package from requirements/dev.lock, and the pip
fallback from the same pins. Read from `make -n -B venv` (prints the commands, runs
nothing)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.e2e.harness import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")


def planned_commands() -> str:
    done = subprocess.run(["make", "-n", "-B", "venv"], cwd=REPO, capture_output=True,
                          text=True, check=True)
    return done.stdout.replace("\\\n", " ")


def installs(text: str) -> list[str]:
    """Each `pip install` / `uv pip install` in the plan, up to the next `&&`/`;`."""
    return [m.group(0) for m in re.finditer(r"(?:uv )?pip install[^;&|\n]*", text)]


def test_every_install_make_runs_checks_hashes_or_installs_the_checkout() -> None:
    commands = installs(planned_commands())
    assert len(commands) >= 5, commands  # bootstrap, uv, pip torch, pip lock, medfed
    for command in commands:
        if command.rstrip().endswith("-e ."):
            assert "--no-deps" in command, command  # medfed itself, resolving nothing
        elif "torch==2.13.0" in command:
            continue  # the pip fallback's torch, pinned; its lock entry is cut out
        else:
            assert "--require-hashes" in command, command
            assert re.search(r"-r \S+\.lock", command), command


def test_uv_installs_the_dev_lock_without_resolving_and_then_checks_it() -> None:
    text = planned_commands()
    assert re.search(r"uv pip install .*--no-deps --require-hashes .*-r "
                     r"requirements/dev\.lock", text), text
    assert "uv pip check" in text


def test_the_bootstrap_lock_pins_uv_with_hashes() -> None:
    lock = (REPO / "requirements" / "bootstrap.lock").read_text()
    pins = re.findall(r"^([a-z0-9-]+)==(\S+)", lock, flags=re.MULTILINE)
    assert [name for name, _ in pins] == ["uv"], pins
    assert len(re.findall(r"--hash=sha256:[0-9a-f]{64}", lock)) >= 1
