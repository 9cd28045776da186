"""Text from other parties, made safe to show on a terminal or open in a spreadsheet.

A name read from a file (a feature, a class label, a site in a privacy card) may carry
terminal escape sequences (``ESC [ 2 J`` clears the screen, ``ESC ] 0 ;`` retitles the
window, OSC 8 forges links) or bidirectional overrides (U+202E) that make the text read
other than it is. `printable` escapes every character Python does not call printable,
the way ``repr`` does (``\\x1b``, ``\\u202e``), and leaves everything else, accents and
other scripts included, as written.

`csv_cell` neutralises a spreadsheet formula: a cell that starts with ``=``, ``+``,
``-``, ``@``, a tab or a carriage return is run as a formula by Excel, LibreOffice and
Google Sheets (``=HYPERLINK(...)``, ``@SUM(...)``); the OWASP "CSV Injection" guidance
is to prefix such a cell with a single quote, which the spreadsheet shows as text.
"""

from __future__ import annotations

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str, *, keep: str = "") -> str:
    """`text` with every non-printable character (control characters, format characters
    such as bidirectional overrides, line and paragraph separators) escaped as ``repr``
    would; characters in `keep` (e.g. a newline in a multi-line message) stay."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else _escape(c) for c in text)


def csv_cell(value: object) -> object:
    """A value for a CSV cell a spreadsheet will not run as a formula: text starting with
    one of `FORMULA_STARTS` gets a leading single quote (OWASP CSV injection). Numbers
    (int, float) are written as they are: a negative score is a number, not a formula."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value
