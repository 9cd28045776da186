"""The epsilon a query shows is the epsilon the ledger charges: the approval screen
(`medfed site approve`), `medfed query check`, the answer (printed and answer.json) and
the model card (`medfed model show`) give the statistics composed as the ledger
composes them, beside their sum, and it equals the charge of a real release on a real
signed ledger."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import replace
from pathlib import Path

import pytest

from common.commands.cli import main
from common.commands.study import render_study_toml
from common.core.config import SitePolicySection
from common.privacy.layered import charged_by_purpose
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import Gaussian
from common.privacy.signed import LedgerSigner
from common.protocol import pki
from common.releases.analytics.answer import answer_query
from common.releases.analytics.cost import ledger_epsilon, query_cost
from common.releases.analytics.query import Query, load_query, query_bytes, query_sha256
from common.releases.bundle import write_bundle
from common.releases.plugins.query import QUERY_RELEASE, QueryRelease
from common.releases.seam import KIND_RELEASE, study_noise_sites, sum_noise_sigmas
from common.rounds.announcement import Announcement, validate_for_site
from common.study import Study, study_sha256
from coordinator import queries
from coordinator.bundles import queries_before
from site_agent.approvals import Approvals
from site_agent.data import StudyTable, load_study_table
from site_agent.releases import prepare_release, release_vector
from tests.study.helpers import hospital_study, trained_bundle, write_hospital_csv

SITE = "st-marys"
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
ROUND = 4


def spent_on(ledger: PrivacyLedger) -> dict[str, float]:
    """The ledger's epsilon per purpose, each composed alone as it charges them."""
    return charged_by_purpose([(e.purpose, e.mechanisms) for e in ledger.entries()],
                              delta=ledger.delta, accountant=ledger.accountant,
                              charge=ledger.charge)


class Hospital:
    def __init__(self, table: StudyTable) -> None:
        self.table = table


QUERY = """\
name = "rates"
study_sha256 = "{digest}"

[[statistics]]
name = "patients"
kind = "count"
epsilon = 0.4

[[statistics]]
name = "outcome_by_sex"
kind = "rate"
epsilon = 0.4
[[statistics.by]]
feature = "Sex"
"""


def release_on(ledger: PrivacyLedger, state: Path, study: Study, table: StudyTable,
               payload: bytes) -> None:
    """A real release of the approved query: every check, the ledger entry, the noise."""
    policy = SitePolicySection(max_colluding_sites=1)
    ann = Announcement(
        round_number=ROUND, round_nonce=bytes(range(16)),
        participants=("county", "riverside", SITE), threshold=3, neighbours=0,
        vector_length=QueryRelease.from_payload(study, payload).length,
        quantization_bits=20, clip=1.0, histogram_bins=2, secure_aggregation=True,
        model_layout=(), model_sha256=b"", model_bytes=0, local_epochs=0,
        learning_rate=0.1, fedprox_mu=0.0, planned_rounds=1, train_deadline_ms=1,
        phase_timeout_ms=30_000, weight_cap=1, study_sha256=bytes.fromhex(study_sha256(study)),
        kind=KIND_RELEASE, release_name=QUERY_RELEASE, release_payload=payload)
    rnd = validate_for_site(ann, policy=policy, site_id=SITE, study=study)
    release, exact, plans = prepare_release(rnd, study=study, ledger=ledger,
                                            approvals=Approvals(state), policy=policy,
                                            site=Hospital(table))
    release_vector(release, exact, plans, ledger=ledger, round_number=rnd.number, n_sites=3,
                   now=NOW)


