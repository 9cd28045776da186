"""A coordinator that tries to learn more from approved queries than one answer each.

Each site's own checks (`site_agent.releases.prepare_release`, what the agent runs on
every release round before anything leaves it), its real signed ledger, its real
approvals under its state folder, and the real SecAgg+ sum (in-process) of the sites'
noised vectors:

* re-running a query: the second announcement of the same query (same SHA-256) is
  refused (QueryRefused, so the site declines with QUERY_NOT_APPROVED) unless the
  approval allows more runs; re-announcing the same round number is refused too;
* splitting one query into narrow ones: each is refused until approved, and each one
  approved is a ledger entry of its own, composed with everything before it;
* a cell of one patient: released only under the DP noise, which the ledger paid for;
  the coordinator's answer carries a noise std that hides one patient;
* a query the budget cannot pay: BudgetExhausted (the budget decline), nothing written;
* a query for another study, or bytes that are not the approved canonical form: refused.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.core.config import SitePolicySection
from common.core.errors import (
    BudgetExhausted,
    QueryRefused,
    RoundFailed,
    StateError,
    ValidationError,
)
from common.privacy.accountant import compose_epsilon
from common.privacy.ledger import PrivacyLedger, verify_ledger
from common.privacy.signed import LedgerSigner, QueryRef, SignedEntry
from common.protocol import pki
from common.releases.analytics.query import Query, query_bytes, query_from_mapping, query_sha256
from common.releases.analytics.vector import query_length
from common.releases.plugins.query import QUERY_RELEASE, QueryRelease
from common.releases.seam import KIND_RELEASE, read_sum
from common.rounds.announcement import Announcement, VerifiedRound, validate_for_site
from common.study import Study, study_from_mapping, study_sha256
from site_agent.approvals import Approvals
from site_agent.data import StudyTable, load_study_table
from site_agent.query_releases import QueryReleases
from site_agent.releases import prepare_release, release_vector
from tests.secagg.secagg_harness import make_federation, run_round
from tests.study.helpers import study_mapping, write_hospital_csv

SITES = ("site-000", "site-001", "site-002")
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
POLICY = SitePolicySection(max_colluding_sites=1)
DELTA = 1e-3  # the study's (study_mapping): each statistic's sigma is calibrated at it


@dataclass(frozen=True)
class Hospital:
    """What a release reads on a site (the training hook's `table`)."""

    table: StudyTable


@pytest.fixture(scope="module")
def study() -> Study:
    return study_from_mapping(study_mapping(), source="test")


@pytest.fixture(scope="module")
def hospitals(study: Study, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Hospital]:
    root = tmp_path_factory.mktemp("hospitals")
    return {site: Hospital(load_study_table(
        write_hospital_csv(root / f"{site}.csv", 40, seed=i + 1), study))
        for i, site in enumerate(SITES)}


@pytest.fixture(scope="module")
def signers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LedgerSigner]:
    root = tmp_path_factory.mktemp("query-pki")
    pki.init_ca(root)
    out = {}
    for site in SITES:
        pki.issue_site(root, site, algorithm="ed25519")
        out[site] = LedgerSigner.from_files(*pki.site_paths(root, site))
    return out


def make_query(study: Study, name: str, *, cohort: list[dict[str, Any]] | None = None,
               epsilon: float = 0.5) -> Query:
    return query_from_mapping({
        "name": name, "study_sha256": study_sha256(study), "cohort": cohort or [],
        "statistics": [
            {"name": "patients", "kind": "count", "epsilon": epsilon},
            {"name": "outcome_by_sex", "kind": "rate", "epsilon": epsilon,
             "by": [{"feature": "Sex"}]},
        ],
    })


