"""Asking the federation a question, over real processes: three hospitals approve a study
and a query (`medfed site approve`), the operator runs the query (`medfed query run`)
on a running coordinator, which runs it as a round of its own through SecAgg+ before the
study's first round; no training round is needed. The commands are README.md's "Ask
the federation a question" blocks, run as written (paths substituted only).

The answer (a count, an outcome rate by sex, a clipped mean and a Kaplan-Meier curve)
is checked against the same statistics computed centrally on the three files pooled;
every site's ledger holds the query's entry, and `medfed ledger show` lists it by name.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.core.processes import ManagedProcess
from common.privacy.accountant import compose_epsilon
from common.privacy.ledger import read_ledger
from common.releases.analytics.answer import answer_query
from common.releases.analytics.query import load_query, query_sha256
from common.releases.analytics.vector import query_length, site_vector
from common.study import load_study, study_sha256
from site_agent.data import load_study_table
from tests.e2e.harness import (
    README_SITES,
    Readme,
    StudyProcesses,
    list_members,
    make_pki,
    readme_blocks,
    run_medfed,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SITES = README_SITES
COLUMNS = ["Patient-ID", "Age (years)", "Sex", "Lactate mmol/L", "Days", "Outcome"]
WIDE = 0.9999
"""The level the coverage is asserted at: the same release read again (post-processing,
free), wide enough that a correct interval fails about once in 10^4 cells, so the test
fails for a wrong interval, not for the 5 % a 95 % interval is allowed to miss."""

STUDY = """\
[study]
name = "questions"
rounds = 1
classes = ["no", "yes"]

[data]
label_column = "Outcome"
patient_column = "Patient-ID"

[[features]]
name = "Age (years)"
type = "numeric"
range = [18, 100]

[[features]]
name = "Sex"
type = "categorical"
levels = ["F", "M"]

[[features]]
name = "Lactate mmol/L"
missing = "indicator"

[[features]]
name = "Days"
type = "numeric"
range = [0, 400]

[model]
name = "mlp"
hidden = [8]

[training]
final_evaluation = false

[privacy]
unit = "patient"
epsilon = 8.0
delta = 1e-5
"""


def query_toml(study_digest: str) -> str:
    return f"""\
name = "first-questions"
study_sha256 = "{study_digest}"

[[statistics]]
name = "patients"
kind = "count"
epsilon = 1.0

[[statistics]]
name = "outcome_by_sex"
kind = "rate"
epsilon = 1.0
[[statistics.by]]
feature = "Sex"

[[statistics]]
name = "mean_lactate"
kind = "mean"
feature = "Lactate mmol/L"
range = [0, 10]
resolution = 0.01
epsilon = 1.0