def test_every_screen_shows_what_the_ledger_charges(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    study = hospital_study()
    study_path = tmp_path / "study.toml"
    study_path.write_text(render_study_toml(study), encoding="utf-8")
    query_path = tmp_path / "query.toml"
    query_path.write_text(QUERY.format(digest=study_sha256(study)), encoding="utf-8")
    query = load_query(query_path, study=study)
    data = write_hospital_csv(tmp_path / "hospital.csv", 80, seed=6)
    table = load_study_table(data, study)
    state = tmp_path / "state"

    # The approval screen, as the hospital's officer reads it.
    assert main(["site", "approve", str(study_path), str(query_path), "--state", str(state),
                 "--yes"]) == 0
    screen = capsys.readouterr().out
    # `query check` on the same file.
    assert main(["query", "check", "--study", str(study_path), "--query", str(query_path),
                 "--data", str(data), "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)

    # A real release on a real signed ledger (the site's delta is the study's).
    pki.init_ca(tmp_path / "pki")
    pki.issue_site(tmp_path / "pki", SITE, algorithm="ed25519")
    ledger = PrivacyLedger(state / "privacy-ledger.db", site_id=SITE, budget_epsilon=8.0,
                           delta=study.privacy.delta, privacy_unit="patient",
                           signer=LedgerSigner.from_files(*pki.site_paths(tmp_path / "pki",
                                                                          SITE)))
    release_on(ledger, state, study, table, query_bytes(query))
    (entry,) = ledger.entries()
    charged = entry.epsilon_after  # the first entry: what this query added
    assert spent_on(ledger)["query"] == pytest.approx(charged)
    assert charged < query.epsilon  # composition beats the sum of the two statistics

    assert ledger_epsilon(query, study=study) == pytest.approx(charged, rel=1e-12)
    assert f"epsilon       {charged:.4g} charged" in screen
    assert f"{query.epsilon:g} summed" in screen
    assert checked["epsilon_composed"] == pytest.approx(charged, rel=1e-12)
    assert checked["epsilon"] == pytest.approx(query.epsilon)

    # The answer the operator gets (the sum of three such vectors, read with its noise).
    release = QueryRelease(study, query)
    total = 3 * release.query(Hospital(table))
    sigmas = sum_noise_sigmas(release, contributors=3, noise_sites=study_noise_sites(study))
    answer = answer_query(query, total, study=study, noise_sigmas=sigmas, contributors=3)
    assert answer.epsilon_composed == pytest.approx(charged, rel=1e-12)
    assert answer.to_json()["epsilon_composed"] == pytest.approx(charged, rel=1e-12)
    assert f"epsilon {charged:.4g} charged to each site's ledger" in answer.render()

    # The model card of the model trained after it.
    coordinator = tmp_path / "coordinator"
    queries.keep_answer(coordinator, release, total, noise_sigmas=sigmas, contributors=3,
                        round_number=ROUND, answer=answer)
    (named,) = queries_before(coordinator, ROUND + 1)
    assert named.epsilon_composed == pytest.approx(charged, rel=1e-12)
    assert named.epsilon == pytest.approx(query.epsilon)
    bundle = trained_bundle(data, steps=5)
    model = tmp_path / "final.safetensors"
    write_bundle(model, replace(bundle, card=bundle.card.model_copy(
        update={"queries": (named,)})))
    assert main(["model", "show", "--model", str(model)]) == 0
    card = capsys.readouterr().out
    assert f"epsilon {charged:.4g} charged (its statistics composed; 0.8 summed)" in card


def test_on_a_ledger_with_history_the_query_is_charged_no_more_than_on_its_own(
    tmp_path: Path,
) -> None:
    """After earlier releases the ledger's increase for the query is what the per-round
    cap measures, and here it is below the figure shown (what the query costs composed
    on its own, which is also its purpose's share in `ledger show`)."""
    study = hospital_study()
    query = load_query_text(tmp_path, study)
    table = load_study_table(write_hospital_csv(tmp_path / "h.csv", 60, seed=9), study)
    state = tmp_path / "state"
    state.mkdir()
    Approvals(state).approve_study(study)
    Approvals(state).approve_query(name=query.name, sha256=query_sha256(query), study=study,
                                   times=1, now=NOW)
    pki.init_ca(tmp_path / "pki")
    pki.issue_site(tmp_path / "pki", SITE, algorithm="ed25519")
    ledger = PrivacyLedger(state / "privacy-ledger.db", site_id=SITE, budget_epsilon=8.0,
                           delta=study.privacy.delta, privacy_unit="patient",
                           signer=LedgerSigner.from_files(*pki.site_paths(tmp_path / "pki",
                                                                          SITE)))
    ledger.reserve(1, [Gaussian(2.0, 1.0)], now=NOW, purpose="count")
    before = ledger.spent()
    release_on(ledger, state, study, table, query_bytes(query))
    shown = query_cost(query, study=study, policy=None).epsilon_composed
    assert spent_on(ledger)["query"] == pytest.approx(shown, rel=1e-12)
    assert 0 < ledger.spent() - before <= shown


def load_query_text(tmp_path: Path, study: Study) -> Query:
    path = tmp_path / "query.toml"
    path.write_text(QUERY.format(digest=study_sha256(study)), encoding="utf-8")
    return load_query(path, study=study)
