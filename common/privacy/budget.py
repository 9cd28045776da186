"""One site's privacy budget as it is reported: figures only, never data.

The same record all the way: the site's ledger makes it (`PrivacyLedger.status`),
`common.rounds.wire` translates it to and from the protobuf `BudgetStatus` every call
carries, the coordinator keeps the latest per site session, and its federation view
(`common.privacy.federation`) stores it as one row, stamped with when it was recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

STATUS_ACTIVE: Final = "active"
STATUS_EXHAUSTED: Final = "exhausted"


@dataclass(frozen=True)
class BudgetReport:
    """A site's budget and ledger head (budget_epsilon 0: the site keeps no ledger,
    i.e. a run without DP accounting)."""

    budget_epsilon: float = 0.0
    spent_epsilon: float = 0.0
    delta: float = 0.0
    privacy_unit: str = ""
    exhausted: bool = False
    """The site says its ledger cannot pay the next round (it refused one)."""
    ledger_entries: int = 0
    ledger_head: str = ""
    last_round: int | None = None
    """The round of the ledger's last entry (None: no entry)."""
    site_id: str = ""
    updated_at: str = ""
    """When the coordinator's federation view recorded it (ISO 8601; "" elsewhere)."""

    @property
    def remaining_epsilon(self) -> float:
        return max(0.0, self.budget_epsilon - self.spent_epsilon)

    @property
    def out_of_budget(self) -> bool:
        """Reported exhausted, or all of a (non-zero) budget spent."""
        if self.exhausted:
            return True
        return self.budget_epsilon > 0 and self.spent_epsilon >= self.budget_epsilon

    @property
    def status(self) -> str:
        """As the federation view shows it: "exhausted" or "active"."""
        return STATUS_EXHAUSTED if self.out_of_budget else STATUS_ACTIVE
