"""The coordinator's replica of every site's signed privacy ledger,
kept in the state database: a site whose reported head does not extend the replica
(fork, shrink or reset) is refused, and so never selected, until an operator restores
it."""

from __future__ import annotations

import datetime as dt
import logging

from cryptography import x509

from common.config import CoordinatorSettings
from common.errors import LedgerForkError
from common.pki import load_certificate
from common.privacy.replica import LedgerReplica
from common.round import SiteBudget
from common.sqldb import Database

log = logging.getLogger("medfed.coordinator")


class LedgerGate:
    """Checks reported ledger heads against the replica and extends it."""

    def __init__(self, database: Database, settings: CoordinatorSettings) -> None:
        self.replica = LedgerReplica(database, ca_certificate=_federation_ca(settings))

    def check_head(self, site_id: str, budget: SiteBudget | None) -> int:
        """The replica's entry count for the site; LedgerForkError (FAILED_PRECONDITION
        to the site) when its reported head does not extend the replica."""
        held = self.replica.head(site_id)
        if budget is None or (held is None and budget.ledger_entries == 0):
            return 0 if held is None else held.entries
        try:
            self.replica.check_head(
                site_id, entries=budget.ledger_entries, head_hash=budget.ledger_head
            )
        except LedgerForkError as exc:
            log.error("site %s refused: %s", site_id, exc,
                      extra={"event": "ledger_fork", "site": site_id})
            raise
        return 0 if held is None else held.entries

    def replicate(self, site_id: str, history: bytes, *, now: float) -> int:
        """Extend the replica with the site's signed history; its new entry count."""
        head = self.replica.extend(
            site_id, history, now=dt.datetime.fromtimestamp(now, dt.UTC)
        )
        return head.entries


def _federation_ca(settings: CoordinatorSettings) -> x509.Certificate | None:
    """The federation CA replica entries must be signed under (None without one)."""
    path = settings.pki / "ca.crt"
    return load_certificate(path) if path.exists() else None
