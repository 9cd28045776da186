"""Every `medfed ...` command the docs show parses with the real `medfed` parser.

A documented command that fails is a bug. The federation commands of README.md run
verbatim in tests/e2e/test_readme.py; this cheap check keeps the rest of the docs true:
each command line in a shell block of README.md or docs/*.md (``$ `` prompts, ``\\``
continuations, ``[--opt | --other]`` synopses) is parsed, not run, by
``common.commands.cli.build_parser``; each inline `` `medfed ...` `` mention must name an
existing subcommand and only options that subcommand has.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
from pathlib import Path

import pytest

from common.commands.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`(medfed [^`]+)`")


def _synopsis(line: str) -> str:
    """`[--epsilon 8 | --no-dp]` -> `--epsilon 8`; `[--json]` -> `--json`."""
    line = re.sub(r"\[([^\[\]|]*)\|[^\[\]]*\]", r"\1", line)
    return line.replace("[", "").replace("]", "")


def block_commands(text: str) -> list[tuple[str, str]]:
    """(command, the error line the block shows right after it, or '')."""
    commands = []
    for lang, body in FENCE.findall(text):
        if lang not in ("", "sh", "bash", "console", "shell"):
            continue
        lines = [line.strip() for line in body.replace("\\\n", " ").splitlines()]
        prompted = any(line.startswith("$ ") for line in lines)
        for index, line in enumerate(lines):
            if prompted and not line.startswith("$ "):
                continue  # output shown under a `$ ` prompt
            line = line.removeprefix("$ ").strip()
            if line.startswith("medfed "):
                after = lines[index + 1] if index + 1 < len(lines) else ""
                error = after if after.startswith("medfed ") and ": error: " in after else ""
                commands.append((_synopsis(line), error))
    return commands


def documented_commands() -> list[tuple[str, str, str]]:
    return [
        (doc.name, cmd, error)
        for doc in DOCS
        for cmd, error in block_commands(doc.read_text("utf-8"))
    ]


def inline_mentions() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text("utf-8")
        text = FENCE.sub("", text).replace("\n", " ")  # an inline span may wrap a line
        found += [(doc.name, " ".join(m.split())) for m in INLINE.findall(text)]
    return found


def words(command: str) -> list[str]:
    """The arguments after `medfed`, up to a shell redirection or pipe."""
    tokens = shlex.split(command, comments=True)[1:]
    for index, token in enumerate(tokens):
        if token in (">", ">>", "|", "2>", "&&", ";"):
            return tokens[:index]
    return tokens


@functools.cache
def parser_for(command: str) -> argparse.ArgumentParser:
    return build_parser(command)


def parse(argv: list[str]) -> str:
    """'' when the real parser accepts argv, else what it printed."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser_for(argv[0]).parse_args(argv)
    except SystemExit as exc:
        return err.getvalue() or f"exit {exc.code}"
    return ""


def subparser(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser of the subcommand argv names, and the option words that follow."""
    parser = parser_for(argv[0])
    rest = list(argv)
    while rest and not rest[0].startswith("-"):
        choices = {}
        for action in parser._actions:  # argparse's own structure: no public accessor
            if isinstance(action, argparse._SubParsersAction):
                choices = action.choices
        if rest[0] not in choices:
            break
        parser = choices[rest.pop(0)]
    return parser, rest


def test_the_docs_show_commands() -> None:
    docs = {doc for doc, _, _ in documented_commands()}
    assert {"README.md", "pki.md", "privacy.md", "deploy.md", "operations.md"} <= docs


@pytest.mark.parametrize(("doc", "command", "error"), documented_commands())
def test_documented_command_parses(doc: str, command: str, error: str) -> None:
    """A command shown with its error must fail with exactly that error line."""
    problem = parse(words(command))
    if error:
        assert error in problem.splitlines(), f"{doc}: `{command}` says:\n{problem}"
    else:
        assert not problem, f"{doc}: `{command}` does not parse:\n{problem}"


@pytest.mark.parametrize(("doc", "mention"), inline_mentions())
def test_inline_mention_names_real_options(doc: str, mention: str) -> None:
    argv = words(mention)
    parser, rest = subparser(argv)
    assert parser.prog.split()[1:] == argv[: len(parser.prog.split()) - 1], (
        f"{doc}: `{mention}`: no such command ({parser.prog})"
    )
    unknown = [
        w.split("=")[0] for w in rest
        if w.startswith("--") and w.split("=")[0] not in parser._option_string_actions
    ]
    assert not unknown, f"{doc}: `{mention}`: {parser.prog} has no option {unknown}"


def test_the_container_command_without_a_data_file_stops_naming_data_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """deploy.md's container runs `medfed site run --config /config/site.toml`; the
    shipped file leaves data.path commented out. Forgetting it must stop the agent at
    start-up naming the field, not after enrolment."""
    from common.commands.cli import main

    text = (REPO / "deploy" / "config" / "site.toml").read_text("utf-8")
    assert '\n# path = "/data/encounters.csv"' in text
    config = tmp_path / "site.toml"
    config.write_text(text.replace('state = "/state"', f'state = "{tmp_path / "state"}"'))
    assert main(["site", "run", "--config", str(config)]) == 2
    assert "data.path" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()
