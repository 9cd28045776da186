"""What one run of a query costs a site, as its ledger charges it, and whether the
site's limits allow it.

A query is ONE ledger entry holding one distributed discrete Gaussian per statistic
(`query_mechanisms`, planned for the study's noise sites). The ledger composes them
with the rest of its history (a history holding a distributed discrete Gaussian is
composed in RDP, Mironov 2017, converted with Balle et al. 2020, whichever accountant the
site names: `common.privacy.accountant`), so what it charges is their composition, not
the sum of the statistics' epsilons (zCDP adds rho, Bun & Steinke 2016): the figure
`medfed query check`, `medfed site approve`, the answer and the model card show beside
the sum.

Each run is held to the per-round cap (`common.study.per_round_cap`: the smaller of the
site's and the study's `max_epsilon_per_round`). At run time a site measures what the
query adds to its own ledger, eps(ledger + query) - eps(ledger)
(`site_agent.releases.refuse_over_round_cap`, the rule of training rounds); here, with
no ledger to hand, the query is measured on its own: what it adds to an empty ledger,
as a query run before the study's first round is charged.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.privacy.accountant import compose_epsilon
from common.releases.analytics.query import Query
from common.releases.analytics.vector import query_mechanisms
from common.releases.seam import study_noise_sites
from common.study import SitePrivacyPolicy, Study, per_round_cap
from common.study.policy import ROUND_CAP_SLACK


def ledger_epsilon(query: Query, *, study: Study, delta: float | None = None,
                   accountant: str = "prv") -> float:
    """The epsilon one run of `query` charges a ledger of `delta` (default: the study's)
    on its own: its statistics' mechanisms, at the study's noise sites, composed by the
    ledger's accountant. A site's delta is never below the study's (it refuses such a
    study), so the study's delta gives the most any member is charged."""
    mechanisms = query_mechanisms(query, study=study, n_noise=study_noise_sites(study))
    return compose_epsilon(mechanisms, delta=study.privacy.delta if delta is None else delta,
                           accountant=accountant)


@dataclass(frozen=True)
class QueryCost:
    """One run of a query against a site's limits (`query_cost`)."""

    epsilon_sum: float
    """The sum of the statistics' epsilons (an upper bound of their composition, up to
    the accountant's grid of orders)."""
    epsilon_composed: float
    """What the ledger charges for it on its own (`ledger_epsilon`)."""
    delta: float
    cap: float | None
    """The per-round cap it is held to (None: none set)."""
    cap_source: str
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def cap_text(self) -> str:
        """One line saying which cap holds and whether the query is within it."""
        if self.cap is None:
            return "no per-round cap set (the budget still applies)"
        within = "within" if self.epsilon_composed <= self.cap + ROUND_CAP_SLACK else "ABOVE"
        return (f"epsilon {self.epsilon_composed:.4g} per run, {within} the per-round cap "
                f"{self.cap:g} ({self.cap_source})")


def query_cost(query: Query, *, study: Study, policy: SitePrivacyPolicy | None,
               accountant: str = "prv") -> QueryCost:
    """`query`'s cost and what refuses it: above the per-round cap (the study's, and the
    site's when its `policy` is given), above the site's budget, or a study delta above
    the site's. Without a policy only the study's own cap is known."""
    delta = study.privacy.delta if policy is None else policy.delta  # the ledger's
    composed = ledger_epsilon(query, study=study, delta=delta, accountant=accountant)
    cap, source = per_round_cap(
        study, site_cap=None if policy is None else policy.max_epsilon_per_round)
    problems = []
    if cap is not None and composed > cap + ROUND_CAP_SLACK:
        problems.append(
            f"one run of the query costs epsilon {composed:.4g} (its statistics composed as "
            f"the ledger composes them; {query.epsilon:g} summed), above the per-round cap "
            f"{cap:g} ({source}): the site declines it when it runs")
    if policy is not None:
        if composed > policy.epsilon:
            problems.append(f"one run of the query costs epsilon {composed:.4g}, above this "
                            f"site's whole budget {policy.epsilon:g}")
        if study.privacy.delta > policy.delta:
            problems.append(f"the study's delta {study.privacy.delta:g} exceeds this site's "
                            f"{policy.delta:g}")
    return QueryCost(epsilon_sum=query.epsilon, epsilon_composed=composed, delta=delta,
                     cap=cap, cap_source=source, problems=tuple(problems))


__all__ = ["QueryCost", "ledger_epsilon", "query_cost"]
