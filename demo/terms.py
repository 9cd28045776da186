"""The SecAgg+ terms the demo gives its federation, and whether it kills a site."""

from __future__ import annotations

from dataclasses import dataclass

from common.core.config import AggregationSection, SitePolicySection
from common.core.errors import ConfigError
from common.protocol.secagg.params import round_floor
from coordinator.selection import round_parameters
from demo.options import AGGREGATION_CLIP


@dataclass(frozen=True)
class FederationTerms:
    """The SecAgg+ terms the demo gives its coordinator ([aggregation]) and its sites
    ([policy]), and the line saying why when they differ from the product's defaults."""

    aggregation: AggregationSection
    policy: SitePolicySection
    note: str | None = None


def federation_terms(n_sites: int, *, histogram_bins: int) -> FederationTerms:
    """The product's defaults (T = 1 colluding site, rounds of at least 3 sites) from 3
    sites on. Two sites cannot meet them: a sum of two hands each site the other's
    (DP-noised) update by subtraction, so the demo runs them with T = 0 and a round floor
    of 2 and says so."""
    if n_sites < 2:
        raise ConfigError("--data", f"a federation needs at least 2 site CSVs, found {n_sites}")
    if n_sites >= 3:
        return FederationTerms(
            AggregationSection(clip=AGGREGATION_CLIP, histogram_bins=histogram_bins),
            SitePolicySection(),
        )
    return FederationTerms(
        AggregationSection(clip=AGGREGATION_CLIP, histogram_bins=histogram_bins,
                           max_colluding_sites=0),
        SitePolicySection(min_round_sites=2, max_colluding_sites=0),
        note=("2 sites: the secure sum of two hands each site the other's DP-noised "
              "update (its own subtracted), so the demo assumes no colluding site "
              "(max_colluding_sites = 0) and lets rounds of 2 sites run "
              "(policy.min_round_sites = 2); a real federation should have at least 3"),
    )


@dataclass(frozen=True)
class DropoutDecision:
    """Whether the demo kills one site mid-round, and the line that says why."""

    inject: bool
    threshold: int
    floor: int
    line: str


def dropout_decision(n_sites: int, *, aggregation: AggregationSection,
                     policy: SitePolicySection) -> DropoutDecision:
    """Inject a dropout only where a round of `n_sites` survives losing one site: with
    SecAgg+ the n - 1 survivors must still hold t Shamir shares to unmask (t from
    `coordinator.selection.round_parameters`, the coordinator's own choice for these
    terms), and no survivor may refuse a sum of n - 1 sites (its round floor,
    max(min_round_sites, max_colluding_sites + 2)). The killed site is restarted before
    the next round's selection, so the coordinator's min_sites (every site) still holds
    then."""
    threshold, _neighbours = round_parameters(n_sites, aggregation)
    floor = round_floor(min_round_sites=policy.min_round_sites,
                        max_colluding_sites=max(policy.max_colluding_sites,
                                                aggregation.max_colluding_sites))
    survivors = n_sites - 1
    if aggregation.secure_aggregation and survivors < threshold:
        return DropoutDecision(
            False, threshold, floor,
            f"[fault] no dropout injected: with {n_sites} sites SecAgg+ needs t = "
            f"{threshold} of them to unmask (max_colluding_sites = "
            f"{aggregation.max_colluding_sites}), so a killed site would abort the round; "
            "every site stays up",
        )
    if survivors < floor:
        return DropoutDecision(
            False, threshold, floor,
            f"[fault] no dropout injected: the sites refuse sums of fewer than {floor} "
            f"sites, and {survivors} would be left",
        )
    return DropoutDecision(
        True, threshold, floor,
        f"[fault] one site will be killed mid-round: the {survivors} survivors still hold "
        f"t = {threshold} shares to unmask it, then it is restarted with its ledger",
    )

