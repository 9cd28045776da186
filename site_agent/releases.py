"""The DP values a site releases beside its model update (`common.releases.seam`): the
evaluation histogram every model round carries (noised here, its ledger entry written
with the round's training entry) and the releases a round carries alone, the study's
statistics among them (`RoundRelease`, one generic path for any registered release).
Each is on the ledger, write-ahead, before anything leaves the site; a round number
already on the ledger is never released again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Sequence
from datetime import datetime

import numpy as np

from common.core.config import SitePolicySection, SiteSettings
from common.core.errors import (
    BudgetExhausted,
    QueryRefused,
    RoundFailed,
    StudyRefused,
    ValidationError,
)
from common.crypto.random import RandomSource, numpy_generator, system_random
from common.privacy.accountant import epsilon_added
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import Mechanism
from common.privacy.purpose import ROUND_PURPOSES
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.releases.plugins.evaluation_histogram import (
    EvaluationHistogram,
    evaluation_noise_sites,
    evaluation_noise_std,
)
from common.releases.seam import (
    DpRelease,
    NoisePlan,
    build_release,
    check_plans,
    planned_noise_sites,
    release_for_round,
)
from common.rounds.announcement import VerifiedRound
from common.study import Study, per_round_cap, study_round_terms, study_sha256
from common.study.policy import ROUND_CAP_SLACK
from site_agent import dp_release
from site_agent.approvals import Approvals, times_released
from site_agent.connection import Heartbeats
from site_agent.membership import Membership, utcnow
from site_agent.metrics import SiteMetrics
from site_agent.phases import SecAggPhases
from site_agent.query_releases import QueryReleases
from site_agent.round_timeline import RoundTimeline
from site_agent.site_training import LocalUpdate, TrainingHook
from site_agent.statistics_pin import RELEASED_WAY_OUT, StatisticsPin

log = logging.getLogger("medfed.site")



def refuse_recorded_round(ledger: PrivacyLedger | None, rnd: VerifiedRound) -> None:
    """RoundFailed when `rnd`'s number is already on the ledger for a round release."""
    if ledger is not None and any(
        entry.round == rnd.number and entry.purpose in ROUND_PURPOSES
        for entry in ledger.entries()
    ):
        # The ledger's reserve() is idempotent per round number (a crash-restart
        # must not double-charge), so a second training for a round number already
        # on the ledger would release a fresh noisy update at no recorded cost: a
        # coordinator re-announcing a round could average the DP noise away.
        raise RoundFailed(
            f"round {rnd.number} is already on this site's privacy ledger: "
            "refusing to release a second update for it"
        )


