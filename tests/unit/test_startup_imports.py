"""A `medfed` command imports what it runs, no more: the commands that neither train nor
rebuild a network start without torch and Opacus (about 8 s of CPU per process on a
loaded two-core machine; the README blocks and the tests start many of them).

Each command runs for real in a fresh interpreter through `common.commands.cli.main`, the entry
point of the `medfed` script; the interpreter then reports which heavy packages it holds.
`coordinator serve` itself imports torch: it builds the study's round-1 network and
probes it before it listens; Opacus only for a hospital's own network, which it checks
with Opacus' ModuleValidator (a built-in network is Opacus-valid by construction).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.protocol import pki
from common.releases.bundle import write_bundle
from tests.e2e.harness import REPO
from tests.study.helpers import study_toml, trained_bundle, write_hospital_csv

HEAVY = ("torch", "opacus", "scipy", "sympy", "matplotlib")
# numpy is light and every data command reads with it: seeing it shows the probe sees
# what a command imports.
WATCHED = (*HEAVY, "numpy")
MARK = "MODULES:"
PROBE = (
    "import atexit, json, sys\n"
    f"atexit.register(lambda: print({MARK!r} + json.dumps(sorted(\n"
    f"    m for m in {WATCHED!r} if m in sys.modules)), file=sys.stderr))\n"
    "from common.commands.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def heavy_imports(*argv: str) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """The watched packages `medfed ARGV` imported, and how it ended."""
    result = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=REPO,
                            capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in result.stderr.splitlines() if line.startswith(MARK)]
    assert lines, result.stdout + result.stderr
    return json.loads(lines[-1][len(MARK):]), result


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("startup")
    csv = write_hospital_csv(root / "north.csv", 60, seed=1)
    study = root / "study.toml"
    study.write_text(study_toml("startup", rounds=1))
    model = root / "final.safetensors"
    write_bundle(model, trained_bundle(csv, steps=1))
    pki.init_ca(root / "pki")
    return {"root": root, "csv": csv, "study": study, "model": model, "pki": root / "pki"}


@pytest.mark.parametrize("command", [
    ["data", "check", "--study", "{study}", "--data", "{csv}"],
    ["model", "show", "--model", "{model}"],
    ["study", "init", "--out", "{root}/drafted.toml", "--header-from", "{csv}",
     "--label-column", "Outcome", "--patient-column", "Patient-ID"],
    ["pki", "issue", "--dir", "{pki}", "--site", "south"],
    ["status", "--coordinator", "127.0.0.1:9", "--tls-ca", "{pki}/ca.crt",
     "--tls-cert", "{pki}/ca.crt", "--tls-key", "{pki}/ca.key", "--timeout", "1"],
], ids=lambda command: " ".join(command[:2]))
def test_a_command_that_trains_nothing_starts_without_torch(
    files: dict[str, Path], command: list[str]
) -> None:
    argv = [word.format(**{k: str(v) for k, v in files.items()}) for word in command]
    modules, result = heavy_imports(*argv)
    assert "Traceback" not in result.stderr, result.stderr
    assert set(modules) & set(HEAVY) == set(), (argv, modules)
    if command[0] == "data":
        assert "numpy" in modules  # the probe sees an import: the table is read with numpy


HELP_COMMANDS = ["coordinator serve", "site run", "ledger show", "ledger verify", "query run",
                 "demo", "bench", "predict", "model export", "privacy epsilon", "privacy audit"]
HELP_PROBE = (
    "import contextlib, io, json, sys\n"
    "from common.commands.cli import build_parser\n"
    "seen = {}\n"
    "for command in json.loads(sys.argv[1]):\n"
    "    words = command.split()\n"
    "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
    "        build_parser(words[0]).parse_args([*words, '--help'])\n"
    f"    seen[command] = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
    "print(json.dumps(seen))\n"
)


def test_every_command_parses_its_options_without_torch() -> None:
    """Registering and parsing a command (here its --help, each in turn in one
    interpreter) loads no network code: the coordinator and the site import torch when
    they build their model, `predict` when it scores, not before. `medfed privacy`
    registers its `audit` plug-in (site_agent.audit_cli) without the audit's training
    code, so `privacy epsilon` and `python -m common.commands.privacy ledger ...` start light."""
    result = subprocess.run([sys.executable, "-c", HELP_PROBE, json.dumps(HELP_COMMANDS)],
                            cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert list(seen) == HELP_COMMANDS
    assert {command: modules for command, modules in seen.items() if modules} == {}


def test_predict_scores_without_opacus(files: dict[str, Path]) -> None:
    """`predict` rebuilds the trained network to score with it: torch, but no DP-SGD
    step and so no Opacus (seconds of start-up per run)."""
    out = files["root"] / "scores.csv"
    modules, result = heavy_imports("predict", "--model", str(files["model"]),
                                    "--data", str(files["csv"]), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "torch" in modules and "opacus" not in modules, modules
    assert out.stat().st_size > 0
