"""Test instrumentation lives outside the product: `medfed` has no flag, setting or
environment variable that makes a site write its plaintext update (or the coordinator
its unmasked sum) to disk, pauses a site, or serves a flat model without a study;
`python -m bench.instrumented` does, through the `common.core.observer.RoundObserver`
seam and `coordinator.cli.register(model_without_study=...)`.

That the instrumented processes write the files end to end is what the e2e tests read
(tests/e2e/test_hospital_federation.py compares each site's `debug-updates` file with
its ledger; tests/e2e/harness.py `Federation.update`; tests/network/test_hostile_input.py
sums them against `aggregates`)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from bench import instrumented
from bench.instrumented import Instrumentation
from common.commands.cli import main
from common.core.config import REMOVED_SETTINGS, CoordinatorSettings, SiteSettings, load_settings
from common.core.errors import ConfigError
from common.core.observer import NoObserver, RoundObserver

REPO = Path(__file__).resolve().parents[2]
SITE = {"site": "a", "coordinator": "127.0.0.1:1", "state": "/tmp/state", "pki": "/tmp/pki"}


@pytest.mark.parametrize("command", [("site", "run"), ("coordinator", "serve")])
def test_the_product_commands_have_no_debug_flag(
    command: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert "--state" in shown  # the help of the command itself
    assert "debug" not in shown
    assert "--model-dim" not in shown


@pytest.mark.parametrize("cls", [SiteSettings, CoordinatorSettings])
def test_the_settings_have_no_debug_field(cls: type[SiteSettings | CoordinatorSettings]) -> None:
    assert not [name for name in cls.model_fields if "debug" in name]
    assert not [name for name in cls.model_fields if name in REMOVED_SETTINGS]


def _named_settings(text: str) -> set[str]:
    """Every key and table a TOML text names, commented-out ones included (an example
    config shows its optional settings as comments)."""
    names = set()
    for line in text.splitlines():
        bare = line.strip().lstrip("#").strip()
        match = re.match(r"^\[([A-Za-z_][\w.]*)\]|^([A-Za-z_]\w*)\s*=", bare)
        if match:
            names.add((match.group(1) or match.group(2)).split(".")[0])
    return names


@pytest.mark.parametrize("name", ["site.toml", "coordinator.toml"])
def test_the_example_configs_name_no_removed_setting(name: str) -> None:
    named = _named_settings((REPO / "deploy" / "config" / name).read_text())
    assert "privacy" in named or "aggregation" in named  # the scan reads the file
    assert not named & set(REMOVED_SETTINGS)


@pytest.mark.parametrize("setting", sorted(REMOVED_SETTINGS))
def test_an_old_config_setting_one_is_refused_naming_it(tmp_path: Path, setting: str) -> None:
    config = tmp_path / "site.toml"
    config.write_text(f"{setting} = true\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(SiteSettings, config_file=config, overrides=SITE)
    assert refused.value.field == setting
    assert "bench.instrumented" in refused.value.message


def test_an_old_coordinator_config_with_a_flat_model_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    config = tmp_path / "coordinator.toml"
    config.write_text("[model]\ndim = 8\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(CoordinatorSettings, config_file=config,
                      overrides={"pki": tmp_path, "state": tmp_path})
    assert refused.value.field == "model"
    assert "bench.instrumented coordinator serve --model-dim" in refused.value.message


def test_instrumentation_writes_the_files_tests_read(tmp_path: Path) -> None:
    watch: RoundObserver = Instrumentation(tmp_path, write_updates=True, write_aggregates=True)
    update = np.array([1, 2**32 - 1, 7], dtype=np.uint32)
    watch.update_before_masking(3, update)
    assert np.array_equal(
        np.fromfile(tmp_path / "debug-updates" / "round-000003.u32", dtype="<u4"), update)
    watch.aggregate_unmasked(4, update.astype(np.int64), ("b", "a"))
    assert np.array_equal(
        np.fromfile(tmp_path / "aggregates" / "round-000004.u32", dtype="<u4"), update)
    assert (tmp_path / "aggregates" / "round-000004.survivors").read_text() == "b\na\n"


def test_without_its_flags_it_writes_nothing(tmp_path: Path) -> None:
    for watch in (Instrumentation(tmp_path), NoObserver()):
        watch.update_before_masking(1, np.zeros(2, dtype=np.uint32))
        watch.aggregate_unmasked(1, np.zeros(2, dtype=np.uint32), ("a",))
        watch.after_phase(1, "upload", stop=threading.Event())
    assert list(tmp_path.iterdir()) == []


def test_the_pause_says_so_and_ends_on_stop(capsys: pytest.CaptureFixture[str]) -> None:
    watch = Instrumentation(Path("unused"), pause_after=(2, "share_keys"))
    stop = threading.Event()
    watch.after_phase(1, "share_keys", stop=stop)
    watch.after_phase(2, "advertise_keys", stop=stop)
    assert capsys.readouterr().out == ""
    stop.set()  # an agent told to stop: the wait returns at once
    watch.after_phase(2, "share_keys", stop=stop)
    line = json.loads(capsys.readouterr().out)
    assert line == {"event": "paused", "round": 2, "phase": "share_keys"}


@pytest.mark.parametrize(("argv", "says"), [
    (["site", "run", "--debug-write-aggregates"], "flag of `coordinator serve`"),
    (["coordinator", "serve", "--debug-write-updates"], "flags of `site run`"),
    (["pki", "init", "--debug-pause-after", "1:upload"], "flags of `site run`"),
    (["site", "run", "--debug-pause-after", "1:unmask"], "is not ROUND:PHASE"),
    (["site", "run", "--debug-pause-seconds", "0"], "seconds > 0"),
    (["site", "run", "--model-dim", "8"], "--model-dim is a flag of `coordinator serve`"),
    (["coordinator", "serve", "--model-dim", "0"], "not a number of elements"),
])
def test_the_instrumented_entry_refuses_a_misplaced_flag(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        instrumented.main(argv)
    assert done.value.code == 2
    assert says in capsys.readouterr().err


def test_the_instrumented_entry_lists_its_flags_with_the_commands(
    capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        instrumented.main(["site", "run", "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert "--debug-write-updates" in shown and "--debug-pause-after" in shown
    assert "--model-dim" in shown
    assert "--coordinator" in shown  # and the product's own flags after them
