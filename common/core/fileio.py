"""Atomic, durable file replacement: the one way medfed replaces a file on disk; and
`read_parsed`, reading a file whose every error names it.

A reader (the coordinator, a restarted site, an operator's tool) sees either the old file
or the new one, never half a file, and after a crash the new file is there only if it was
complete: the bytes go to a temporary file in the same folder, which is flushed and
fsynced, renamed over the target in one `os.replace`, and then the folder is fsynced so
the rename itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, TypeVar

from common.core.errors import StateError, ValidationError

__all__ = ["atomic_open", "atomic_write", "fsync_directory", "read_parsed", "replace_durably"]

T = TypeVar("T")


def read_parsed(path: str | Path, *, what: str, parse: Callable[[bytes], T]) -> T:
    """`parse` of the bytes of `path`, a `what` ("model bundle", "initial model"): a
    `StateError` naming the file when it cannot be read, the parser's `ValidationError`
    prefixed with `what` and the file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise StateError(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        return parse(data)
    except ValidationError as exc:
        raise ValidationError(f"{what} {path}: {exc}") from None


def fsync_directory(folder: str | Path) -> None:
    """fsync a folder, so that a rename or a new entry in it is on disk."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def atomic_open(path: str | Path, *, mode: int = 0o666) -> Iterator[BinaryIO]:
    """Open a temporary file next to `path` for writing; when the block ends without an
    exception it is flushed, fsynced and renamed over `path`, and the folder is fsynced.

    On an exception the temporary file is removed and `path` is left as it was. `mode` is
    the permission of the new file as for `os.open` (the umask applies): 0o600 for keys
    and other files only the owner may read. OSError propagates; callers name the file in
    their own error.
    """
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    fsync_directory(target.parent)


def atomic_write(path: str | Path, data: bytes, *, mode: int = 0o666) -> None:
    """Replace `path` with `data` atomically and durably (see `atomic_open`)."""
    with atomic_open(path, mode=mode) as handle:
        handle.write(data)


def replace_durably(temporary: str | Path, target: str | Path) -> None:
    """Rename a complete, already fsynced `temporary` over `target`, then fsync the folder
    so the rename survives a power cut. For files that must be checked between writing
    and replacing (a downloaded model, a restored ledger); `atomic_open` otherwise."""
    os.replace(temporary, target)
    fsync_directory(Path(target).parent)
