"""An error no command expected is one log record at level error with its cause and
exit code 1, not a traceback spread over many info lines (a real `medfed` interpreter
with JSON logs on a real stderr pipe)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import argparse, sys
    from common.commands.cli import run_parsed
    from common.core.logs import configure_logging

    def fails(_args):
        if sys.argv[1] == "disk":
            with open(sys.argv[2], "w") as handle:  # a folder: IsADirectoryError
                handle.write("x")
        raise RuntimeError("the engine met a state it has no rule for")

    configure_logging("coordinator", fmt="json")
    sys.exit(run_parsed(argparse.Namespace(func=fails)))
""")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )


def records(stderr: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stderr.splitlines() if line.strip()]


def test_an_unexpected_error_is_one_error_record_and_exit_code_1() -> None:
    done = run("bug")
    assert done.returncode == 1
    found = records(done.stderr)  # every line is JSON: no raw traceback lines
    errors = [r for r in found if r["level"] == "error"]
    assert errors[0]["msg"] == ("unexpected RuntimeError: the engine met a state it has "
                                "no rule for")
    assert "Traceback" in str(errors[0]["exc"])  # the cause travels inside the record
    assert not [r for r in found if r["level"] == "info"]


def test_a_file_system_fault_names_the_path(tmp_path: Path) -> None:
    done = run("disk", str(tmp_path))
    assert done.returncode == 1
    found = records(done.stderr)
    assert any(r["level"] == "error" and str(tmp_path) in str(r["msg"]) for r in found)
    assert "Traceback" not in done.stderr