class EvaluationRelease:
    """The DP score histogram of a model round (`dp_release`): its ledger record, and
    the noised (or all-zero) histogram that replaces the hook's exact one."""

    def __init__(self, settings: SiteSettings, hook: TrainingHook, membership: Membership) -> None:
        self.settings = settings
        self.hook = hook
        self.membership = membership

    def mechanisms(self, rnd: VerifiedRound) -> list[Mechanism]:
        """The ledger record of this round's DP score histogram ([] when the site keeps
        no ledger, or its `max_evaluations` are used up in a training round)."""
        ledger = self.membership.ledger
        if ledger is None:
            return []
        policy = self.settings.policy
        if not dp_release.check_evaluation_allowed(ledger, policy):
            if rnd.plan.local_epochs == 0:
                raise dp_release.refuse_evaluation_only(rnd.number)
            return []
        study = self.membership.study
        if (rnd.plan.local_epochs > 0 and study is not None
                and study.training.final_evaluation
                and dp_release.evaluations_used(ledger) + 1 >= policy.max_evaluations):
            # The last evaluation this policy allows is kept for the study's final
            # evaluation round (training rounds aborted after their ledger entry use
            # evaluations too): this training round sends an all-zero histogram.
            return []
        return [self.release(rnd).plan(n_noise=self.noise_sites(rnd)).mechanism()]

    def noise_std(self) -> float:
        """The study's noise std per summed count (`evaluation_noise_std`): every
        member adds the same share, whatever its own settings."""
        return evaluation_noise_std(self.membership.study,
                                    own=self.settings.privacy.evaluation_noise_std)

    def release(self, rnd: VerifiedRound) -> EvaluationHistogram:
        """This round's histogram release (`common.releases.plugins.evaluation_histogram`)."""
        return EvaluationHistogram(
            noise_std=self.noise_std(),
            bins=rnd.announcement.histogram_bins,
            # A multi-class study's histogram has one block per class (hooks.evaluate).
            classes=int(getattr(self.hook, "histogram_classes", 1)),
        )

    def noise_sites(self, rnd: VerifiedRound) -> int:
        ann = rnd.announcement
        return evaluation_noise_sites(
            self.settings.policy, threshold=ann.threshold, secure=ann.secure_aggregation,
            study=self.membership.study,
        )

    def private(self, rnd: VerifiedRound, update: LocalUpdate, *, evaluated: bool) -> LocalUpdate:
        """Noise the histogram (its ledger entry is already written), or send zeros when
        this round carries no evaluation; unchanged when the site keeps no ledger."""
        if self.membership.ledger is None:
            return update
        if not evaluated:
            histogram = np.zeros_like(np.asarray(update.histogram, dtype=np.int64))
        else:
            histogram = dp_release.noised_histogram(
                self.release(rnd).query(update),
                noise_std=self.noise_std(),
                n_noise=self.noise_sites(rnd),
            )
        return dataclasses.replace(update, histogram=histogram)


def release_vector(
    release: DpRelease, exact: np.ndarray, plan: NoisePlan | Sequence[NoisePlan], *,
    ledger: PrivacyLedger | None, round_number: int, n_sites: int, now: datetime,
    rng: RandomSource = system_random, query_releases: QueryReleases | None = None,
) -> np.ndarray:
    """The masked-vector plaintext of `release` in round `round_number` of `n_sites`:
    its ledger entry first (write-ahead: each block's `plan.mechanism()` under
    `release.purpose`, naming its query where it answers one), then this site's share
    of each block's noise added to `exact`, then its egress encoding (signed integers
    in the ring, refused where a sum of `n_sites` could wrap). A site without a ledger
    records an approved query's run in `query_releases` first instead (required then:
    its approval's `times` is counted there)."""
    plans = check_plans(release, [plan] if isinstance(plan, NoisePlan) else plan)
    exact = np.asarray(exact, dtype=np.int64)
    if exact.shape != (release.length,):
        raise ValidationError(
            f"release {release.name!r}: {exact.size} values, expected {release.length}")
    if ledger is not None:
        ledger.reserve(round_number, [p.mechanism() for p in plans], now=now,
                       purpose=release.purpose, query=release.ledger_query())
    else:
        record_query_release(release, query_releases, round_number=round_number)
    noisy = exact + np.concatenate([p.noise(rng) for p in plans])
    # A release's segment is integers: the quantizer's clip and bits go unused.
    return release.manifest().encode(
        release.encode(noisy), clip=1.0, bits=1, n_sites=n_sites, rng=numpy_generator(rng),
    )


def record_query_release(release: DpRelease, query_releases: QueryReleases | None, *,
                         round_number: int) -> None:
    """A site without a ledger: an approved query's run counted, durably, before its
    answer leaves (`site_agent.query_releases`); other releases count nothing here."""
    query = release.ledger_query()
    if query is None:
        return
    if query_releases is None:
        raise RoundFailed(f"query {query.name!r}: a site without a privacy ledger counts "
                          "its query runs in its state folder, and none was given")
    query_releases.record(query.sha256, round_number)


def release_noise_sites(policy: SitePolicySection, study: Study | None) -> int:
    """n_noise of a round release: the round-size floor minus the colluding sites (who
    know their own noise), at least 1; the study's terms when there is one (every
    member then adds the same share), else this site's policy."""
    colluding, min_sites = study_round_terms(
        study, max_colluding_sites=policy.max_colluding_sites,
        min_round_sites=policy.min_round_sites,
    )
    return planned_noise_sites(min_round_sites=min_sites, max_colluding_sites=colluding)


