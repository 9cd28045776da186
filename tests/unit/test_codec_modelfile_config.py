"""Wire codec, model files and settings: the boundaries where bad input must be named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.core.codec import (
    FINITE_CHECK_ELEMENTS,
    ChunkAssembler,
    TensorSpec,
    all_finite,
    bytes_to_flat,
    check_finite,
    flat_to_bytes,
    iter_chunks,
)
from common.core.config import CoordinatorSettings, SiteSettings, load_settings
from common.core.errors import ConfigError, StateError, ValidationError
from common.core.modelfile import ModelFile, read_model_file, write_model_file

LAYOUT = (TensorSpec("w", "<f4", (3, 4)), TensorSpec("b", "<f4", (4,)))


@settings(max_examples=40, deadline=None)
@given(total=st.integers(1, 5000), chunk=st.integers(1, 700))
def test_chunks_reassemble_exactly(total: int, chunk: int) -> None:
    data = np.random.default_rng(total).integers(0, 256, total, dtype=np.uint8).tobytes()
    buffer = bytearray(total)
    assembler = ChunkAssembler(buffer, total_bytes=total, max_chunk_bytes=chunk)
    for offset, part in iter_chunks(data, chunk_bytes=chunk):
        assembler.add(offset, part)
    assembler.finish()
    assert bytes(buffer) == data


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([(0, b"ab"), (3, b"c")], "gap"),
        ([(0, b"ab"), (1, b"bc")], "overlap"),
        ([(0, b"abcdefgh")], "exceeds"),
        ([(0, b"abcd"), (4, b"ef")], "past the declared length"),
        ([(0, b"")], "empty chunk"),
    ],
)
def test_bad_chunk_sequences_are_refused(chunks: list[tuple[int, bytes]], message: str) -> None:
    assembler = ChunkAssembler(bytearray(5), total_bytes=5, max_chunk_bytes=4)
    with pytest.raises(ValidationError, match=message):
        for offset, data in chunks:
            assembler.add(offset, data)


def test_truncated_stream_is_refused() -> None:
    assembler = ChunkAssembler(bytearray(5), total_bytes=5, max_chunk_bytes=4)
    assembler.add(0, b"abc")
    with pytest.raises(ValidationError, match="truncated"):
        assembler.finish()


def test_tensor_bytes_round_trip_and_reject_non_finite() -> None:
    flat = np.arange(16, dtype=np.float32) / 3
    assert np.array_equal(bytes_to_flat(flat_to_bytes(flat, LAYOUT), LAYOUT), flat)
    flat[2] = np.nan
    with pytest.raises(ValidationError, match="non-finite"):
        bytes_to_flat(flat_to_bytes(flat, LAYOUT), LAYOUT)
    with pytest.raises(ValidationError):
        TensorSpec("x", "|O", (1,))  # object arrays never cross the wire


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_windowed_finiteness_check_names_the_tensor(bad: float) -> None:
    """The download path checks an array assembled in place window by window; a bad
    value past the first window, in the second tensor, is still found and named."""
    first = FINITE_CHECK_ELEMENTS + 5
    layout = (TensorSpec("w", "<f4", (first,)), TensorSpec("b", "<f4", (3,)))
    flat = np.zeros(first + 3, dtype=np.float32)
    assert all_finite(flat)
    check_finite(flat, layout)
    flat[first + 1] = bad
    assert not all_finite(flat)
    with pytest.raises(ValidationError, match="'b'"):
        check_finite(flat, layout)
    flat[first + 1] = 0.0
    flat[FINITE_CHECK_ELEMENTS + 2] = bad
    with pytest.raises(ValidationError, match="'w'"):
        check_finite(flat, layout)


def test_model_file_round_trip_with_optimizer_state(tmp_path: Path) -> None:
    flat = np.linspace(-1, 1, 16, dtype=np.float32)
    extras = {"adam.m": np.ones(16, dtype=np.float32)}
    path = tmp_path / "m.mfm"
    write_model_file(path, ModelFile(LAYOUT, flat, {"round": 3}, extras))
    back = read_model_file(path)
    assert back.layout == LAYOUT and np.array_equal(back.flat, flat)
    assert back.metadata == {"round": 3}
    assert np.array_equal(back.extras["adam.m"], extras["adam.m"])


@pytest.mark.parametrize("corruption", ["flip_body", "truncate", "append", "magic"])
def test_corrupted_model_file_is_refused(tmp_path: Path, corruption: str) -> None:
    path = tmp_path / "m.mfm"
    write_model_file(path, ModelFile(LAYOUT, np.zeros(16, dtype=np.float32)))
    data = bytearray(path.read_bytes())
    if corruption == "flip_body":
        data[-3] ^= 0x40
    elif corruption == "truncate":
        del data[-5:]
    elif corruption == "append":
        data += b"\0"
    else:
        data[0] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(StateError):
        read_model_file(path)


def test_settings_errors_name_the_field(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("rounds = 2\n[deadlines]\nphase_seconds = -1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(CoordinatorSettings, config_file=config,
                      overrides={"pki": tmp_path, "state": tmp_path})
    assert info.value.field == "deadlines.phase_seconds"
    with pytest.raises(ConfigError) as info:
        load_settings(SiteSettings, overrides={"site": "Bad Id", "coordinator": "h:1",
                                               "state": tmp_path, "pki": tmp_path})
    assert info.value.field == "site"
    config.write_text("unknown_knob = 1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(CoordinatorSettings, config_file=config,
                      overrides={"pki": tmp_path, "state": tmp_path})
    assert info.value.field == "unknown_knob"


def test_settings_precedence_flags_over_env_over_toml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.toml"
    config.write_text("rounds = 2\nmin_sites = 4\n"
                      "[deadlines]\ntrain_seconds = 11\nphase_seconds = 12\n")
    monkeypatch.setenv("MEDFED_COORDINATOR_MIN_SITES", "5")
    monkeypatch.setenv("MEDFED_COORDINATOR_DEADLINES__TRAIN_SECONDS", "21")
    got = load_settings(CoordinatorSettings, config_file=config, overrides={
        "pki": tmp_path, "state": tmp_path, "rounds": 7, "deadlines": {"phase_seconds": 3},
    })
    assert (got.rounds, got.min_sites) == (7, 5)
    assert (got.deadlines.train_seconds, got.deadlines.phase_seconds) == (21, 3)