def announce(study: Study, query: Query, number: int, payload: bytes | None = None) -> Announcement:
    return Announcement(
        round_number=number, round_nonce=bytes(range(16)), participants=SITES, threshold=3,
        neighbours=0, vector_length=query_length(query, study=study), quantization_bits=20,
        clip=1.0, histogram_bins=2, secure_aggregation=True, model_layout=(),
        model_sha256=b"", model_bytes=0, local_epochs=0, learning_rate=0.1, fedprox_mu=0.0,
        planned_rounds=1, train_deadline_ms=1, phase_timeout_ms=30_000, weight_cap=1,
        study_sha256=bytes.fromhex(study_sha256(study)), kind=KIND_RELEASE,
        release_name=QUERY_RELEASE,
        release_payload=query_bytes(query) if payload is None else payload,
    )


class Site:
    """One hospital: its approvals, its signed ledger, its data."""

    def __init__(self, name: str, root: Path, signer: LedgerSigner, hospital: Hospital,
                 *, budget: float = 20.0) -> None:
        self.name = name
        self.hospital = hospital
        (root / name).mkdir(parents=True, exist_ok=True)
        self.approvals = Approvals(root / name)
        self.ledger = PrivacyLedger(root / name / "privacy-ledger.db", site_id=name,
                                    budget_epsilon=budget, delta=DELTA,
                                    privacy_unit="patient", signer=signer)

    def verified(self, ann: Announcement, study: Study) -> VerifiedRound:
        return validate_for_site(ann, policy=POLICY, site_id=self.name, study=study)

    def release(self, ann: Announcement, study: Study) -> np.ndarray:
        """Every check, then the ledger entry (write-ahead), then the noised vector."""
        rnd = self.verified(ann, study)
        release, exact, plans = prepare_release(
            rnd, study=study, ledger=self.ledger, approvals=self.approvals, policy=POLICY,
            site=self.hospital)
        return release_vector(release, exact, plans, ledger=self.ledger,
                              round_number=rnd.number, n_sites=len(SITES), now=NOW)

    def query_entries(self) -> list[SignedEntry]:
        return [e for e in self.ledger.entries() if e.purpose == "query"]


@pytest.fixture
def sites(tmp_path: Path, signers: dict[str, LedgerSigner],
          hospitals: dict[str, Hospital]) -> dict[str, Site]:
    return {s: Site(s, tmp_path, signers[s], hospitals[s]) for s in SITES}


def approve(sites: dict[str, Site], study: Study, query: Query, *, times: int = 1) -> None:
    for site in sites.values():
        site.approvals.approve_query(name=query.name, sha256=query_sha256(query), study=study,
                                     times=times, now=NOW)


def test_a_coordinator_rerunning_a_query_is_refused(study: Study, sites: dict[str, Site]) -> None:
    query = make_query(study, "rates")
    approve(sites, study, query)
    site = sites["site-000"]
    site.release(announce(study, query, 5), study)
    (entry,) = site.query_entries()
    assert entry.query == QueryRef(name="rates", sha256=query_sha256(query))
    # The same round again: already on the ledger.
    with pytest.raises(RoundFailed, match="already on this site's privacy ledger"):
        site.release(announce(study, query, 5), study)
    # The same query in a new round: its one approved run is used.
    with pytest.raises(QueryRefused, match="already ran 1 time"):
        site.release(announce(study, query, 6), study)
    assert len(site.query_entries()) == 1
    # An approval for two runs allows exactly one more, paid for again.
    approve(sites, study, query, times=2)
    spent = site.ledger.spent()
    site.release(announce(study, query, 6), study)
    assert site.ledger.spent() > spent
    with pytest.raises(QueryRefused, match="already ran 2 time"):
        site.release(announce(study, query, 7), study)
    assert [e.round for e in site.query_entries()] == [5, 6]