[[statistics]]
name = "survival"
kind = "kaplan_meier"
feature = "Days"
grid = [0, 60, 120, 240, 400]
epsilon = 1.0
"""


def write_hospital(path: Path, *, patients: int, seed: int) -> Path:
    """One or two visits per patient; some missing lactate; days to the outcome (or to
    the end of follow-up)."""
    rng = np.random.default_rng(seed)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for p in range(patients):
            age = int(rng.integers(18, 95))
            sex = "F" if rng.random() < 0.5 else "M"
            risk = 0.04 * (age - 60) + (0.5 if sex == "M" else 0.0)
            outcome = "yes" if rng.random() < 1 / (1 + math.exp(-risk)) else "no"
            days = int(rng.integers(1, 200) if outcome == "yes" else rng.integers(100, 400))
            for _ in range(int(rng.integers(1, 3))):
                lactate = "" if rng.random() < 0.1 else f"{rng.gamma(2.0, 1.0):.2f}"
                writer.writerow([f"{path.stem}-{p:04d}", age, sex, lactate, days, outcome])
    return path


class Processes(StudyProcesses):
    """The study's processes on the README's state folders (`Readme.command`)."""

    def __init__(self, root: Path, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.state = root / "state" / "coordinator"

    def site_state(self, site: str) -> Path:
        return self.root / "state" / site


def test_readme_blocks_are_tagged() -> None:
    assert {"query-init", "query-approve", "query-run"} <= set(readme_blocks())


def test_three_hospitals_answer_an_approved_query(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    study_path = tmp_path / "study.toml"
    study_path.write_text(STUDY)
    pki = make_pki(tmp_path, SITES)
    study = load_study(list_members(study_path, pki, SITES))
    query_path = tmp_path / "query.toml"
    query_path.write_text(query_toml(study_sha256(study)))
    query = load_query(query_path, study=study)
    # The README's site names (its commands name st-marys' key and file).
    files = {site: write_hospital(tmp_path / f"{site}.csv", patients=80, seed=i + 1)
             for i, site in enumerate(SITES)}

    run = Processes(tmp_path, study=study_path, pki=pki, processes=processes)
    readme = Readme(tmp_path)
    # The README's draft and offline check run as written (in a folder of their own:
    # the query run here asks more than the draft does).
    drafts = tmp_path / "draft"
    drafts.mkdir()
    (drafts / "study.toml").write_text(STUDY)
    checked = readme.run(f"cd {drafts}\n" + readme.command("query-init", SITES[0]))
    assert "first-questions" in checked and (drafts / "query.toml").exists()
    # Each hospital approves the study and the query (shown, asked, pinned under its
    # state), answering the README command's questions with y.
    for site in SITES:
        shown = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", readme.command("query-approve", site)],
            cwd=tmp_path, env={**os.environ, **readme.env}, input="y\ny\n",
            capture_output=True, text=True, timeout=120, check=True).stdout
        assert "questions" in shown and "epsilon 8" in shown
        assert "first-questions" in shown and "kaplan_meier" in shown
        assert json.loads(shown.splitlines()[-1])["sha256"] == query_sha256(query)

    run.start_coordinator()
    out = tmp_path / "answer"
    asking = readme.start("query-run", readme.command("query-run").rstrip() + " --timeout 300")
    processes.append(asking)
    # Queries run before a study round: in the inbox before any site can start one.
    asking.wait_for(lambda line: "submitted" in str(line.get("text", "")), timeout=120,
                    what="the query submitted")
    # The sites join the study they approved (no --study): the coordinator serves it.
    for site in SITES:
        run.start_site(site, files[site])
    assert asking.wait_exit(timeout=400) == 0, asking.tail(30)
    printed = "\n".join(str(line.get("text", "")) for line in asking.lines)
    assert "first-questions" in printed and "survival" in printed
    # The answer is in (the operator's files, the coordinator's kept sum, each site's
    # ledger entry, written ahead of its release): the study's own rounds that follow
    # are not this test's, so the coordinator and the sites stop before running them.
    for proc in processes:
        proc.stop()

    # What the operator got: JSON, CSV and a plot of the survival curve.
    written = json.loads((out / "answer.json").read_text())
    assert written["query_sha256"] == query_sha256(query) and written["contributors"] == 3
    assert (out / "answer.csv").read_text().startswith("statistic,kind,cell")
    assert (out / "first-questions-survival.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The coordinator kept only the noisy sum (and the noise it carries).
    kept = json.loads((run.state / "queries" / "answers" /
                       f"{query_sha256(query)}.json").read_text())
    noisy = np.asarray(kept["total"], dtype=np.int64)
    assert noisy.shape == (query_length(query, study=study),)

    # The same statistics computed centrally, on the three files pooled.
    pooled = tmp_path / "pooled.csv"
    rows = [row for site in SITES for row in list(csv.reader(files[site].open()))[1:]]
    with pooled.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([COLUMNS, *rows])
    exact = site_vector(query, load_study_table(pooled, study), study=study)
    assert not np.array_equal(noisy, exact)  # the sum carries the DP noise
    truth = answer_query(query, exact, study=study, noise_sigmas=[0.0] * 4, contributors=3)
    assert truth.statistic("patients").estimates[0].value == len({r[0] for r in rows})
    wide = answer_query(query, noisy, study=study, noise_sigmas=kept["noise_sigmas"],
                        contributors=3, level=WIDE)
    reported = {s["name"]: s for s in written["answer"]["statistics"]}
    for name in ("patients", "outcome_by_sex", "mean_lactate", "survival"):
        central = truth.statistic(name).estimates
        released = wide.statistic(name).estimates
        assert len(central) == len(released) > 0
        for true, est in zip(central, released, strict=True):
            assert est.low <= true.value <= est.high, (name, est, true.value)
        # The operator's answer is this same release, read at 95 %.
        assert [e["value"] for e in reported[name]["estimates"]] == pytest.approx(
            [e.value for e in released], nan_ok=True)

    # Every site's ledger holds the query, by name, and `ledger show` lists it.
    for site in SITES:
        ledger = run.site_state(site) / "privacy-ledger.db"
        header, entries = read_ledger(ledger)
        (entry,) = [e for e in entries if e.purpose == "query"]
        assert entry.query is not None and entry.query.name == "first-questions"
        assert entry.query.sha256 == query_sha256(query) and len(entry.mechanisms) == 4
        # The epsilon the answer reports is what the site's ledger charged for the query
        # (its four statistics composed by the ledger's accountant), below their sum;
        # the entry raised the ledger's spend by no more than that.
        charged = compose_epsilon(list(entry.mechanisms), delta=header.delta,
                                  accountant=header.accountant)
        assert written["answer"]["epsilon_composed"] == pytest.approx(charged, rel=1e-9)
        assert charged < query.epsilon == written["answer"]["epsilon"]
        before = max((e.epsilon_after for e in entries if e.seq < entry.seq), default=0.0)
        assert entry.epsilon_after - before <= charged + 1e-9
    shown = run_medfed("ledger", "show", "--ledger",
                       str(run.site_state(SITES[0]) / "privacy-ledger.db")).stdout
    assert "queries answered" in shown and "first-questions" in shown
