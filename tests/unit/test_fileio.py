"""common.core.fileio: the one atomic, durable file replacement."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from common.core.fileio import atomic_open, atomic_write


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    atomic_write(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_mode_is_the_callers(tmp_path: Path) -> None:
    key = tmp_path / "site.key"
    atomic_write(key, b"secret", mode=0o600)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    # Replacing keeps the new file's mode, not the old one's.
    key.chmod(0o644)
    atomic_write(key, b"secret2", mode=0o600)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_default_mode_follows_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        atomic_write(tmp_path / "report", b"x")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "report").stat().st_mode) == 0o640


def test_an_exception_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "model.mfm"
    target.write_bytes(b"previous")

    class Boom(Exception):
        pass

    with pytest.raises(Boom), atomic_open(target) as handle:
        handle.write(b"half a file")
        raise Boom
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["model.mfm"]


def test_a_missing_folder_is_an_oserror_naming_nothing_written(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "absent" / "file", b"x")
    assert list(tmp_path.iterdir()) == []
