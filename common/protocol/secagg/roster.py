"""The roster a round settles on once AdvertiseKeys closes, derived alike by every side.

Everything the later phases index by follows from the accepted entries alone: each
site's Shamir evaluation point (its 1-based position in site-id order), the session id
(`common.protocol.secagg.session`) and the SecAgg+ neighbour graph (Bell et al. 2020,
sec. 3). The coordinator and every site derive it with `settle_roster`, so the two
sides cannot drift apart on any of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from common.protocol.secagg.graph import NeighbourGraph, neighbour_graph
from common.protocol.secagg.messages import RosterEntry
from common.protocol.secagg.params import SecAggParams
from common.protocol.secagg.session import session_id as compute_session_id


@dataclass(frozen=True)
class RoundRoster:
    """The settled roster: entries by site id (sorted), each site's Shamir point, the
    session id and the neighbour graph. Empty until AdvertiseKeys closes."""

    entries: Mapping[str, RosterEntry] = field(default_factory=dict)
    points: Mapping[str, int] = field(default_factory=dict)
    session_id: bytes = b""
    graph: NeighbourGraph = field(default_factory=lambda: NeighbourGraph((), 0))

    def closed_neighbourhood(self, site: str) -> set[str]:
        """`site` and its neighbours: the holders of its shares."""
        return {site, *self.graph[site]}


def settle_roster(params: SecAggParams, entries: Mapping[str, RosterEntry]) -> RoundRoster:
    """The roster of the accepted `entries` (keyed by site id) for this round."""
    sites = sorted(entries)
    ordered = {site: entries[site] for site in sites}
    session = compute_session_id(params, ordered.values())
    return RoundRoster(
        entries=ordered,
        points={site: index + 1 for index, site in enumerate(sites)},
        session_id=session,
        graph=neighbour_graph(session, sites, params.neighbours),
    )