def refuse_unapproved(approvals: Approvals, ledger: PrivacyLedger | None, study: Study,
                      payload: bytes) -> None:
    """QueryRefused unless the announced query (its exact bytes' SHA-256) is one this
    site approved, for the study it joined, and has run fewer times than the approval
    allows (counted on the ledger: one "query" entry per release)."""
    sha256 = hashlib.sha256(payload).hexdigest()
    approval = approvals.query(sha256)
    if approval is None:
        raise QueryRefused(
            f"the round's query (sha256 {sha256}) is not one this site approved "
            f"(approve it with `medfed site approve QUERY.toml`; pins under "
            f"{approvals.folder})")
    if approval.study_sha256 != study_sha256(study):
        raise QueryRefused(
            f"query {approval.name!r} was approved for another study "
            f"({approval.study_sha256[:12]}...) than the one this site joined")
    # The ledger's query entries count the runs; a site without one keeps the count.
    counts = None if ledger is not None else QueryReleases.beside(approvals)
    released = times_released(ledger, sha256) if counts is None else counts.count(sha256)
    if released >= approval.times:
        raise QueryRefused(
            f"query {approval.name!r} (sha256 {sha256[:12]}...) already ran {released} "
            "time(s) " + ("on this site's ledger" if counts is None else
                          f"(counted in {counts.path(sha256)}, this site keeps no ledger)")
            + f", as many as its approval allows ({approval.times}); approve it again "
            "with --times to allow more")


def refuse_over_round_cap(
    ledger: PrivacyLedger, release: DpRelease, mechanisms: Sequence[Mechanism], *,
    study: Study, policy: SitePolicySection, round_number: int,
) -> float | None:
    """The epsilon `release` adds to the ledger in round `round_number`, composed
    (eps(ledger + release) - eps(ledger), as training rounds are capped); refused, before
    anything is written, when it exceeds the per-round cap (`per_round_cap`: the smaller
    of the site's and the study's `max_epsilon_per_round`). A query is refused with
    QueryRefused (the site declines that query only, and stays in the study), any other
    release with BudgetExhausted. None when no cap is set (the budget still applies)."""
    cap, source = per_round_cap(study, site_cap=policy.max_epsilon_per_round)
    if cap is None:
        return None
    added = epsilon_added(ledger.history(), mechanisms, delta=ledger.delta,
                          accountant=ledger.accountant)
    if added > cap + ROUND_CAP_SLACK:
        named = release.ledger_query()
        what = (f"query {named.name!r} (sha256 {named.sha256[:12]}...)" if named is not None
                else f"the {release.name} release")
        message = (
            f"{what} would add epsilon {added:.4g} to this site's ledger in round "
            f"{round_number} (its mechanisms composed with the whole ledger), more than the "
            f"per-round cap {cap:g} ({source}): declined, nothing charged")
        raise QueryRefused(message) if named is not None else BudgetExhausted(message)
    return added


