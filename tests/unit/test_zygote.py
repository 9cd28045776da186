"""tests/zygote.py's children behave as fresh `python -m` interpreters do: the same
argv, environment, directory, path, stdio, atexit handlers and exit status, compared
with `subprocess.Popen` on the same probe module (real processes both ways)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.core.processes import Launcher, ManagedProcess, launched_by, popen
from tests.zygote import ForkedProcess, Zygote

PROBE = "tests.unit.zygote_probe"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def zygote(zygote_server: Zygote) -> Zygote:
    """The worker's own (tests/conftest.py), whether or not the suite forks from it."""
    return zygote_server


def start(launcher: Launcher, tmp_path: Path, *args: str, env: dict[str, str] | None = None,
          name: str = "probe") -> ManagedProcess:
    """The probe in tmp_path (this checkout reached through PYTHONPATH, as a fresh
    interpreter there needs)."""
    with launched_by(launcher):
        return ManagedProcess(
            name, [sys.executable, "-m", PROBE, *args], log_dir=tmp_path, cwd=tmp_path,
            env={"ZYGOTE_PROBE": "yes", "PYTHONPATH": str(REPO), **(env or {})},
        )


def report(proc: ManagedProcess) -> dict[str, object]:
    event = dict(proc.wait_event("started", timeout=60))
    event.pop("pid")
    return event


def test_a_forked_child_starts_and_exits_as_a_fresh_interpreter(
    zygote: Zygote, tmp_path: Path
) -> None:
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "probe_extra.py").write_text("VALUE = 'from PYTHONPATH'\n")
    env = {"PYTHONPATH": f"{tmp_path / 'extra'}:{REPO}"}
    fresh = start(popen, tmp_path, "3", "probe_extra", env=env, name="fresh")
    forked = start(zygote.launch, tmp_path, "3", "probe_extra", env=env, name="forked")
    assert isinstance(forked.proc, ForkedProcess)
    assert fresh.wait_exit(60) == forked.wait_exit(60) == 3
    fresh.stop()
    forked.stop()
    expected = report(fresh)
    assert expected["imported"] == "from PYTHONPATH"
    assert expected["cwd"] == str(tmp_path) and expected["probe_env"] == "yes"
    assert report(forked) == expected
    for proc in (fresh, forked):
        assert {"event": "atexit"} in proc.lines
        assert {"text": "to stderr"} in proc.lines


def test_an_uncaught_exception_exits_1_with_its_traceback(zygote: Zygote, tmp_path: Path) -> None:
    proc = start(zygote.launch, tmp_path, "raise")
    assert proc.wait_exit(60) == 1
    proc.stop()
    texts = [line.get("text", "") for line in proc.lines]
    assert any(text.startswith("Traceback") for text in texts)
    assert "ValueError: probe failed on purpose" in texts


def test_signals_reach_the_child_and_its_status_says_which(zygote: Zygote, tmp_path: Path) -> None:
    proc = start(zygote.launch, tmp_path, "wait")
    proc.wait_event("started", timeout=60)
    proc.proc.send_signal(signal.SIGSTOP)
    assert proc.proc.poll() is None  # stopped, not ended
    with pytest.raises(subprocess.TimeoutExpired):
        proc.proc.wait(timeout=0.2)
    proc.proc.send_signal(signal.SIGCONT)
    proc.proc.terminate()
    assert proc.wait_exit(60) == -signal.SIGTERM
    proc.stop()
    assert {"event": "atexit"} not in proc.lines  # killed by the signal, as Popen's child


def test_anything_but_python_dash_m_starts_with_popen(zygote: Zygote, tmp_path: Path) -> None:
    proc = zygote.launch(["bash", "-c", "echo plain; exit 4"], {"PATH": "/usr/bin:/bin"},
                         tmp_path)
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(timeout=60) == 4
    assert proc.stdout is not None and proc.stdout.read() == "plain\n"
