"""The suite's `python -m` processes, forked from an interpreter that imported torch once.

A site process imports torch and Opacus before it does anything else: about 7 s of CPU
on the 2-core CI machine, and the suite starts a few hundred coordinators and sites
(measured: site start-up imports were a fifth of the suite's CPU). The zygote is one
interpreter per pytest worker that imports them (and this checkout's service modules)
once and then forks a child per launch. Each child is a real OS process: its own pid,
sockets, files, signals and exit status; it takes the launch's argv, environment,
working directory, PYTHONPATH and stdio, runs the module as `python -m` does (runpy, as
`__main__`), and leaves through the interpreter's normal shutdown (atexit handlers,
non-daemon threads joined), so what it prints and how it exits are what a fresh
interpreter gives.

What the zygote does not exercise is the interpreter's own start and the imports
themselves: tests/unit/test_startup_imports.py and the README tests (commands run
verbatim through bash, tests/e2e/harness.Readme) start fresh interpreters, as does any
argv that is not `sys.executable -m MODULE`. Nothing imported here starts a thread of
its own or reads the environment at import (gRPC is left to each child: its core reads
GRPC_* when it starts); tests/unit/test_zygote.py checks a child against Popen.

Protocol: the client sends one SOCK_SEQPACKET message (argv, env, cwd as JSON) with three
descriptors (stdout and stderr pipes, a status pipe) and reads back the pid; the server
reaps each child through a pidfd and writes its exit code (negative for a signal, as
Popen) into the status pipe. The server exits when its stdin (held by the worker) closes.

`MEDFED_TEST_FRESH_INTERPRETERS=1` turns it off (every process a fresh interpreter).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from common.core.processes import ChildProcess, popen

REPO = Path(__file__).resolve().parents[1]
OFF_ENV = "MEDFED_TEST_FRESH_INTERPRETERS"
PRELOAD = (
    "torch",
    "opacus",
    "site_agent.trainer",
    "site_agent.cli",
    "coordinator.cli",
    "common.commands.cli",
    "bench.instrumented",
    "bench.transport_site",
)
"""Imported once in the zygote: what coordinators and sites import at start. None of it
imports grpc (checked at start: a preloaded grpc core would miss each child's GRPC_*)."""
MAX_MESSAGE = 1 << 20


# --- server (runs as `python -m tests.zygote`) -----------------------------------------


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: str


def _serve(path: str) -> Launch:
    """Fork a child per request; returns only in a child, with what it must run."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "control")
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, status pipe)
    print(json.dumps({"ready": path}), flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "control":
                if not os.read(sys.stdin.fileno(), 4096):  # the worker is gone
                    listener.close()
                    os.unlink(path)
                    os.rmdir(os.path.dirname(path))
                    sys.exit(0)
            elif key.data == "accept":
                conn, _ = listener.accept()
                with conn:
                    message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
                    if len(fds) != 3:
                        for fd in fds:
                            os.close(fd)
                        continue
                    request = json.loads(message)
                    launch = Launch(request["argv"], request["env"], request["cwd"])
                    pid = os.fork()
                    if pid == 0:
                        listener.close()
                        selector.close()
                        for pidfd, (_, status) in children.items():
                            os.close(pidfd)
                            os.close(status)
                        _become(launch, stdout=fds[0], stderr=fds[1], status=fds[2])
                        return launch  # `with conn` closes the child's copy
                    os.close(fds[0])
                    os.close(fds[1])
                    pidfd = os.pidfd_open(pid)
                    children[pidfd] = (pid, fds[2])
                    selector.register(pidfd, selectors.EVENT_READ, "child")
                    with contextlib.suppress(OSError):  # the client may be gone
                        conn.send(json.dumps({"pid": pid}).encode())
            else:
                pid, status = children.pop(key.fd)
                selector.unregister(key.fd)
                _, wait_status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):  # the client may be gone
                    os.write(status, f"{os.waitstatus_to_exitcode(wait_status)}\n".encode())
                os.close(status)
                os.close(key.fd)


def _become(launch: Launch, *, stdout: int, stderr: int, status: int) -> None:
    """In the child: the launch's stdio, directory, environment, path and argv."""
    os.close(status)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    os.chdir(launch.cwd)
    server_pythonpath = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ.clear()
    os.environ.update(launch.env)
    own = [p for p in launch.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in server_pythonpath]
    # `python -m` puts the working directory first, then PYTHONPATH, then the rest.
    sys.path[:] = [launch.cwd, *own, *base]
    sys.argv[:] = [launch.argv[0], *launch.argv[3:]]


def _main() -> None:
    for module in PRELOAD:
        importlib.import_module(module)
    if "grpc" in sys.modules:
        raise SystemExit("tests.zygote: a preloaded module imported grpc")
    # Every object so far is shared with the children copy-on-write; a child's garbage
    # collector walking them would copy the pages (hundreds of MB, and seconds of CPU).
    gc.collect()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    directory = tempfile.mkdtemp(prefix="medfed-zygote-")
    launch = _serve(os.path.join(directory, "socket"))
    # The child: run the module as `python -m` would; SystemExit and uncaught exceptions
    # end the interpreter as they would there.
    runpy.run_module(launch.argv[2], run_name="__main__", alter_sys=True)


# --- client (in each pytest worker) ----------------------------------------------------


class ForkedProcess:
    """A zygote child, with the part of `subprocess.Popen`'s interface ManagedProcess and
    the tests use."""

    def __init__(self, args: list[str], pid: int, *, stdout: int, stderr: int,
                 status: int) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self.stdout: IO[str] | None = open(stdout, encoding="utf-8", errors="replace")  # noqa: SIM115
        self.stderr: IO[str] | None = open(stderr, encoding="utf-8", errors="replace")  # noqa: SIM115
        self._status = status
        self._lock = threading.Lock()
        # Closed only when this object goes: another thread may be waiting on it.
        weakref.finalize(self, os.close, status)

    def _reap(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        poller = select.poll()
        poller.register(self._status, select.POLLIN)
        if not poller.poll(None if timeout is None else max(0, int(timeout * 1000))):
            return None
        with self._lock:
            if self.returncode is None:
                data = b""
                while chunk := os.read(self._status, 64):
                    data += chunk
                if not data:
                    raise RuntimeError(f"the zygote ended before reporting pid {self.pid}")
                self.returncode = int(data)
        return self.returncode

    def poll(self) -> int | None:
        return self._reap(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._reap(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The worker's zygote, started on the first launch."""

    def __init__(self) -> None:
        self._server: subprocess.Popen[str] | None = None
        self._path = ""
        self._lock = threading.Lock()

    def _socket_path(self) -> str:
        with self._lock:
            if self._server is None:
                server = subprocess.Popen(
                    [sys.executable, "-m", "tests.zygote"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
                line = server.stdout.readline() if server.stdout is not None else ""
                if not line:
                    raise RuntimeError(f"tests.zygote exited ({server.wait()}) before ready")
                self._path = json.loads(line)["ready"]
                self._server = server
            return self._path

    def launch(self, argv: list[str], env: dict[str, str], cwd: Path | None) -> ChildProcess:
        """Fork `argv` (`sys.executable -m MODULE ...`) from the zygote; anything else
        starts with Popen."""
        if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
            return popen(argv, env, cwd)
        path = self._socket_path()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
                conn.connect(path)
                message = {"argv": argv, "env": env, "cwd": str(cwd or os.getcwd())}
                socket.send_fds(conn, [json.dumps(message).encode()], [out_w, err_w, status_w])
                reply: dict[str, Any] = json.loads(conn.recv(4096))
        except BaseException:
            for fd in (out_r, err_r, status_r):
                os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, status_w):
                os.close(fd)
        return ForkedProcess(argv, int(reply["pid"]), stdout=out_r, stderr=err_r,
                             status=status_r)

    def close(self) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None and server.stdin is not None:
            server.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=30)
            if server.stdout is not None:
                server.stdout.close()


def enabled() -> bool:
    return os.environ.get(OFF_ENV, "") not in ("1", "true", "yes")


if __name__ == "__main__":
    _main()