def prepare_release(
    rnd: VerifiedRound, *, study: Study, ledger: PrivacyLedger | None, approvals: Approvals,
    policy: SitePolicySection, site: TrainingHook,
) -> tuple[DpRelease, np.ndarray, list[NoisePlan]]:
    """Everything a site checks before a round release leaves it, and what it then
    releases: the release its round names (for an approved query, only that query's
    exact bytes, within its allowance), this site's exact vector (`site`: what the
    release reads, the training hook) and the noise plans, which the ledger must be able
    to pay (BudgetExhausted otherwise). Nothing is written."""
    ann = rnd.announcement
    kind = release_for_round(ann.kind, ann.release_name)
    if kind is None or (kind.build is None and kind.build_payload is None):
        raise RoundFailed(f"round kind {ann.kind!r} carries no release")
    # A re-announced or second release would let the coordinator average its noise
    # away: the round number must be new on the ledger (and an approved query within
    # its allowance; the statistics are pinned apart, `StatisticsPin`).
    refuse_recorded_round(ledger, rnd)
    if kind.build_payload is not None:
        refuse_unapproved(approvals, ledger, study, ann.release_payload)
    release = build_release(kind, study, ann.release_payload)
    exact = release.query(site)
    if exact.size != ann.vector_length:
        raise ValidationError(f"{release.name} vector length differs from this site's study")
    # The study's threat terms: every member adds the same share of the noise.
    plans = check_plans(release, release.plans(n_noise=release_noise_sites(policy, study)))
    if ledger is not None:
        mechanisms = [p.mechanism() for p in plans]
        # No release spends more in one round than the cap, as no training round does.
        refuse_over_round_cap(ledger, release, mechanisms, study=study, policy=policy,
                              round_number=rnd.number)
        ledger.require(rnd.number, mechanisms, purpose=release.purpose,
                       what=f"the {release.name} release")
    return release, exact, plans


class RoundRelease:
    """A DP release carried alone by its round (`common.releases.seam`; the study's statistics
    are one): the release its round kind names, built for the joined study, queried on
    this site's data, one ledger entry of its purpose written before anything leaves,
    noise added here in the integer ring, sent through SecAgg+. A round number already
    on the ledger is refused; the statistics are released once per study
    (`StatisticsPin`)."""

    def __init__(self, settings: SiteSettings, hook: TrainingHook, *, membership: Membership,
                 phases: SecAggPhases, metrics: SiteMetrics, pin: StatisticsPin) -> None:
        self.settings = settings
        self.hook = hook
        self.membership = membership
        self.phases = phases
        self.metrics = metrics
        self.pin = pin
        self.approvals = Approvals(settings.state)

    def refuse_statistics_again(self, study: Study) -> None:
        """StudyRefused when this study's statistics are pinned already."""
        if self.pin.pinned(study_sha256(study)) is not None:
            raise StudyRefused(
                "this study's statistics were already released "
                f"({self.pin.path(study_sha256(study))}): refusing a second "
                "release, so this site cannot take part in this run of the study (a "
                "coordinator that started the study again from a fresh state?) and stops. "
                + RELEASED_WAY_OUT
            )

    def run(self, stub: pb_grpc.FederationStub, rnd: VerifiedRound) -> None:
        study = self.membership.study
        ledger = self.membership.ledger
        if study is None:
            raise RoundFailed(f"a {rnd.announcement.release} round needs a study")
        kind = release_for_round(rnd.announcement.kind, rnd.announcement.release_name)
        if kind is not None and kind.once_per_study:
            self.refuse_statistics_again(study)
        release, exact, plans = prepare_release(
            rnd, study=study, ledger=ledger, approvals=self.approvals,
            policy=self.settings.policy, site=self.hook)
        heard_at = time.perf_counter()
        timeline = RoundTimeline(heard_at)
        client = self.phases.client(rnd)
        try:
            with Heartbeats(stub, rnd.number, rnd.heartbeat_seconds) as heartbeats:
                shares, premask = self.phases.exchange_keys(
                    stub, rnd, client, client.advertise_keys(), heard_at=heard_at,
                    timeline=timeline)
                # Ledger entry first (write-ahead), then the noised vector through SecAgg+.
                vector = release_vector(
                    release, exact, plans, ledger=ledger, round_number=rnd.number,
                    n_sites=len(rnd.params.participants) if rnd.params else 2, now=utcnow(),
                    query_releases=QueryReleases.beside(self.approvals))
                if ledger is not None:
                    self.membership.budget_pb()
                self.phases.finish(stub, rnd, client, shares, premask, vector,
                                   heartbeats=heartbeats, timeline=timeline)
        except BaseException:
            client.abort()
            raise
        self.metrics.rounds.labels(outcome="completed").inc()
        log.info("%s release (round %d) done: sigma %s over %d noise shares",
                 release.name, rnd.number, ", ".join(f"{p.sigma:.2f}" for p in plans),
                 plans[0].n_noise)
