"""Privacy accounting and budgets: mechanisms, the accountant, each site's signed ledger,
the coordinator's replica of it and its federation view.

The site's own ledger (`ledger.PrivacyLedger`) is authoritative for that site; the
coordinator keeps a replica of the signed entries (`replica.LedgerReplica`) and a view
(`federation.FederationBudgetView`) for the operator.
"""

from common.privacy.accountant import (
    EpsilonReport,
    RoundNoisePlan,
    Segment,
    account,
    compose_epsilon,
    epsilon_after,
    plan_noise_multiplier,
    plan_round_noise,
)
from common.privacy.budget import BudgetReport
from common.privacy.federation import FederationBudgetView
from common.privacy.ledger import (
    LedgerEntry,
    PrivacyLedger,
    VerifyReport,
    verify_ledger,
)
from common.privacy.mechanisms import (
    DistributedDiscreteGaussian,
    Gaussian,
    Mechanism,
    SampledGaussian,
)
from common.privacy.signed import LedgerSigner, SignedEntry, SignedHistory

__all__ = [
    "BudgetReport",
    "DistributedDiscreteGaussian",
    "EpsilonReport",
    "FederationBudgetView",
    "Gaussian",
    "LedgerEntry",
    "LedgerSigner",
    "Mechanism",
    "PrivacyLedger",
    "RoundNoisePlan",
    "SampledGaussian",
    "Segment",
    "SignedEntry",
    "SignedHistory",
    "VerifyReport",
    "account",
    "compose_epsilon",
    "epsilon_after",
    "plan_noise_multiplier",
    "plan_round_noise",
    "verify_ledger",
]
