"""One process per state folder (`common.core.state_lock`), with real processes: a holder
that is a separate interpreter, killed with SIGKILL to show no stale lock remains."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from common.core.errors import StateError
from common.core.state_lock import LOCK_FILE, StateLock

HOLDER = """
import sys
from pathlib import Path
from common.core.state_lock import StateLock
lock = StateLock.acquire(Path(sys.argv[1]), role="coordinator")
print("held", flush=True)
sys.stdin.read()
"""


def start_holder(folder: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_process_on_the_same_state_folder_is_refused_naming_the_holder(
    tmp_path: Path,
) -> None:
    holder = start_holder(tmp_path)
    try:
        with pytest.raises(StateError) as refused:
            StateLock.acquire(tmp_path, role="coordinator")
        message = str(refused.value)
        assert str(tmp_path) in message
        assert f"pid {holder.pid}" in message and socket.gethostname() in message
        assert "coordinator" in message
    finally:
        holder.kill()
        holder.wait(30)


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    holder = start_holder(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait(30)
    with StateLock.acquire(tmp_path, role="site a") as lock:
        assert lock.folder == tmp_path
        assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_FILE).read_text()


def test_a_released_lock_can_be_taken_again_in_the_same_process(tmp_path: Path) -> None:
    first = StateLock.acquire(tmp_path, role="coordinator")
    with pytest.raises(StateError, match="in use by coordinator"):
        StateLock.acquire(tmp_path, role="coordinator")
    first.release()
    first.release()  # idempotent
    StateLock.acquire(tmp_path, role="coordinator").release()


def test_an_unwritable_state_folder_is_a_clear_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(StateError, match="state folder writable"):
            StateLock.acquire(tmp_path, role="coordinator")
    finally:
        tmp_path.chmod(0o700)
