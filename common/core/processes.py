"""Child processes that speak JSON lines: the demo, benchmarks and end-to-end tests
start a coordinator and site agents this way and wait on what they print.

Each line of stdout/stderr is parsed as JSON when it can be (events on stdout,
structured logs on stderr) and kept; `wait_for` blocks on a condition over those
lines, woken by the reader threads (no polling, no sleeps).

A process is started by a launcher: `subprocess.Popen` unless a caller swaps in another
with `launched_by` (the test suite forks its `python -m` processes from an interpreter
that has imported torch once, tests/zygote.py). Anything that has a `ChildProcess`'s
pid, pipes, poll/wait and signals will do.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Protocol

from common.core.errors import ValidationError
from common.core.parsing import parse_json

Line = dict[str, Any]


class ChildProcess(Protocol):
    """What ManagedProcess needs of a started process (`subprocess.Popen` has it)."""

    pid: int
    returncode: int | Any
    stdout: IO[str] | None
    stderr: IO[str] | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


Launcher = Callable[[list[str], dict[str, str], "Path | None"], ChildProcess]


def popen(argv: list[str], env: dict[str, str], cwd: Path | None) -> subprocess.Popen[str]:
    """Start `argv` with its stdout and stderr piped back as text."""
    return subprocess.Popen(  # noqa: S603 - argv is built by us, no shell
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
    )


_launcher: Launcher = popen


@contextmanager
def launched_by(launcher: Launcher) -> Iterator[None]:
    """Start the ManagedProcesses created inside the block with `launcher`."""
    global _launcher
    previous, _launcher = _launcher, launcher
    try:
        yield
    finally:
        _launcher = previous


def medfed_argv(*args: str) -> list[str]:
    """argv running the `medfed` command with this interpreter."""
    return [sys.executable, "-m", "common.commands.cli", *args]


class ManagedProcess:
    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_dir: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        on_line: Callable[[str, Line], None] | None = None,
    ) -> None:
        self.name = name
        self.lines: list[Line] = []
        self._cond = threading.Condition()
        self._on_line = on_line
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log: IO[str] = open(log_dir / f"{name}.log", "a", encoding="utf-8")  # noqa: SIM115
        self._log_lock = threading.Lock()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: ChildProcess = _launcher(list(argv), full_env, cwd)
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr,), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _read(self, stream: IO[str] | None) -> None:
        if stream is None:
            return
        for raw in stream:
            with self._log_lock:
                self._log.write(raw)
                self._log.flush()
            try:
                item = parse_json(raw)
            except ValidationError:
                item = None
            line: Line = item if isinstance(item, dict) else {"text": raw.rstrip()}
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
            if self._on_line is not None:
                self._on_line(self.name, line)
        with self._cond:
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_for(
        self, predicate: Callable[[Line], bool], *, timeout: float, what: str, start: int = 0
    ) -> Line:
        """Block until a line (from index `start` on) satisfies `predicate`;
        RuntimeError on exit or timeout."""
        deadline = time.monotonic() + timeout
        seen = start
        with self._cond:
            while True:
                for item in self.lines[seen:]:
                    if predicate(item):
                        return item
                seen = len(self.lines)
                if not self.alive and all(not t.is_alive() for t in self._threads):
                    raise RuntimeError(
                        f"{self.name} exited ({self.proc.returncode}) before {what}\n{self.tail()}"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RuntimeError(f"timed out waiting for {self.name}: {what}\n{self.tail()}")
                self._cond.wait(min(remaining, 1.0))

    def wait_log(self, fragment: str, *, timeout: float = 60) -> Line:
        return self.wait_for(
            lambda e: fragment in str(e.get("msg", e.get("text", ""))),
            timeout=timeout,
            what=repr(fragment),
        )

    def wait_event(self, event: str, *, timeout: float = 60, **fields: Any) -> Line:
        return self.wait_for(
            lambda e: e.get("event") == event and all(e.get(k) == v for k, v in fields.items()),
            timeout=timeout,
            what=f"event {event} {fields}",
        )

    def tail(self, n: int = 15) -> str:
        with self._cond:
            return "\n".join(json.dumps(x) for x in self.lines[-n:])

    def kill9(self) -> None:
        """SIGKILL: the process gets no chance to clean up (crash simulation)."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 15) -> None:
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        for thread in self._threads:
            thread.join(timeout=5)
        with self._log_lock:
            self._log.close()

    def wait_exit(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout=timeout)
