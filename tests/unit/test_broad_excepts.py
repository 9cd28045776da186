"""common/core/errors.py says where broad exception handlers are and why; this keeps it true.

Every ``except Exception`` in the product carries its reason on the line and is in a
file the docstring names; every ``except BaseException`` re-raises or hands the error
to the thread that waits for it; there is no bare ``except:``."""

from __future__ import annotations

import ast
from pathlib import Path

import common.core.errors

REPO = Path(__file__).resolve().parents[2]
PRODUCT = [
    p for package in ("common", "coordinator", "site_agent")
    for p in sorted((REPO / package).rglob("*.py")) if "proto" not in p.parts
]


def _handlers() -> list[tuple[Path, ast.ExceptHandler, str]]:
    found = []
    for path in PRODUCT:
        source = path.read_text("utf-8")
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ExceptHandler):
                found.append((path, node, lines[node.lineno - 1]))
    return found


def _named(node: ast.ExceptHandler, name: str) -> bool:
    return isinstance(node.type, ast.Name) and node.type.id == name


def test_no_bare_except() -> None:
    bare = [f"{p.relative_to(REPO)}:{n.lineno}" for p, n, _ in _handlers() if n.type is None]
    assert bare == []


def test_except_exception_only_where_the_docstring_says_with_a_reason() -> None:
    doc = common.core.errors.__doc__ or ""
    offenders = []
    for path, node, line in _handlers():
        if _named(node, "Exception"):
            where = str(path.relative_to(REPO))
            if "#" not in line or where not in doc:
                offenders.append(f"{where}:{node.lineno}: {line.strip()}")
    assert offenders == []


def test_except_baseexception_re_raises_or_hands_the_error_on() -> None:
    offenders = []
    for path, node, line in _handlers():
        if not _named(node, "BaseException"):
            continue
        raises = any(isinstance(n, ast.Raise) for n in ast.walk(node))
        handed_on = node.name is not None and any(
            isinstance(n, ast.Assign) and isinstance(n.value, ast.Name)
            and n.value.id == node.name for n in ast.walk(node)
        )
        if not (raises or handed_on):
            offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {line.strip()}")
    assert offenders == []
