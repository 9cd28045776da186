"""Regression tests for configuration fixes from the product review."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.core.config import CoordinatorSettings, load_settings
from common.core.errors import ConfigError
from common.core.sqldb import parse_database_url


def coordinator(tmp_path: Path, **overrides: object) -> CoordinatorSettings:
    values: dict[str, object] = {"pki": tmp_path, "state": tmp_path}
    values.update(overrides)
    return load_settings(CoordinatorSettings, overrides=values)


@pytest.mark.parametrize("url", ["postgress://u@h/db", "mysql://h/db", ""])
def test_bad_database_url_is_refused_at_start_up_naming_the_field(
    tmp_path: Path, url: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        coordinator(tmp_path, database_url=url)
    assert caught.value.field == "database_url"


@pytest.mark.parametrize(
    "url", ["sqlite:///state/coordinator.db", "postgresql://medfed@db:5432/medfed"]
)
def test_supported_database_urls_are_kept(tmp_path: Path, url: str) -> None:
    assert coordinator(tmp_path, database_url=url).database_url == url


def test_database_password_is_not_in_the_settings_repr(tmp_path: Path) -> None:
    settings = coordinator(tmp_path, database_url="postgresql://medfed:hunter2@db/medfed")
    assert "hunter2" not in repr(settings)
    assert "hunter2" not in str(settings)


def test_a_rejected_url_does_not_echo_its_password(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        coordinator(tmp_path, database_url="postgress://medfed:hunter2@db/medfed")
    assert "hunter2" not in str(caught.value)


def test_validator_messages_read_cleanly(tmp_path: Path) -> None:
    """A hospital IT officer sees the reason, not pydantic's "Value error, " prefix."""
    with pytest.raises(ConfigError) as caught:
        coordinator(tmp_path, database_url="mysql://h/db")
    assert str(caught.value).startswith("database_url: unsupported scheme 'mysql'")


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://medfed:hunter2@db:5432/medfed?sslmode=require",
        "postgresql://medfed@db/medfed?sslmode=require&password=hunter2",
        "postgresql://medfed@db/medfed?PASSWORD=hunter2",
    ],
)
def test_redacted_database_url_hides_every_password_form(url: str) -> None:
    redacted = parse_database_url(url).redacted()
    assert "hunter2" not in redacted
    assert "db" in redacted and "medfed" in redacted
    assert "***" in redacted


def test_redaction_keeps_a_password_free_url_unchanged() -> None:
    url = "postgresql://medfed@db/medfed?sslmode=verify-full"
    assert parse_database_url(url).redacted() == url
