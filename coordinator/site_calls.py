"""The calls a site makes outside a round's phases: enrolment, ledger replication,
the long-poll for its next round, declining a round and heartbeats. They touch the
site registry, the ledger replica and the round in flight, never drive a round (that
is the engine's)."""

from __future__ import annotations

from collections.abc import Callable

from common.privacy.budget import BudgetReport
from common.rounds.announcement import Announcement
from coordinator.inbox import RoundInbox
from coordinator.ledger_gate import LedgerGate
from coordinator.sessions import SiteRegistry


class SiteCalls:
    """What the servicer asks on a site's behalf, in dataclasses."""

    def __init__(
        self,
        sessions: SiteRegistry,
        inbox: RoundInbox,
        ledgers: LedgerGate,
        *,
        clock: Callable[[], float],
    ) -> None:
        self.sessions = sessions
        self.inbox = inbox
        self.ledgers = ledgers
        self.clock = clock

    def enroll(self, site_id: str, certificate_der: bytes, *, serial: str, version: str,
               device: str, budget: BudgetReport | None) -> None:
        """Register the site's session; refused when its ledger head forked."""
        self.check_ledger_head(site_id, budget)
        self.sessions.enroll(site_id, certificate_der, serial=serial, version=version,
                             device=device, budget=budget)
        self.sessions.refuse_outlier(site_id)

    def check_ledger_head(self, site_id: str, budget: BudgetReport | None) -> int:
        return self.ledgers.check_head(site_id, budget)

    def replicate_ledger(self, site_id: str, history: bytes) -> int:
        return self.ledgers.replicate(site_id, history, now=self.clock())

    def decline(self, site_id: str, round_number: int, *, budget: BudgetReport | None,
                reason: str = "", lasting: bool = False) -> None:
        self.sessions.record_decline(site_id, round_number, budget=budget)
        self.sessions.refuse_outlier(site_id)
        self.inbox.decline(site_id, round_number, reason=reason, lasting=lasting)

    def heartbeat(self, site_id: str, round_number: int) -> None:
        """A site is alive: in `round_number`, or (0) waiting in its long-poll (its
        last contact, noted for every call, is all that a round-0 beat records)."""
        if round_number == 0:
            self.sessions.beat(site_id)
            return
        self.inbox.heartbeat(site_id, round_number)

    async def wait_for_round(
        self, site_id: str, *, after_round: int, wait_seconds: float, budget: BudgetReport | None,
        beat_seconds: float | None = None,
    ) -> Announcement | None:
        """Long-poll until a round selecting this site opens (None on timeout); a site
        that reconnects during its round gets that round's announcement at once.
        `beat_seconds`: the site beats (round 0) this often while the poll is open."""
        self.check_ledger_head(site_id, budget)
        session = self.sessions.session(site_id)
        session.polled = True
        self.sessions.record_budget(session, budget)
        self.sessions.refuse_outlier(site_id)
        current = self.inbox.rejoin(site_id, after_round=after_round)
        if current is not None:
            return current.announcement
        return await self.sessions.poll(site_id, wait_seconds=wait_seconds,
                                        beat_seconds=beat_seconds)
