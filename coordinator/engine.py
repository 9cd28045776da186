"""The round engine: runs the study round after round, and one round from selection to
its record; nothing else. Which round comes next, what it announces and serves and what
it does with the sum is the word of its kind (`coordinator.round_kind`: one module per
kind in coordinator/round_kinds/, the statistics, training, the final evaluation, a
query): the engine asks the kinds and names none. Each other concern has its module:
sessions and long-polls (sessions), calls between rounds (site_calls, ledger_gate),
selection and announcements (selection), phases, uploads (inbox, uploads), the sum
(aggregation), what a round leaves behind (training_round, release_round, bundles),
restart (recovery), and what the operator sees (round_events, status). Dataclasses only
(servicer.py speaks protobuf); one asyncio event loop, CPU-heavy steps in worker threads.

An engine failure (a full disk, a database error) is never reported as a finished
federation: waiting sites hear UNAVAILABLE and retry; a restarted coordinator resumes.
A lost connection to the state database (a PostgreSQL restart or failover,
`DatabaseUnavailable`) costs at most the round in flight: that round is abandoned, the
engine retries with backoff, re-reads its state as a restarted coordinator would and goes
on; only a database unreachable for `database_outage_seconds` stops it.
A round that sites decline for reasons that cannot change is not re-opened for them in
a loop: they are left out of that kind of round (it runs again without them once
`min_sites` others are there; a left-out site's operator can still act, say on the way
out its refusal names), and when every participant declined it for good
(`declined_for_good`) the study ends as failed (`StudyFailed`), recorded in the state
and shown by `medfed status`, and the sites hear why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from common.core.config import CoordinatorSettings
from common.core.errors import (
    AbortReason,
    ConfigError,
    DatabaseUnavailable,
    MedfedError,
    ProtocolAbort,
    StateError,
    StudyFailed,
    Unavailable,
)
from common.core.observer import NoObserver, RoundObserver
from common.privacy.federation import FederationBudgetView
from common.protocol.secagg.identity import IdentityVerifier
from coordinator import round_events, selection
from coordinator.bundles import final_bundle
from coordinator.checkpoints import InitialModel
from coordinator.inbox import RoundInbox
from coordinator.ledger_gate import LedgerGate
from coordinator.metrics import CoordinatorMetrics
from coordinator.phases import ActiveRound, Liveness, drive, phase_timeout
from coordinator.recovery import recover
from coordinator.round_kind import Due, RoundKind, round_kinds
from coordinator.sessions import SiteRegistry
from coordinator.site_calls import SiteCalls
from coordinator.status import StudyStatus, study_status
from coordinator.store import CoordinatorStore
from coordinator.study_run import StudyRun
from coordinator.training_round import GlobalModel, RoundResult
from coordinator.uploads import Transfers

log = logging.getLogger("medfed.coordinator")

DATABASE_RETRY_FIRST_SECONDS = 0.5
DATABASE_RETRY_MAX_SECONDS = 10.0
"""Backoff between reconnect attempts while the state database is lost (doubling)."""

FAILED_META = "study_failed"
"""State-database key holding why the study failed (absent while it has not)."""

def declined_for_good(rnd: ActiveRound, *, min_sites: int, kind: str) -> StudyFailed | None:
    """The study's failure when EVERY participant of `rnd` (an aborted round, `kind`
    naming it) declined it for a reason that cannot change: the same round opened again
    would be declined again, for ever. None while any participant may still take part
    (no lasting decline, or some site able: the others are left out, and the round waits
    for `min_sites` able sites; a site NOT_READY may be ready next time)."""
    lasting = rnd.declined_for_good
    participants = rnd.announcement.participants
    able = [s for s in participants if s not in lasting]
    if not lasting or able:
        return None
    by_reason: dict[str, list[str]] = {}
    for site, reason in sorted(lasting.items()):
        by_reason.setdefault(reason, []).append(site)
    reasons = "; ".join(f"{', '.join(sites)}: {reason}" for reason, sites in by_reason.items())
    return StudyFailed(
        f"{kind} (round number {rnd.number}) cannot run: {len(lasting)} of its "
        f"{len(participants)} sites declined it for a reason that cannot change "
        f"({reasons}), leaving {len(able)} of min_sites={min_sites}"
    )


class RoundEngine:
    """Runs `settings.rounds` rounds (and a final evaluation round), one at a time."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        store: CoordinatorStore,
        *,
        identity: IdentityVerifier,
        metrics: CoordinatorMetrics,
        clock: Callable[[], float] = time.time,
        rng: Callable[[int], bytes] = os.urandom,
        budget_view: FederationBudgetView | None = None,
        study: StudyRun | None = None,
        observer: RoundObserver | None = None,
        model_without_study: InitialModel | None = None,
    ) -> None:
        self.study = study  # its model and training settings replace the config's
        # Without a study: the flat model a transport test plugs in (bench.instrumented).
        self.model_without_study = model_without_study
        # Shown each round's unmasked sum (common.core.observer); the product's watches nothing.
        self.observer = observer or NoObserver()
        self.settings = settings = study.settings(settings) if study is not None else settings
        self.store = store
        # In the store's database: a restarted or fail-over coordinator keeps it.
        self.budget_view = budget_view or FederationBudgetView(store.database)
        self.identity = identity
        self.metrics = metrics
        self.clock = clock
        self.rng = rng
        self.sessions = SiteRegistry(
            store, self.budget_view, metrics=metrics, clock=clock,
            report_quorum=max(settings.aggregation.max_colluding_sites, 1) + 1,
            heartbeat_misses=settings.deadlines.heartbeat_misses)
        self.transfers = Transfers(settings.limits, settings.state, metrics=metrics)
        self.inbox = RoundInbox(store, self.sessions, self.transfers)
        self.ledgers = LedgerGate(store.database, settings)
        self.sites = SiteCalls(self.sessions, self.inbox, self.ledgers, clock=clock)
        self.finished = asyncio.Event()  # set only when the whole study completed
        self.failure: StudyFailed | None = None  # set when the study ended unfinished
        # The kinds of round this engine asks, in their order (coordinator.round_kind).
        self.kinds = round_kinds()
        # Sites that declined a kind of round ("statistics", "training", "evaluation")
        # for a reason that cannot change, and why: not selected for it again.
        self.declined_kind: dict[str, dict[str, str]] = {}
        self.model = GlobalModel.load(store, settings, study,
                                      model_without_study=model_without_study)
        if self.model.intermediaries is not None:  # "auto" v carried over a restart
            metrics.hospital_intermediaries.set(self.model.intermediaries)
        self.last_round_number = 0
        # The latest result only: no growth by model-sized vectors per round.
        self.last_result: RoundResult | None = None
        self.last_secagg: tuple[int, int] = (0, 0)  # (threshold, neighbours) last announced

    @property
    def global_flat(self) -> np.ndarray:
        return self.model.flat

    @property
    def total_rounds(self) -> int:
        return self.settings.rounds + (1 if self.settings.training.final_evaluation else 0)

    def recover(self) -> None:
        """After a crash: abandon the round that was in flight (recovery.py)."""
        self.last_round_number = recover(
            self.store, self.budget_view, self.metrics, now=self.clock()
        )

    def status(self) -> StudyStatus:
        """The study as `medfed status` shows it (read-only)."""
        return study_status(
            list(self.sessions.sites.values()), self.store.rounds(), rnd=self.inbox.round,
            training_rounds=self.settings.rounds,
            evaluation_round=self.settings.training.final_evaluation,
            statistics_pending=self.study is not None and self.study.statistics is None,
            finished=self.finished.is_set(), now=self.clock(),
            failure=None if self.failure is None else self.failure.reason,
        )

    def final_model(self, study_sha256: bytes) -> bytes:
        return final_bundle(self.study, study_sha256, finished=self.finished.is_set())

    # --------------------------------------------------------------- main loop
    async def run(self) -> None:
        """Run rounds until the study is complete; any other exit is a failure that
        waiting sites hear as UNAVAILABLE (they retry), never as "finished", except a
        study that cannot finish (`StudyFailed`): the sites hear that and why."""
        try:
            try:
                self.recover()
            except DatabaseUnavailable as exc:
                await self._ride_out(exc)  # it recovers once the database answers
            for kind in self.kinds:
                await asyncio.to_thread(kind.opening, self)
            before = self.store.get_meta(FAILED_META)
            if before:
                log.warning("this study failed before (%s); trying its rounds again", before,
                            extra={"event": "study_failed_before", "reason": before})
            while True:
                try:
                    if not await self._next_round():
                        break
                except DatabaseUnavailable as exc:
                    await self._ride_out(exc)
        except StudyFailed as exc:
            self.failure = exc
            self.store.set_meta(FAILED_META, exc.reason)
            self.sessions.close(failure=exc)
            raise
        except BaseException as exc:
            # The cause stays in the coordinator's log (service.serve): sites learn only
            # that they should retry, not the coordinator's paths or database errors.
            what = "is shutting down" if isinstance(exc, asyncio.CancelledError) else (
                "stopped on an error"
            )
            self.sessions.close(failure=Unavailable(f"coordinator {what}: retry later"))
            raise
        for kind in self.kinds:
            await asyncio.to_thread(kind.closing, self)
        self.finished.set()
        self.metrics.study_finished.set(1)
        self.sessions.close(failure=None)

    async def _next_round(self) -> bool:
        """Run the next round: the study's first due round (its kinds asked in order:
        the statistics while the study still needs them, then training and evaluation
        rounds), or in its place, with the participants selected for it, a round of a
        kind that runs between the study's rounds (an approved query); False once no
        round of the study is due."""
        due = await self.due_study_round()
        if due is None:
            return False
        participants = await self.select_participants(kind=due.kind.name)
        for kind in self.kinds:
            if kind.in_place_of_study_round:
                instead = await kind.due(self)
                if instead is not None:
                    due = instead
                    break
        await self.run_round(participants, due)
        return True

    async def due_study_round(self) -> Due[Any] | None:
        """The first of the study's own kinds of round with a round due, if any."""
        for kind in self.kinds:
            if not kind.in_place_of_study_round:
                due = await kind.due(self)
                if due is not None:
                    return due
        return None

    async def _ride_out(self, lost: DatabaseUnavailable) -> None:
        """The state database was lost (the round in flight, if any, was abandoned):
        retry with backoff until it answers, then re-read the state as a restarted
        coordinator would (the abandoned round is recorded as such, the model comes
        from the latest checkpoint); after `database_outage_seconds` give up."""
        bound = self.settings.database_outage_seconds
        started = time.monotonic()
        log.warning("%s: any round in flight is abandoned; retrying for up to %g s "
                    "(database_outage_seconds)", lost, bound,
                    extra={"event": "database_lost", "reason": str(lost)})
        delay = DATABASE_RETRY_FIRST_SECONDS
        while True:
            left = started + bound - time.monotonic()
            await asyncio.sleep(max(min(delay, left), 0.0))
            try:
                # Off the event loop: a reconnect may wait for its connect timeout.
                await asyncio.to_thread(self.store.database.ping)
                self.last_round_number = recover(
                    self.store, self.budget_view, self.metrics, now=self.clock(),
                    cause="a loss of the state database")
                self.model = GlobalModel.load(self.store, self.settings, self.study,
                                              model_without_study=self.model_without_study)
            except DatabaseUnavailable as again:
                if time.monotonic() - started >= bound:
                    raise DatabaseUnavailable(
                        f"{again}; still unreachable after {bound:g} s "
                        "(database_outage_seconds)") from None
                delay = min(delay * 2, DATABASE_RETRY_MAX_SECONDS)
                continue
            break
        seconds = time.monotonic() - started
        self.metrics.database_outage_seconds.set(seconds)
        log.warning("state database outage ridden out: %.1f s; going on after round %d",
                    seconds, self.last_round_number,
                    extra={"event": "database_outage_over", "outage_seconds": round(seconds, 3)})

    def kind(self, name: str) -> RoundKind[Any]:
        """This engine's kind of round `name` (ConfigError when there is none)."""
        for kind in self.kinds:
            if kind.name == name:
                return kind
        raise ConfigError("round kind", f"no kind of round named {name!r} is registered")

    def eligible(self, site_ids: list[str], *, kind: str) -> list[str]:
        """Sites with budget left (all of them for a kind that spends none) that have not
        declined this kind of round for good."""
        declined = self.declined_kind.get(kind, {})
        with_budget = self.sessions.with_budget(
            site_ids, evaluation_round=not self.kind(kind).spends_budget)
        _, outliers = self.sessions.round_ceiling()
        return [s for s in with_budget if s not in declined and s not in outliers]

    async def select_participants(self, *, kind: str | None = None) -> list[str]:
        """Wait for `min_sites` sites eligible for a round of `kind` (default: the
        study's next round), then briefly for the rest to arrive."""
        if kind is None:
            due = await self.due_study_round()
            if due is None:
                raise StateError("the study is complete: no round is due to select sites for")
            kind = due.kind.name
        cfg = self.settings
        return await self.sessions.gather(
            partial(self.eligible, kind=kind),
            min_sites=cfg.min_sites, max_sites=cfg.limits.max_sites,
            start_timeout=cfg.deadlines.round_start_timeout_seconds,
            grace=cfg.deadlines.selection_seconds,
        )

    def next_round_number(self, participants: list[str]) -> int:
        """After the record and the participants' ledgers (as far as `round_ceiling`
        lets them move it), never a number the store already holds."""
        ceiling, _ = self.sessions.round_ceiling()
        number = selection.next_round_number(
            recorded_next=self.store.next_round_number(),
            ledger_last_rounds=self.sessions.ledger_last_rounds(participants),
            ceiling=ceiling,
        )
        while self.store.round_status(number) is not None:
            number += 1  # above a jump an old lie caused: those numbers stay used
        return number

    async def run_round(self, participants: list[str], due: Due[Any]) -> ActiveRound:
        """Run one round of `due.kind` and return it (recorded, or ended with its abort);
        the kind then has its word on how it ended (`RoundKind.after`)."""
        kind: RoundKind[Any] = due.kind
        ann = kind.announce(self, participants, due.job)
        self.last_secagg = (ann.threshold, ann.neighbours)
        started, cpu_started = time.perf_counter(), time.process_time()
        deadlines = self.settings.deadlines
        rnd, aggregator = self.inbox.open_round(
            ann, kind.serve(self),
            liveness=Liveness(ann.heartbeat_ms / 1000, deadlines.heartbeat_misses),
            started=started, identity=self.identity, metrics=self.metrics,
            max_colluding_sites=self.settings.aggregation.max_colluding_sites,
        )
        try:
            self.store.begin_round(ann.round_number, participants, now=self.clock())
        except BaseException:
            rnd.end(abort=ProtocolAbort(AbortReason.ROUND_ABANDONED, "round not recorded"))
            self.inbox.close()
            raise
        self.metrics.current_round.set(ann.round_number)
        round_events.round_opened(ann)
        self.sessions.announce(ann)
        abort: ProtocolAbort | None = ProtocolAbort(AbortReason.ROUND_ABANDONED, "round ended")
        try:
            await drive(rnd, aggregator.phases, close=aggregator.close,
                        timeout_for=lambda p: phase_timeout(
                            ann, p, now=self.clock(), phase_seconds=deadlines.phase_seconds),
                        lock=self.inbox.lock, on_closed=partial(
                            round_events.phase_closed, metrics=self.metrics,
                            heartbeat_misses=deadlines.heartbeat_misses),
                        # Written before the sum exists: a crash from then on is
                        # reported at the next start as "may have been unmasked".
                        before_sum=partial(self.store.mark_unmasked, ann.round_number))
            result: RoundResult = await kind.complete(self, rnd, aggregator, due.job)
            rnd.mark("recorded")
            abort = None
        except DatabaseUnavailable:
            abort = ProtocolAbort(AbortReason.ROUND_ABANDONED,
                                  "the coordinator lost its state database: round abandoned")
            raise
        except MedfedError as exc:
            abort = exc if isinstance(exc, ProtocolAbort) else ProtocolAbort(
                AbortReason.ROUND_ABANDONED, str(exc)
            )
            round_events.round_aborted(ann, str(exc), store=self.store, metrics=self.metrics,
                                       now=self.clock())
        else:
            round_events.round_completed(
                rnd, survivors=result.survivors, dropped=result.dropped,
                metrics=result.metrics, seconds=time.perf_counter() - started,
                cpu_seconds=time.process_time() - cpu_started, statistics=result.statistics,
            )
        finally:
            rnd.end(abort=abort)
            self.last_round_number = ann.round_number
            self.inbox.close()
        kind.after(self, rnd, due.job, completed=abort is None)
        return rnd

    def leave_out_declined_for_good(self, rnd: ActiveRound, *, kind: str) -> None:
        """After the aborted round `rnd` of `kind`: raise `StudyFailed` when every
        participant declined it for good (`declined_for_good`); else leave those sites
        out of the next rounds of that kind (they would only decline again)."""
        if not rnd.declined_for_good:
            return
        failure = declined_for_good(rnd, min_sites=self.settings.min_sites,
                                    kind=self.kind(kind).title(self))
        if failure is not None:
            raise failure
        for site, reason in rnd.declined_for_good.items():
            log.warning("site %s is left out of the %s rounds: %s", site, kind, reason,
                        extra={"event": "site_left_out", "site": site, "reason": reason})
        self.declined_kind.setdefault(kind, {}).update(rnd.declined_for_good)
