"""JSON and TOML read from the network or from disk: the one way medfed parses them.

Python's parsers recurse once per level of nesting, so a document nested 100,000 deep
(a few hundred kilobytes of ``[``) ends in `RecursionError`, which no caller expects: a
coordinator answered INTERNAL and a command printed a traceback. Here every failure is
one `ValidationError`: not UTF-8, not JSON (or TOML), a number beyond `int()`'s digit
limit, or nesting deeper than `MAX_DEPTH`, far deeper than any document medfed writes
(a ledger export nests 7 levels). Callers turn it into their own error, naming the file
or field. A test (tests/unit/test_parsing.py) keeps every parser of the product here.
"""

from __future__ import annotations

import json
import tomllib
from typing import Any, Final

from common.core.errors import ValidationError

__all__ = ["MAX_DEPTH", "parse_json", "parse_toml"]

MAX_DEPTH: Final = 64
"""The deepest nesting accepted (a value inside 64 arrays or objects)."""


def parse_json(data: bytes | bytearray | memoryview | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """The value of the JSON document `data` (UTF-8 bytes or text); ValidationError
    when it is not UTF-8 JSON or nests deeper than `max_depth`."""
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        raise ValidationError("not UTF-8 text") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError as exc:  # json.JSONDecodeError, or an integer of too many digits
        raise ValidationError(f"not JSON ({exc})") from None
    # No value nests deeper than the brackets it holds: most documents skip the walk.
    if text.count("[") + text.count("{") > max_depth:
        _check_depth(value, max_depth)
    return value


def parse_toml(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """The table of the TOML document `data`; ValidationError when it is not UTF-8
    TOML or nests deeper than `max_depth` (dotted keys nest too). Its message is the
    reason alone: callers say "FILE is not valid TOML: REASON"."""
    try:
        text = data if isinstance(data, str) else data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValidationError("not UTF-8 text") from None
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError as exc:  # tomllib.TOMLDecodeError, or an integer of too many digits
        raise ValidationError(str(exc)) from None
    _check_depth(value, max_depth)
    return value


def _too_deep(max_depth: int) -> ValidationError:
    return ValidationError(f"nested deeper than {max_depth} levels")


def _check_depth(value: Any, max_depth: int) -> None:
    """ValidationError when `value` holds a list or dict inside more than `max_depth`
    others (walked without recursion: the walk itself cannot overflow)."""
    if not isinstance(value, dict | list):
        return
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, dict | list):
                if depth >= max_depth:
                    raise _too_deep(max_depth)
                stack.append((child, depth + 1))
