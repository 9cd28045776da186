"""The sites the coordinator knows since it started: enrolment, budget reports and
the WaitForRound long-polls, and waiting until enough of them are ready for a round."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from common.core.errors import StateError, StudyFailed, Unavailable
from common.privacy.budget import BudgetReport
from common.privacy.federation import FederationBudgetView
from common.rounds.announcement import Announcement
from coordinator import selection
from coordinator.metrics import CoordinatorMetrics
from coordinator.store import ROUND_WINDOW, CoordinatorStore

log = logging.getLogger("medfed.coordinator")

SELECTION_POLL_SECONDS = 5.0
"""Longest wait between re-counts of eligible sites (the gauge stays current)."""


@dataclass
class SiteSession:
    """What the coordinator knows about a connected site (not persisted)."""

    site_id: str
    certificate_der: bytes
    budget: BudgetReport = field(default_factory=BudgetReport)
    budget_reported: bool = False
    waiting: asyncio.Future[Announcement | None] | None = None
    last_contact: float | None = None  # unix seconds of the site's latest call
    declined_round: int | None = None  # the latest round it declined
    # Whether it long-polled for a round since it last enrolled: a site that refuses
    # the study (its data check or privacy policy) stops right after enrolling and
    # never polls, and must not look like one waiting for a round (`medfed status`).
    polled: bool = False
    # Its latest long-poll promised a Heartbeat (round 0) every this many seconds while
    # open (None: an agent that does not beat between rounds).
    beat_seconds: float | None = None
    # Its latest long-poll ended with nothing to announce (it timed out): a live agent
    # polls again at once, so one that does not, and stopped beating, is silent.
    poll_lapsed: bool = False

    @property
    def is_waiting(self) -> bool:
        return self.waiting is not None and not self.waiting.done()

    def stopped_beating(self, *, now: float, intervals: float) -> bool:
        """Between rounds: its long-poll is open (or just timed out) and promised
        heartbeats, and nothing came from the site for more than `intervals` heartbeat
        intervals by `now` (unix seconds): frozen or cut off."""
        if self.beat_seconds is None or not (self.is_waiting or self.poll_lapsed):
            return False
        heard = self.last_contact
        return heard is None or now - heard > intervals * self.beat_seconds


class SiteRegistry:
    """Sessions of the sites enrolled since this coordinator started."""

    def __init__(
        self,
        store: CoordinatorStore,
        budget_view: FederationBudgetView,
        *,
        metrics: CoordinatorMetrics,
        clock: Callable[[], float],
        report_quorum: int = 2,
        heartbeat_misses: int = 3,
    ) -> None:
        self.store = store
        # A waiting site silent (no heartbeat) for more heartbeat intervals than this is
        # not selected: frozen or cut off, it would only be dropped from the round.
        self.heartbeat_misses = heartbeat_misses
        self._left_out: set[str] = set()  # waiting, but silent: not selected (logged once)
        # Sites whose ledger reports must agree before the numbering follows them far
        # past the coordinator's record (`selection.round_ceiling`).
        self.report_quorum = report_quorum
        self._refused_reports: dict[str, int] = {}
        self.budget_view = budget_view
        self.metrics = metrics
        self.clock = clock
        self.sites: dict[str, SiteSession] = {}
        self.changed = asyncio.Event()
        self.finished = False
        self.failure: Unavailable | StudyFailed | None = None

    def enroll(self, site_id: str, certificate_der: bytes, *, serial: str, version: str,
               device: str, budget: BudgetReport | None) -> None:
        session = self.sites.get(site_id)
        if session is None:
            session = self.sites[site_id] = SiteSession(site_id, certificate_der)
        session.certificate_der = certificate_der
        session.polled = False
        session.beat_seconds, session.poll_lapsed = None, False
        self.store.record_site(
            site_id, cert_serial=serial, agent_version=version, device=device, now=self.clock()
        )
        self._contact(session)
        self.record_budget(session, budget)
        self.metrics.sites_enrolled.set(len(self.store.enrolled_sites()))
        self.changed.set()

    def beat(self, site_id: str) -> None:
        """A heartbeat from `site_id` while it waits (StateError: not enrolled); one
        left out of selection for silence has selection count it again at once."""
        self.session(site_id)
        if site_id in self._left_out:
            self.changed.set()

    def touch(self, site_id: str) -> None:
        """Note a call from `site_id` (its last contact, for `medfed status`)."""
        session = self.sites.get(site_id)
        if session is not None:
            self._contact(session)

    def _contact(self, session: SiteSession) -> None:
        session.last_contact = self.clock()
        # The operator's per-site liveness (the hospital's own /metrics stays inside
        # the hospital): when the site last called, nothing about what it sent.
        self.metrics.site_last_contact.labels(site=session.site_id).set(session.last_contact)

    def session(self, site_id: str) -> SiteSession:
        session = self.sites.get(site_id)
        if session is None:
            raise StateError(f"site {site_id} has not enrolled since the coordinator started")
        return session

    def record_decline(
        self, site_id: str, round_number: int, *, budget: BudgetReport | None
    ) -> None:
        """A site said it will not take part in `round_number` (shown by `medfed status`)."""
        session = self.session(site_id)
        self.record_budget(session, budget)
        session.declined_round = round_number

    def record_budget(self, session: SiteSession, budget: BudgetReport | None) -> None:
        """Keep a site's budget report in the session and in the federation view.

        A site without a ledger (budget 0: no DP accounting) is not entered in the view.
        A report whose spend or ledger length went DOWN is refused by the view (a ledger
        is append-only): the higher recorded spend keeps governing selection, and the
        operator is warned, since that site's ledger was reset or rewritten."""
        if budget is None or (session.budget_reported and budget == session.budget):
            return  # every long-poll repeats the report: no database write when unchanged
        session.budget = budget
        session.budget_reported = True
        site_id = session.site_id
        spent, total = budget.spent_epsilon, budget.budget_epsilon
        if budget.budget_epsilon > 0 or budget.ledger_entries > 0:
            now = dt.datetime.fromtimestamp(self.clock(), dt.UTC)
            try:
                row = self.budget_view.update_site(
                    site_id, dataclasses.replace(budget, site_id=site_id), now=now)
            except StateError as exc:
                log.warning("budget report of site %s ignored: %s", site_id, exc)
                recorded = self.budget_view.get(site_id)
                if recorded is not None:
                    spent, total = recorded.spent_epsilon, recorded.budget_epsilon
            else:
                spent, total = row.spent_epsilon, row.budget_epsilon
        self.metrics.observe_budget(site_id, spent, total)
        self.changed.set()

    def with_budget(self, site_ids: list[str], *, evaluation_round: bool) -> list[str]:
        """`selection.with_budget` over these sessions' reports and the federation view."""
        return selection.with_budget(
            site_ids,
            reports={s: self.sites[s].budget for s in site_ids},
            view={row.site_id: row for row in self.budget_view.snapshot()},
            evaluation_round=evaluation_round,
        )

    def round_ceiling(self) -> tuple[int, dict[str, int]]:
        """`selection.round_ceiling` over every session's latest report: how far the
        numbering may follow the sites' ledgers, and the sites refused for now."""
        recorded_next = self.store.next_round_number()
        reports = {site: s.budget.last_round for site, s in self.sites.items()}
        ran = frozenset(n for n in reports.values() if n is not None and n >= recorded_next
                        and self.store.round_status(n) is not None)
        return selection.round_ceiling(
            recorded_next=recorded_next, reports=reports, ran=ran,
            window=ROUND_WINDOW, quorum=self.report_quorum)

    def refuse_outlier(self, site_id: str) -> None:
        """StateError (FAILED_PRECONDITION to the site) when this site's ledger report
        is an outlier: it claims a round far past the coordinator's record that no other
        site corroborates. Logged once per reported value and counted per refusal; the
        report is kept in the session, so other sites may still corroborate it."""
        ceiling, outliers = self.round_ceiling()
        reported = outliers.get(site_id)
        if reported is None:
            self._refused_reports.pop(site_id, None)
            return
        self.metrics.round_reports_refused.labels(site=site_id).inc()
        recorded = self.store.next_round_number() - 1
        message = (
            f"ledger_last_round {reported} is more than {ROUND_WINDOW} rounds past this "
            f"coordinator's round {recorded}, and fewer than {self.report_quorum} sites "
            f"report a ledger that far: not followed (the federation's rounds stay at most "
            f"{ceiling + 1}); if this site's ledger is really ahead (the coordinator's "
            "state was restored from an old backup), the other sites' ledgers will be too"
        )
        if self._refused_reports.get(site_id) != reported:
            self._refused_reports[site_id] = reported
            log.warning("site %s refused: %s", site_id, message,
                        extra={"event": "round_report_refused", "site": site_id,
                               "ledger_last_round": reported, "round_number": recorded})
        raise StateError(message)

    def ledger_last_rounds(self, site_ids: list[str]) -> list[int | None]:
        return [self.sites[s].budget.last_round for s in site_ids if s in self.sites]

    def waiting_ids(self) -> list[str]:
        """Sites holding a long-poll, less those that stopped beating for more than
        `heartbeat_misses` intervals (a frozen process's poll stays open; selected, it
        would hold the round's first phase until the liveness check dropped it)."""
        now = self.clock()
        waiting = [s for s in self.sites.values() if s.is_waiting]
        silent = {s.site_id for s in waiting
                  if s.stopped_beating(now=now, intervals=self.heartbeat_misses)}
        for site_id in sorted(silent - self._left_out):
            log.warning("site %s holds a long-poll but sent no heartbeat for %d intervals: "
                        "not selected until it beats again", site_id, self.heartbeat_misses,
                        extra={"event": "site_silent_not_selected", "site": site_id})
        waiting_now = {s.site_id for s in waiting}
        for site_id in sorted((self._left_out & waiting_now) - silent):
            log.info("site %s beats again: selectable", site_id,
                     extra={"event": "site_selectable_again", "site": site_id})
        # One whose poll ended while silent stays left out until it waits and beats.
        self._left_out = silent | (self._left_out - waiting_now)
        return sorted(s.site_id for s in waiting if s.site_id not in silent)

    def check_open(self) -> None:
        """Refuse polls once the engine stopped: after an outage (`Unavailable`) sites
        retry with backoff; after a failed study (`StudyFailed`) they stop."""
        if self.failure is not None:
            raise self.failure

    async def poll(self, site_id: str, *, wait_seconds: float,
                   beat_seconds: float | None = None) -> Announcement | None:
        """Long-poll until a round selecting this site opens (None on timeout);
        `beat_seconds`: the site beats this often while the poll is open."""
        session = self.session(site_id)
        self.check_open()
        if self.finished:
            return None
        future: asyncio.Future[Announcement | None] = asyncio.get_running_loop().create_future()
        if session.is_waiting and session.waiting is not None:
            session.waiting.set_result(None)  # a newer poll replaces an older one
        session.waiting = future
        session.beat_seconds, session.poll_lapsed = beat_seconds, False
        self.changed.set()
        current = False
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(future), timeout=wait_seconds)
        finally:
            # Also when the RPC is cancelled (the site hung up or its deadline passed):
            # a site that is no longer polling must not count as waiting, or selection
            # would open a round for it and the round would wait out its first phase.
            if session.waiting is future:
                session.waiting = None
                current = True
                self.changed.set()
        if current:
            session.poll_lapsed = not future.done()  # timed out: nothing was answered
        # No await between the check and here: selection cannot pick this site after
        # it stopped waiting, and an announcement that raced the timeout is not lost.
        return future.result() if future.done() and not future.cancelled() else None

    def announce(self, ann: Announcement) -> None:
        for site_id in ann.participants:
            session = self.sites[site_id]
            if session.is_waiting and session.waiting is not None:
                session.waiting.set_result(ann)

    def close(self, *, failure: Unavailable | StudyFailed | None) -> None:
        """Answer every waiting poll: "finished" only when the study completed
        (`failure` None), else `failure` (UNAVAILABLE, or the study's failure)."""
        if failure is None:
            self.finished = True
        else:
            self.failure = failure
        for session in self.sites.values():
            if session.is_waiting and session.waiting is not None:
                if failure is None:
                    session.waiting.set_result(None)
                else:
                    session.waiting.set_exception(failure)

    async def _wait_changed(self, timeout: float) -> None:
        self.changed.clear()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns normally when it
        # is cancelled just as the event is set, and a stopping coordinator would then
        # wait out round_start_timeout_seconds before its engine task ends.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.changed.wait()

    async def gather(
        self,
        eligible: Callable[[list[str]], list[str]],
        *,
        min_sites: int,
        max_sites: int,
        start_timeout: float,
        grace: float,
    ) -> list[str]:
        """Wait for `min_sites` eligible waiting sites, then up to `grace` seconds for
        the other eligible connected sites to poll too."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + start_timeout
        while len(eligible(self.waiting_ids())) < min_sites:
            remaining = give_up - loop.time()
            if remaining <= 0:
                raise StateError(
                    f"fewer than min_sites={min_sites} eligible sites for {start_timeout:.0f} s"
                )
            self.metrics.sites_active.set(len(eligible(self.waiting_ids())))
            await self._wait_changed(min(remaining, SELECTION_POLL_SECONDS))
        grace_end = loop.time() + grace
        while set(eligible(self.waiting_ids())) != set(eligible(sorted(self.sites))):
            remaining = grace_end - loop.time()
            if remaining <= 0:
                break
            await self._wait_changed(remaining)
        chosen = eligible(self.waiting_ids())[:max_sites]
        self.metrics.sites_active.set(len(chosen))
        return chosen
