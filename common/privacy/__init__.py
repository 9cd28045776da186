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

__all__ = [
    "EpsilonReport",
    "Segment",
    "account",
    "compose_epsilon",
    "epsilon_after",
    "plan_noise_multiplier",
]
