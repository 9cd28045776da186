"""Attack: a query release skipped the per-round cap. `prepare_release` checked only the
total budget, so with `max_epsilon_per_round = 1` in both the site's policy and the
study, an approved one-patient query spent epsilon 7.1 in one round (noise std 0.7 on
the count); `site approve QUERY` pinned it without a policy check, and `query check`
could not take the site's policy, so its documented exit 1 never happened.

Now every round release is held, before anything is written, to the smaller of the
site's and the study's cap, measured as training rounds are (what it adds to the
composed ledger, `epsilon_added`): a query over it is declined (QueryRefused: that query
only) and not charged. `site approve` refuses to pin a query whose one run is above the
cap, and `query check --config SITE.toml` exits 1 on the site's policy.

Real signed ledgers (SQLite), real approvals under a state folder, the real CLI.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.commands.cli import main
from common.core.config import SitePolicySection
from common.core.errors import QueryRefused
from common.privacy.accountant import epsilon_added
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import Gaussian
from common.privacy.signed import LedgerSigner
from common.protocol import pki
from common.releases.analytics.cost import ledger_epsilon
from common.releases.analytics.query import Query, query_bytes, query_from_mapping, query_sha256
from common.releases.analytics.vector import query_length, query_mechanisms
from common.releases.plugins.query import QUERY_RELEASE, QueryRelease
from common.releases.seam import KIND_RELEASE
from common.rounds.announcement import Announcement, validate_for_site
from common.study import Study, load_study, study_from_mapping, study_sha256
from site_agent.approvals import Approvals
from site_agent.data import StudyTable, load_study_table
from site_agent.releases import prepare_release, release_vector
from tests.study.helpers import study_mapping, study_toml, write_hospital_csv

SITES = ("site-000", "site-001", "site-002")
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
DELTA = 1e-3  # study_mapping's delta; the ledgers' too
CAP = 1.0


class Hospital:
    """What a release reads on a site (the training hook's `table`)."""

    def __init__(self, table: StudyTable) -> None:
        self.table = table


def capped_study(*, study_cap: float | None) -> Study:
    extra = {} if study_cap is None else {"max_epsilon_per_round": study_cap}
    return study_from_mapping(study_mapping(**extra), source="test")


@pytest.fixture(scope="module")
def hospital(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hospital_csv(tmp_path_factory.mktemp("hospital") / "site-000.csv", 60, seed=4)


@pytest.fixture(scope="module")
def signer(tmp_path_factory: pytest.TempPathFactory) -> LedgerSigner:
    root = tmp_path_factory.mktemp("cap-pki")
    pki.init_ca(root)
    pki.issue_site(root, SITES[0], algorithm="ed25519")
    return LedgerSigner.from_files(*pki.site_paths(root, SITES[0]))


def one_patient_query(study: Study, table: StudyTable, *, epsilon: float) -> Query:
    """A count whose cohort is one patient of this site (an age no one else has)."""
    ages = np.asarray(table.numeric["Age (years)"])
    values, counts = np.unique(ages, return_counts=True)
    lone = float(values[counts == min(counts)][0])
    return query_from_mapping({
        "name": f"one-patient-{epsilon:g}", "study_sha256": study_sha256(study),
        "cohort": [{"feature": "Age (years)", "range": [lone - 0.25, lone + 0.25]}],
        "statistics": [{"name": "patients", "kind": "count", "epsilon": epsilon}],
    })


def announce(study: Study, query: Query, number: int) -> Announcement:
    return Announcement(
        round_number=number, round_nonce=bytes(range(16)), participants=SITES, threshold=3,
        neighbours=0, vector_length=query_length(query, study=study), quantization_bits=20,
        clip=1.0, histogram_bins=2, secure_aggregation=True, model_layout=(),
        model_sha256=b"", model_bytes=0, local_epochs=0, learning_rate=0.1, fedprox_mu=0.0,
        planned_rounds=1, train_deadline_ms=1, phase_timeout_ms=30_000, weight_cap=1,
        study_sha256=bytes.fromhex(study_sha256(study)), kind=KIND_RELEASE,
        release_name=QUERY_RELEASE, release_payload=query_bytes(query),
    )


class Site:
    """One hospital: its pinned approvals, its signed ledger, its data and policy."""

    def __init__(self, root: Path, signer: LedgerSigner, hospital: Hospital,
                 policy: SitePolicySection) -> None:
        self.hospital = hospital
        self.policy = policy
        root.mkdir(parents=True, exist_ok=True)
        self.approvals = Approvals(root)
        self.ledger = PrivacyLedger(root / "privacy-ledger.db", site_id=SITES[0],
                                    budget_epsilon=20.0, delta=DELTA,
                                    privacy_unit="patient", signer=signer)

    def pin(self, study: Study, query: Query) -> None:
        """The approval as a pin made before `site approve` checked the cap."""
        self.approvals.approve_query(name=query.name, sha256=query_sha256(query),
                                     study=study, times=1, now=NOW)

    def release(self, study: Study, query: Query, number: int) -> np.ndarray:
        """Every check a site runs, then its ledger entry, then the noised vector."""
        rnd = validate_for_site(announce(study, query, number), policy=self.policy,
                                site_id=SITES[0], study=study)
        release, exact, plans = prepare_release(
            rnd, study=study, ledger=self.ledger, approvals=self.approvals,
            policy=self.policy, site=self.hospital)
        return release_vector(release, exact, plans, ledger=self.ledger,
                              round_number=rnd.number, n_sites=len(SITES), now=NOW)


def site_at(tmp_path: Path, signer: LedgerSigner, hospital: Path, study: Study, *,
            site_cap: float | None) -> Site:
    policy = SitePolicySection(max_colluding_sites=1, max_epsilon_per_round=site_cap)
    return Site(tmp_path / "state", signer, Hospital(load_study_table(hospital, study)),
                policy)


def test_attack_query_skips_the_round_cap(
    tmp_path: Path, signer: LedgerSigner, hospital: Path,
) -> None:
    """The issue's case: caps of 1 at the site and in the study, an approved
    one-patient count at epsilon 7.1. Declined before its ledger entry; a query within
    the cap still runs and pays."""
    study = capped_study(study_cap=CAP)
    site = site_at(tmp_path, signer, hospital, study, site_cap=CAP)
    greedy = one_patient_query(study, site.hospital.table, epsilon=7.1)
    release = QueryRelease(study, greedy)
    assert release.query(site.hospital)[0] == 1  # the count cell: one patient
    (plan,) = release.plans(n_noise=2)
    assert plan.sigma < 1.0  # the one patient stands out of the noise
    mechanisms = query_mechanisms(greedy, study=study, n_noise=2)
    assert epsilon_added([], mechanisms, delta=DELTA) > 5 * CAP  # what it used to spend
    site.pin(study, greedy)
    with pytest.raises(QueryRefused, match=r"more than the per-round cap 1 \(") as caught:
        site.release(study, greedy, 5)
    assert greedy.name in str(caught.value) and "nothing charged" in str(caught.value)
    assert site.ledger.entries() == []  # not charged

    modest = one_patient_query(study, site.hospital.table, epsilon=0.5)
    site.pin(study, modest)
    site.release(study, modest, 6)
    (entry,) = site.ledger.entries()
    assert entry.query is not None and entry.query.name == modest.name
    assert entry.epsilon_after <= CAP


@pytest.mark.parametrize(("site_cap", "study_cap", "source"), [
    (CAP, None, "this site's policy.max_epsilon_per_round"),
    (None, CAP, "the study's privacy.max_epsilon_per_round"),
    (4.0, CAP, "the study's privacy.max_epsilon_per_round"),
    (CAP, 4.0, "this site's policy.max_epsilon_per_round"),
])
def test_attack_query_skips_either_cap(
    tmp_path: Path, signer: LedgerSigner, hospital: Path, site_cap: float | None,
    study_cap: float | None, source: str,
) -> None:
    """The smaller of the two caps holds, whichever side sets it."""
    study = capped_study(study_cap=study_cap)
    site = site_at(tmp_path, signer, hospital, study, site_cap=site_cap)
    query = one_patient_query(study, site.hospital.table, epsilon=2.0)
    site.pin(study, query)
    with pytest.raises(QueryRefused, match=f"per-round cap 1 \\({source}\\)"):
        site.release(study, query, 5)
    assert site.ledger.entries() == []


def test_the_cap_is_what_the_query_adds_to_the_composed_ledger(
    tmp_path: Path, signer: LedgerSigner, hospital: Path,
) -> None:
    """The training rounds' measure: eps(ledger + query) - eps(ledger), both composed.
    After earlier releases a query composes for less than on its own, and it is that
    increase that is held to the cap (a query above it on its own is still refused on
    an empty ledger, and by `site approve`)."""
    study = capped_study(study_cap=CAP)
    site = site_at(tmp_path, signer, hospital, study, site_cap=None)
    query = one_patient_query(study, site.hospital.table, epsilon=1.5)
    site.pin(study, query)
    assert ledger_epsilon(query, study=study) > CAP
    earlier = Gaussian(1.0, 1.0)
    site.ledger.reserve(1, [earlier], now=NOW, purpose="count")
    added = epsilon_added([earlier], query_mechanisms(query, study=study, n_noise=2),
                          delta=DELTA)
    assert added <= CAP
    spent = site.ledger.spent()
    site.release(study, query, 5)
    assert site.ledger.spent() - spent == pytest.approx(added)


# ------------------------------------------------------------------ the commands


def write_files(tmp_path: Path, hospital: Path, *, study_cap: float | None,
                site_cap: float | None, epsilon: float) -> dict[str, Path]:
    """study.toml, query.toml (a count at `epsilon`) and the site's config."""
    extra: dict[str, Any] = {} if study_cap is None else {"max_epsilon_per_round": study_cap}
    study_path = tmp_path / "study.toml"
    study_path.write_text(study_toml("capped", rounds=2, **extra), encoding="utf-8")
    loaded = load_study(study_path)
    query_path = tmp_path / "query.toml"
    query_path.write_text(
        f'name = "costly"\nstudy_sha256 = "{study_sha256(loaded)}"\n\n'
        f'[[statistics]]\nname = "patients"\nkind = "count"\nepsilon = {epsilon}\n',
        encoding="utf-8")
    config = tmp_path / "site.toml"
    policy = "" if site_cap is None else f"\n[policy]\nmax_epsilon_per_round = {site_cap}\n"
    config.write_text(
        f'site = "{SITES[0]}"\ncoordinator = "127.0.0.1:7443"\n'
        f'state = "{tmp_path / "state"}"\npki = "{tmp_path / "pki"}"\n\n'
        f'[data]\npath = "{hospital}"\n{policy}', encoding="utf-8")
    return {"study": study_path, "query": query_path, "config": config}


def test_attack_approve_pins_a_query_over_the_cap(
    tmp_path: Path, hospital: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """`site approve --config` holds the query to the site's cap (and the study's):
    refused, nothing pinned; with only `--state` it says what it could not check."""
    files = write_files(tmp_path, hospital, study_cap=None, site_cap=CAP, epsilon=2.0)
    state = tmp_path / "state"
    assert main(["site", "approve", str(files["study"]), "--state", str(state), "--yes"]) == 0
    capsys.readouterr()
    approvals = Approvals(state)
    study = approvals.study()
    assert study is not None
    sha = query_sha256(query_from_mapping(
        {"name": "costly", "study_sha256": study_sha256(study),
         "statistics": [{"name": "patients", "kind": "count", "epsilon": 2.0}]}))

    assert main(["site", "approve", str(files["query"]), "--config", str(files["config"]),
                 "--yes"]) == 2
    captured = capsys.readouterr()
    assert "ABOVE the per-round cap 1 (this site's policy.max_epsilon_per_round)" in (
        captured.out)
    assert "not approved" in captured.err and "above the per-round cap 1" in captured.err
    assert approvals.query(sha) is None

    # With only the state folder the site's own cap is not known: the study's limits
    # are checked, the screen says so, and `site run` holds it to the cap at its run.
    assert main(["site", "approve", str(files["query"]), "--state", str(state),
                 "--yes"]) == 0
    shown = capsys.readouterr().out
    assert "against the study's own limits only" in shown and "--config" in shown
    assert approvals.query(sha) is not None


def test_attack_approve_pins_a_query_over_the_studys_cap(
    tmp_path: Path, hospital: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """The study's cap is in the study: refused at approval from the state folder alone."""
    files = write_files(tmp_path, hospital, study_cap=CAP, site_cap=None, epsilon=7.1)
    state = tmp_path / "state"
    assert main(["site", "approve", str(files["study"]), str(files["query"]),
                 "--state", str(state), "--yes"]) == 2
    captured = capsys.readouterr()
    assert "the study's privacy.max_epsilon_per_round" in captured.err
    assert not any(Approvals(state).folder.glob("queries/*.json"))


def test_attack_query_check_cannot_take_the_site_policy(
    tmp_path: Path, hospital: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """`query check --config SITE.toml` holds the query to the site's policy and exits 1
    when it refuses it; the README's command (no config) still exits 0 and says what it
    did not check."""
    files = write_files(tmp_path, hospital, study_cap=None, site_cap=CAP, epsilon=2.0)
    readme = ["query", "check", "--study", str(files["study"]), "--query",
              str(files["query"]), "--data", str(hospital)]
    assert main(readme) == 0
    assert "give --config SITE.toml" in capsys.readouterr().out
    # The site's file comes from its config's data.path.
    assert main(["query", "check", "--study", str(files["study"]), "--query",
                 str(files["query"]), "--config", str(files["config"]), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["released"] is False
    assert any("above the per-round cap 1 (this site's policy.max_epsilon_per_round)" in p
               for p in report["problems"])
    assert report["epsilon_composed"] > CAP