def test_splitting_a_query_needs_each_part_approved_and_each_is_paid_for(
    study: Study, sites: dict[str, Site],
) -> None:
    whole = make_query(study, "whole")
    narrow = [make_query(study, f"only-{level}", cohort=[{"feature": "Sex", "levels": [level]}])
              for level in ("F", "M")]
    approve(sites, study, whole)
    site = sites["site-001"]
    site.release(announce(study, whole, 10), study)
    # The narrow queries are other files (other digests): refused until approved.
    for number, part in enumerate(narrow, start=11):
        with pytest.raises(QueryRefused, match="not one this site approved"):
            site.release(announce(study, part, number), study)
    assert len(site.query_entries()) == 1
    # Approved one by one, each is one more entry on the ledger, composed with the rest.
    for part in narrow:
        approve(sites, study, part)
    before = site.ledger.spent()
    for number, part in enumerate(narrow, start=11):
        site.release(announce(study, part, number), study)
        assert site.ledger.spent() > before
        before = site.ledger.spent()
    entries = site.query_entries()
    assert [e.query.name for e in entries if e.query] == ["whole", "only-F", "only-M"]
    everything = [m for e in site.ledger.entries() for m in e.mechanisms]
    assert site.ledger.spent() == pytest.approx(
        compose_epsilon(everything, delta=DELTA, accountant=site.ledger.accountant))
    # Each entry holds one mechanism per statistic (two blocks, each its own sigma).
    assert all(len(e.mechanisms) == 2 for e in entries)
    # The signed entries (naming their queries) verify and survive export.
    assert verify_ledger(site.ledger.path).ok
    exported = site.ledger.export().entries
    assert [SignedEntry.from_json_dict(e.to_json_dict()).query for e in exported] == [
        e.query for e in entries]


def test_a_cell_of_one_patient_is_only_noise_and_the_ledger_pays_for_it(
    study: Study, sites: dict[str, Site], hospitals: dict[str, Hospital],
) -> None:
    # The cohort: the ages of exactly one patient across the three hospitals.
    ages = np.concatenate([np.asarray(h.table.numeric["Age (years)"]) for h in hospitals.values()])
    values, counts = np.unique(ages, return_counts=True)
    lone = float(values[counts == 2][0])  # two visits of one patient
    query = make_query(study, "one-patient", cohort=[
        {"feature": "Age (years)", "range": [lone - 0.25, lone + 0.25]}])
    approve(sites, study, query)
    release = QueryRelease(study, query)
    exact = sum(release.query(h) for h in hospitals.values())
    assert exact[0] == 1  # the count cell: one patient
    ann = announce(study, query, 20)
    vectors = {name: site.release(ann, study) for name, site in sites.items()}
    for site in sites.values():
        (entry,) = site.query_entries()
        plans = release.plans(n_noise=2)  # round floor 3 minus 1 colluding site
        assert entry.mechanisms == tuple(p.mechanism() for p in plans)
        # Charged what its two statistics cost composed: within their epsilons' sum.
        assert entry.epsilon_after == pytest.approx(compose_epsilon(
            list(entry.mechanisms), delta=DELTA, accountant=site.ledger.accountant))
        assert 0 < entry.epsilon_after <= query.epsilon + 1e-9
    federation = make_federation(3, threshold=3, vector_length=release.length,
                                 round_number=20, min_round_sites=3, max_colluding_sites=1)
    federation_vectors = dict(zip(federation.params.participants, vectors.values(), strict=True))
    total, survivors = run_round(federation, federation_vectors)
    assert len(survivors) == 3
    answer = read_sum(release, total, contributors=3, noise_sites=2,
                      round_number=20).value
    (count,) = [e for e in answer.statistic("patients").estimates]
    # One patient more or less is well inside the noise the coordinator is told of: the
    # noise std is over twice the one patient's contribution. (Where the noisy value and
    # its interval land is random, and a count is clamped at 0: asserting the interval
    # covers 0 and 2 failed about 1 run in 8.)
    assert count.std > 2.0
    assert 0.0 <= count.low <= count.value <= count.high
    assert answer.statistic("patients").noise_std == pytest.approx(count.std)


