"""`medfed` in a role image: commands whose package is not installed are left out of
the listing, and asking for one says so in one line (exit 2), never a traceback."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

import common.commands.cli as cli
from common.core.errors import ConfigError

REAL = EntryPoint(name="pki", value="common.commands.pki:register", group=cli.COMMAND_GROUP)
ABSENT = EntryPoint(
    name="coordinator", value="medfed_absent_package.cli:register", group=cli.COMMAND_GROUP
)
BROKEN = EntryPoint(
    name="broken", value="common.medfed_absent_module:register", group=cli.COMMAND_GROUP
)


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch) -> list[EntryPoint]:
    found: list[EntryPoint] = []
    monkeypatch.setattr(cli, "entry_points", lambda group: list(found))
    return found


def test_listing_skips_commands_whose_package_is_absent(plugins: list[EntryPoint]) -> None:
    plugins.extend([REAL, ABSENT])
    parser = cli.build_parser(None)
    help_text = parser.format_help()
    assert "pki" in help_text
    assert "coordinator" not in help_text


def test_asking_for_an_absent_command_names_it(
    plugins: list[EntryPoint], capsys: pytest.CaptureFixture[str]
) -> None:
    plugins.extend([REAL, ABSENT])
    with pytest.raises(ConfigError, match="'coordinator' is not installed here"):
        cli.build_parser("coordinator")
    assert cli.main(["coordinator", "serve"]) == 2
    assert "not installed here" in capsys.readouterr().err


def test_a_missing_module_inside_an_installed_package_is_still_an_error(
    plugins: list[EntryPoint],
) -> None:
    plugins.extend([REAL, BROKEN])
    with pytest.raises(ModuleNotFoundError):
        cli.build_parser(None)
