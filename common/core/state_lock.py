"""One process per state folder.

Two coordinators (or two site agents) on one state folder would both write the same
SQLite state, ledger and checkpoints and each believe its own view: rounds numbered
twice, a ledger forked. The first process takes an exclusive `flock` on
``STATE/.medfed.lock`` and writes who it is (process id, host, start time) into it; a
second one is refused with the folder and the holder named. The kernel drops the lock
when the holder exits, however it exits (kill -9 included), so a crash never leaves a
stale lock behind. Local file systems only: `flock` on some network file systems is not
exclusive across hosts (docs/operations.md says so).
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
from pathlib import Path
from types import TracebackType

from common.core.errors import StateError, ValidationError
from common.core.parsing import parse_json

LOCK_FILE = ".medfed.lock"


class StateLock:
    """An exclusive hold on one state folder for the life of this process's service."""

    def __init__(self, folder: Path, descriptor: int) -> None:
        self.folder = folder
        self._descriptor: int | None = descriptor

    @classmethod
    def acquire(cls, folder: Path, *, role: str,
                advice: str = "stop that one, or give this one another --state") -> StateLock:
        """Hold `folder` for `role` ("coordinator", "site a"), or raise StateError naming
        the folder, the process that holds it and `advice` (what to do instead)."""
        path = folder / LOCK_FILE
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StateError(
                f"cannot open the lock file {path}: {exc.strerror or exc} "
                "(is the state folder writable by this user?)"
            ) from exc
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(descriptor)
            os.close(descriptor)
            raise StateError(
                f"state folder {folder} is in use by {holder}: one process per state "
                f"folder ({advice})"
            ) from None
        except OSError as exc:
            os.close(descriptor)
            raise StateError(f"cannot lock {path}: {exc.strerror or exc}") from exc
        record = {
            "role": role,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, (json.dumps(record) + "\n").encode(), 0)
        return cls(folder, descriptor)

    def release(self) -> None:
        """Give the folder up (idempotent); the holder record stays for the curious."""
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is not None:
            fcntl.flock(descriptor, fcntl.LOCK_UN)
            os.close(descriptor)

    def __enter__(self) -> StateLock:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _read_holder(descriptor: int) -> str:
    """'coordinator (pid 123 on host-a, since 2026-...)' from the lock file, or a plain
    phrase when the holder has not written its record yet."""
    try:
        raw = os.pread(descriptor, 4096, 0)
        record = parse_json(raw)
        return (f"{record['role']} (pid {int(record['pid'])} on {record['host']}, "
                f"since {record['started']})")
    except (OSError, ValidationError, KeyError, TypeError, ValueError):
        return "another medfed process"
