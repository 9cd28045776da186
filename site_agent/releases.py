"""The DP values a site releases beside its model update: the evaluation histogram
every model round carries (noised here, its ledger entry written with the round's
training entry) and the study's statistics, released once in a round of their own.
Each is on the ledger, write-ahead, before anything leaves the site; a round number
already on the ledger is never released again.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from common import egress
from common.config import SiteSettings
from common.crypto.random import numpy_generator, system_random
from common.errors import RoundFailed, StudyRefused, ValidationError
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import Mechanism
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.round import VerifiedRound
from common.secagg import round_floor
from common.statistics import plan_statistics
from common.study import study_sha256
from site_agent import dp_release
from site_agent.connection import Heartbeats
from site_agent.hooks import LocalUpdate, TrainingHook
from site_agent.membership import Membership, utcnow
from site_agent.metrics import SiteMetrics
from site_agent.phases import SecAggPhases
from site_agent.round_timeline import RoundTimeline
from site_agent.statistics_pin import RELEASED_WAY_OUT, StatisticsPin
from site_agent.transfers import write_debug_update

log = logging.getLogger("medfed.site")

PURPOSE_STATISTICS = "statistics"
# Ledger purposes released within a round (the cohort count has its own numbering).
ROUND_PURPOSES = (dp_release.PURPOSE_TRAINING, dp_release.PURPOSE_EVALUATION,
                  PURPOSE_STATISTICS)


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
        ann = rnd.announcement
        return [dp_release.evaluation_mechanism(
            noise_std=self.settings.privacy.evaluation_noise_std,
            n_noise=self.noise_sites(rnd),
            bins=ann.histogram_bins,
            # A multi-class study's histogram has one block per class (hooks.evaluate).
            classes=int(getattr(self.hook, "histogram_classes", 1)),
        )]

    def noise_sites(self, rnd: VerifiedRound) -> int:
        ann = rnd.announcement
        return dp_release.evaluation_noise_sites(
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
                update.histogram,
                noise_std=self.settings.privacy.evaluation_noise_std,
                n_noise=self.noise_sites(rnd),
            )
        return dataclasses.replace(update, histogram=histogram)


class StatisticsRelease:
    """The study's federated DP statistics release (common/statistics.py): clipped
    per-unit values, discrete Gaussian noise added here in the integer ring, one
    ledger entry (purpose "statistics") written before anything leaves; once per study
    (`StatisticsPin`)."""

    def __init__(self, settings: SiteSettings, hook: TrainingHook, *, membership: Membership,
                 phases: SecAggPhases, metrics: SiteMetrics, pin: StatisticsPin) -> None:
        self.settings = settings
        self.hook = hook
        self.membership = membership
        self.phases = phases
        self.metrics = metrics
        self.pin = pin

    def run(self, stub: pb_grpc.FederationStub, rnd: VerifiedRound) -> None:
        study = self.membership.study
        ledger = self.membership.ledger
        if study is None:
            raise RoundFailed("a statistics round needs a study")
        # A re-announced or second release would let the coordinator average its noise
        # away: the round number must be new on the ledger, the study's statistics unset.
        refuse_recorded_round(ledger, rnd)
        if self.pin.pinned(study_sha256(study)) is not None:
            raise StudyRefused(
                "this study's statistics were already released "
                f"({self.pin.path(study_sha256(study))}): refusing a second "
                "release, so this site cannot take part in this run of the study (a "
                "coordinator that started the study again from a fresh state?) and stops. "
                + RELEASED_WAY_OUT
            )
        release = self.hook.statistics_release()
        if release.size != rnd.announcement.vector_length:
            raise ValidationError("statistics vector length differs from this site's study")
        # The study's threat terms: every member adds the same share of the noise.
        colluding, min_sites = study.privacy.max_colluding_sites, study.privacy.min_round_sites
        floor = round_floor(min_round_sites=min_sites, max_colluding_sites=colluding)
        plan = plan_statistics(study, n_noise=max(floor - colluding, 1))
        mechanism = plan.mechanism()
        if ledger is not None:
            ledger.require(rnd.number, [mechanism], purpose=PURPOSE_STATISTICS,
                           what="the statistics release")
        heard_at = time.perf_counter()
        timeline = RoundTimeline(heard_at)
        client = self.phases.client(rnd)
        try:
            with Heartbeats(stub, rnd.number, rnd.heartbeat_seconds) as heartbeats:
                shares, premask = self.phases.exchange_keys(
                    stub, rnd, client, client.advertise_keys(), heard_at=heard_at,
                    timeline=timeline)
                # Ledger entry first (write-ahead), then the noised vector through SecAgg+.
                if ledger is not None:
                    ledger.reserve(rnd.number, [mechanism], now=utcnow(),
                                   purpose=PURPOSE_STATISTICS)
                    self.membership.budget_pb()
                noisy = release + plan.noise(system_random)
                # Built from the round's egress manifest: one "statistics" segment.
                vector = rnd.announcement.manifest().encode(
                    {egress.STATISTICS: noisy}, clip=rnd.announcement.clip,
                    bits=rnd.announcement.quantization_bits,
                    n_sites=len(rnd.params.participants) if rnd.params else 2,
                    rng=numpy_generator(system_random),
                )
                if self.settings.debug_write_updates:
                    write_debug_update(self.settings.state, rnd.number, vector)
                self.phases.finish(stub, rnd, client, shares, premask, vector,
                                   heartbeats=heartbeats, timeline=timeline)
        except BaseException:
            client.abort()
            raise
        self.metrics.rounds.labels(outcome="completed").inc()
        log.info("statistics release (round %d) done: sigma %.2f over %d noise shares",
                 rnd.number, plan.sigma, plan.n_noise)