def test_a_query_the_budget_cannot_pay_is_declined_for_budget(
    study: Study, tmp_path: Path, signers: dict[str, LedgerSigner],
    hospitals: dict[str, Hospital],
) -> None:
    site = Site("site-002", tmp_path, signers["site-002"], hospitals["site-002"], budget=0.5)
    query = make_query(study, "costly", epsilon=2.0)
    site.approvals.approve_query(name=query.name, sha256=query_sha256(query), study=study,
                                 times=1, now=NOW)
    with pytest.raises(BudgetExhausted, match="the query release"):
        site.release(announce(study, query, 30), study)
    assert site.ledger.entries() == []


def test_a_query_of_another_study_or_other_bytes_is_refused(
    study: Study, sites: dict[str, Site],
) -> None:
    site = sites["site-000"]
    query = make_query(study, "rates")
    other = study_from_mapping({**study_mapping(), "study": {
        "name": "another", "rounds": 3, "classes": ["no", "yes"]}}, source="test")
    # Approved, but for another study than the one this site joined.
    site.approvals.approve_query(name=query.name, sha256=query_sha256(query), study=other,
                                 times=1, now=NOW)
    with pytest.raises(QueryRefused, match="another study"):
        site.release(announce(study, query, 40), study)
    # The approved bytes, re-encoded (same content, other bytes): not the approved form.
    approve(sites, study, query)
    spaced = query_bytes(query).replace(b",", b", ")
    assert hashlib.sha256(spaced).hexdigest() != query_sha256(query)
    with pytest.raises(QueryRefused, match="not one this site approved"):
        site.release(announce(study, query, 41, payload=spaced), study)
    # Approved under that digest too, the bytes still do not parse as a canonical query.
    site.approvals.approve_query(name=query.name, sha256=hashlib.sha256(spaced).hexdigest(),
                                 study=study, times=1, now=NOW)
    with pytest.raises(ValidationError, match="canonical"):
        site.release(announce(study, query, 42, payload=spaced), study)
    # The payload is bound into the announcement digest (a split view aborts SecAgg+).
    ann = announce(study, query, 43)
    assert dataclasses.replace(ann, release_payload=spaced).digest() != ann.digest()
    assert site.query_entries() == []


def test_a_site_dropping_out_of_a_query_round_leaves_the_survivors_sum_answered(
    study: Study, sites: dict[str, Site], hospitals: dict[str, Hospital],
) -> None:
    """Dropouts as in training rounds: one of three sites paid (its ledger entry is
    written first) and then vanished before its masked input; SecAgg+ unmasks the two
    survivors' sum, and the answer is read with the two survivors' noise (each site
    planned for n_noise = 2 honest shares, so two survivors carry the full sigma) and
    covers their exact pooled count."""
    from common.protocol.secagg.phases import Phase

    query = make_query(study, "with-a-dropout")
    approve(sites, study, query)
    release = QueryRelease(study, query)
    ann = announce(study, query, 30)
    vectors = {name: site.release(ann, study) for name, site in sites.items()}
    assert all(len(site.query_entries()) == 1 for site in sites.values())  # all paid
    federation = make_federation(3, threshold=2, vector_length=release.length,
                                 round_number=30, min_round_sites=2, max_colluding_sites=0)
    names = dict(zip(federation.params.participants, SITES, strict=True))
    federation_vectors = {fed: vectors[site] for fed, site in names.items()}
    gone = federation.params.participants[2]
    total, survivors = run_round(federation, federation_vectors,
                                 dropouts={gone: Phase.MASKED_INPUT})
    assert gone not in survivors and len(survivors) == 2
    answer = read_sum(release, total, contributors=2, noise_sites=2,
                      round_number=30).value
    exact = sum(release.query(hospitals[names[s]]) for s in survivors)
    (count,) = answer.statistic("patients").estimates
    # The two survivors' own noise std: the full sigma of one statistic at n_noise = 2.
    (plan, _) = release.plans(n_noise=2)
    assert answer.statistic("patients").noise_std == pytest.approx(plan.sigma)
    assert count.low - 6 * plan.sigma <= exact[0] <= count.high + 6 * plan.sigma
    assert abs(count.value - exact[0]) < 6 * plan.sigma


