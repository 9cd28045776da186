"""Every JSON and TOML document the product reads goes through `common.core.parsing`, which
answers hostile nesting (100,000 levels) with a ValidationError, never RecursionError.

The scan reads the product's source (an AST walk of every call): a new `json.loads`
anywhere but `common/core/parsing.py` fails here, so the rule stays true as code is added."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from common.core.errors import ValidationError
from common.core.parsing import MAX_DEPTH, parse_json, parse_toml
from common.study import statistics_from_bytes

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("common", "coordinator", "site_agent", "demo", "bench")
HELPER = REPO / "common" / "core" / "parsing.py"
# (module, function) pairs that parse text: only the helper may call them.
PARSERS = {("json", "loads"), ("json", "load"), ("tomllib", "loads"), ("tomllib", "load"),
           ("json", "JSONDecoder"), ("json", "raw_decode")}
DEEP = 100_000


def _parser_calls(path: Path) -> list[str]:
    """`module.function` parser calls (and `from module import function` imports) in a
    source file, with their line numbers."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and (node.value.id, node.attr) in PARSERS):
            found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
        elif isinstance(node, ast.ImportFrom) and node.module in ("json", "tomllib"):
            found.extend(f"from {node.module} import {alias.name} (line {node.lineno})"
                         for alias in node.names if (node.module, alias.name) in PARSERS)
    return found


def test_every_json_and_toml_parser_of_the_product_is_the_shared_one() -> None:
    offenders = {
        str(path.relative_to(REPO)): calls
        for package in PRODUCT
        for path in sorted((REPO / package).rglob("*.py"))
        if "proto" not in path.parts and path != HELPER
        and (calls := _parser_calls(path))
    }
    assert not offenders, (
        "parse JSON and TOML with common.core.parsing.parse_json / parse_toml (a clean error "
        f"for hostile nesting), not directly: {offenders}")


def test_the_scan_sees_direct_calls_and_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import json\nfrom tomllib import loads\nx = json.loads('1')\n")
    assert sorted(_parser_calls(module)) == ["from tomllib import loads (line 2)",
                                             "json.loads (line 3)"]


@pytest.mark.parametrize("document", [
    "[" * DEEP + "]" * DEEP,
    '{"a":' * DEEP + "1" + "}" * DEEP,
    b"[" * DEEP,  # unterminated as well
])
def test_hostile_json_nesting_is_a_validation_error(document: str | bytes) -> None:
    with pytest.raises(ValidationError, match=f"nested deeper than {MAX_DEPTH} levels"):
        parse_json(document)


def test_json_within_the_limit_parses_and_one_level_more_does_not() -> None:
    inside = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert parse_json(inside.encode()) == json.loads(inside)
    with pytest.raises(ValidationError, match="nested deeper"):
        parse_json("[" + inside + "]")
    # Brackets inside strings are text, not nesting.
    assert parse_json(json.dumps({"a": "[" * 1000})) == {"a": "[" * 1000}


@pytest.mark.parametrize(("document", "message"), [
    (b"\xff\xfe", "not UTF-8"),
    ("{", "not JSON"),
    ("1" * 5000, "not JSON"),  # beyond int()'s digit limit
])
def test_malformed_json_is_a_validation_error(document: str | bytes, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        parse_json(document)


@pytest.mark.parametrize("document", [
    "a = " + "[" * DEEP + "]" * DEEP,
    "a = " + "{b = " * DEEP + "1" + "}" * DEEP,
    "a." * 100 + "b = 1",  # dotted keys nest without a single bracket
])
def test_hostile_toml_nesting_is_a_validation_error(document: str) -> None:
    with pytest.raises(ValidationError, match="nested deeper"):
        parse_toml(document)


def test_malformed_toml_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match="Invalid value"):
        parse_toml("a = ")
    with pytest.raises(ValidationError, match="not UTF-8"):
        parse_toml(b"\xff")
    assert parse_toml(b"a = [[1], {b = 2}]") == {"a": [[1], {"b": 2}]}


def test_pydantic_json_parsing_refuses_hostile_nesting_too() -> None:
    """The one parser not routed through the helper: pydantic's own JSON parser
    (`model_validate_json`, the global statistics), which has its own recursion limit."""
    with pytest.raises(ValidationError, match="statistics"):
        statistics_from_bytes(b'{"a":' + b"[" * DEEP + b"]" * DEEP + b"}")


def test_a_config_file_nested_too_deep_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """The service's own TOML is read by pydantic-settings (tomllib inside): it is
    parsed by the helper first, so nesting ends in one error naming the file."""
    from common.core.config import SiteSettings, load_settings
    from common.core.errors import ConfigError

    config = tmp_path / "site.toml"
    config.write_text("site = " + "[" * DEEP + "]" * DEEP + "\n")
    with pytest.raises(ConfigError, match=f"{config} is not valid TOML: nested deeper"):
        load_settings(SiteSettings, config_file=config, overrides={})
