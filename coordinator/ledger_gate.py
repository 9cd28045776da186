"""The coordinator's replica of every site's signed privacy ledger,
kept in the state database: a site whose reported head does not extend the replica
(fork, shrink or reset) is refused, and so never selected, until an operator restores
it. A site that carried its ledger into new terms (`medfed ledger carry`) sends its
whole history, which the replica accepts once it verifies as a carry of what it holds
(`LedgerReplica.extend`): logged as `ledger_carried`."""

from __future__ import annotations

import datetime as dt
import logging
import math
from collections.abc import Iterable

from cryptography import x509

from common.core.config import CoordinatorSettings
from common.core.errors import LedgerForkError, ValidationError
from common.core.sqldb import Database
from common.privacy.budget import BudgetReport
from common.privacy.mechanisms import DistributedDiscreteGaussian
from common.privacy.purpose import Purpose
from common.privacy.replica import LedgerReplica
from common.protocol.pki import load_certificate

log = logging.getLogger("medfed.coordinator")


class LedgerGate:
    """Checks reported ledger heads against the replica and extends it."""

    def __init__(self, database: Database, settings: CoordinatorSettings) -> None:
        self.replica = LedgerReplica(database, ca_certificate=_federation_ca(settings))

    def check_head(self, site_id: str, budget: BudgetReport | None) -> int:
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
        carried = head.carried
        if carried is not None:
            log.warning(
                "site %s carried its ledger into new terms: the replica now holds its %d "
                "entries under head %s... (was %d entries, head %s...); epsilon spent %.4f "
                "(was %.4f under the old terms); the old history is kept "
                "(privacy_replica_carried)",
                site_id, head.entries, carried.new_head_hash[:16], carried.old_entries,
                carried.old_head_hash[:16], carried.new_spent, carried.old_spent,
                extra={"event": "ledger_carried", "site": site_id,
                       "old_head": carried.old_head_hash, "new_head": carried.new_head_hash,
                       "old_entries": carried.old_entries, "entries": head.entries,
                       "spent_before": carried.old_spent, "spent_after": carried.new_spent},
            )
        return head.entries


EVALUATION_PURPOSE = Purpose.EVALUATION
"""The purpose of a site's ledger entry for one DP score histogram."""


def evaluation_noise_std(
    replica: LedgerReplica, sites: Iterable[str], *, round_number: int
) -> float | None:
    """The per-count noise std of a round's summed evaluation histogram, from the
    signed ledger entries the contributing `sites` published: each adds N_Z(0, s^2)
    (`DistributedDiscreteGaussian.noise_variance_per_site`), so the sum carries
    sqrt(sum of s^2) (at most; KLS21). A site's entry for `round_number` (a site sends
    it to the replica once it is on its ledger, before its histogram), else its latest
    evaluation entry (a site's noise setting does not change between rounds; a replica
    that missed the round's entry catches up after it). None (estimate from the
    release instead) when a
    site has no replica or no evaluation entry in it yet: a site that kept a ledger but
    has not replicated it (nothing to send yet) still added noise, and leaving it out
    would understate the std and narrow the reported interval."""
    variance = 0.0
    for site in sites:
        try:
            history = replica.history(site)
        except ValidationError:
            return None
        entries = [e for e in history.entries if e.purpose == EVALUATION_PURPOSE]
        if not entries:
            return None
        this_round = [e for e in entries if e.round == round_number]
        entry = (this_round or entries)[-1]
        variance += sum(m.noise_variance_per_site for m in entry.mechanisms
                        if isinstance(m, DistributedDiscreteGaussian))
    return math.sqrt(variance) if variance > 0 else None


def _federation_ca(settings: CoordinatorSettings) -> x509.Certificate | None:
    """The federation CA replica entries must be signed under (None without one)."""
    path = settings.pki / "ca.crt"
    return load_certificate(path) if path.exists() else None