class SiteWithoutLedger:
    """A hospital whose trainer keeps no ledger (`--trainer nonprivate`): its approvals,
    its query release counts beside them, its data; released as `RoundRelease.run`
    does."""

    def __init__(self, name: str, root: Path, hospital: Hospital) -> None:
        (root / name).mkdir(parents=True, exist_ok=True)
        self.name = name
        self.approvals = Approvals(root / name)
        self.hospital = hospital

    def release(self, ann: Announcement, study: Study) -> np.ndarray:
        rnd = validate_for_site(ann, policy=POLICY, site_id=self.name, study=study)
        release, exact, plans = prepare_release(
            rnd, study=study, ledger=None, approvals=self.approvals, policy=POLICY,
            site=self.hospital)
        return release_vector(release, exact, plans, ledger=None, round_number=rnd.number,
                              n_sites=len(SITES), now=NOW,
                              query_releases=QueryReleases.beside(self.approvals))


def test_attack_query_reruns_without_a_ledger(
    study: Study, tmp_path: Path, hospitals: dict[str, Hospital],
) -> None:
    """A coordinator re-announces a query approved `--times 1` at a site that keeps no
    ledger, twenty times: it is answered once (before, 20 of 20: the allowance was
    counted on ledger entries, of which such a site has none). The count is on disk
    before the answer leaves, survives a restart, and a damaged count refuses."""
    site = SiteWithoutLedger("site-000", tmp_path, hospitals["site-000"])
    query = make_query(study, "rates")
    sha256 = query_sha256(query)
    site.approvals.approve_query(name=query.name, sha256=sha256, study=study, times=1,
                                 now=NOW)
    answered, refused = 0, []
    for number in range(50, 70):
        try:
            site.release(announce(study, query, number), study)
            answered += 1
        except QueryRefused as exc:
            refused.append(str(exc))
    assert answered == 1 and len(refused) == 19
    counts = QueryReleases.beside(site.approvals)
    assert counts.rounds(sha256) == [50]
    assert "already ran 1 time(s) (counted in" in refused[0]
    assert str(counts.path(sha256)) in refused[0]

    # The site restarts (a new process reads the same state folder): still used up.
    again = SiteWithoutLedger("site-000", tmp_path, hospitals["site-000"])
    with pytest.raises(QueryRefused, match="already ran 1 time"):
        again.release(announce(study, query, 80), study)
    # Approved for three runs: exactly two more.
    again.approvals.approve_query(name=query.name, sha256=sha256, study=study, times=3,
                                  now=NOW)
    again.release(announce(study, query, 81), study)
    again.release(announce(study, query, 82), study)
    with pytest.raises(QueryRefused, match="already ran 3 time"):
        again.release(announce(study, query, 83), study)
    assert counts.rounds(sha256) == [50, 81, 82]

    # The count cannot be forgotten by damaging it, nor skipped by a caller.
    counts.path(sha256).write_text("{")
    with pytest.raises(StateError, match="deleting it would let the query run again"):
        again.release(announce(study, query, 84), study)
    counts.path(sha256).unlink()
    rnd = validate_for_site(announce(study, query, 85), policy=POLICY, site_id="site-000",
                            study=study)
    release, exact, plans = prepare_release(
        rnd, study=study, ledger=None, approvals=again.approvals, policy=POLICY,
        site=again.hospital)
    with pytest.raises(RoundFailed, match="counts its query runs"):
        release_vector(release, exact, plans, ledger=None, round_number=85,
                       n_sites=len(SITES), now=NOW)
