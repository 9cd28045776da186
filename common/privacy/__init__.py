"""Privacy accounting and budgets: the accountant, each site's ledger, the federation view.

The site's own ledger (`ledger.PrivacyLedger`) is authoritative for that site; the
coordinator only keeps a view (`federation.FederationBudgetView`) for the operator.
"""

from common.privacy.accountant import (
    EpsilonReport,
    Segment,
    account,
    compose_epsilon,
    epsilon_after,
    plan_noise_multiplier,
)
from common.privacy.federation import FederationBudgetView, SiteBudget
from common.privacy.ledger import (
    BudgetStatus,
    LedgerEntry,
    PrivacyLedger,
    VerifyReport,
    verify_ledger,
)

__all__ = [
    "BudgetStatus",
    "EpsilonReport",
    "FederationBudgetView",
    "LedgerEntry",
    "PrivacyLedger",
    "Segment",
    "SiteBudget",
    "VerifyReport",
    "account",
    "compose_epsilon",
    "epsilon_after",
    "plan_noise_multiplier",
    "verify_ledger",
]
