"""Round parameters of SecAgg+ and their check against the stated threat model.

Threat model (docs/threat-model.md): the coordinator is curious and may deviate from
the protocol; up to T sites collude with it; up to D sites drop out. Each site's two
secrets are Shamir-shared with threshold t among its closed neighbourhood of k + 1
sites (k = n - 1 for the complete graph of Bonawitz et al. 2017).

Inequalities enforced (m = k + 1, the number of holders of one site's shares):

* ``t > T``: the colluding sites alone cannot reconstruct anybody's secret.
* ``2t > m + T``: to learn one honest site's input the coordinator needs t shares of
  its self-mask seed AND t shares of its mask key. Honest holders reveal only one kind
  and, thanks to the signed consistency check with a neighbourhood quorum of t, every
  honest holder that reveals anything saw the same survivor list, so the two stories
  need ``(h_a + T) >= t`` and ``(h_b + T) >= t`` with ``h_a + h_b + T <= m``, i.e.
  ``2t <= m + T``. We forbid exactly that (Bonawitz et al. 2017, sec. 6 / App. A;
  Bell et al. 2020, sec. 4).
* ``t <= m - D``: D dropouts inside one neighbourhood still leave t holders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from common.core.errors import ConfigError

ROUND_NONCE_BYTES = 16
ANNOUNCEMENT_DIGEST_BYTES = 32  # SHA-256
NO_ANNOUNCEMENT_DIGEST = bytes(ANNOUNCEMENT_DIGEST_BYTES)
"""Placeholder digest until the round announcement is hashed by its caller: with it,
only the SecAgg parameters themselves (and the participants) are bound, as before."""

DEFAULT_MIN_ROUND_SITES = 3
DEFAULT_MAX_COLLUDING_SITES = 1
COMPLETE_GRAPH_MAX_SITES = 20
"""Up to this many sites the complete graph is used: its cost, O(n) masks per site, is
still small, and it tolerates the most dropouts for a given threshold."""

NEIGHBOURS_PER_LOG2_SITES = 3
"""SecAgg+ degree constant: k = 3 * ceil(log2 n), rounded up to even.

Bell et al. 2020 (sec. 3.2, Thm. 3.6) need k = O(log n) so that, with overwhelming
probability over the random graph, no neighbourhood is dominated by colluders or
dropouts. Their concrete tables put k around 2-4 log2 n for sigma = 40 statistical
security and corruption/dropout rates up to a third; 3 log2 n is the middle of that
range (n = 100 -> k = 22, n = 1000 -> k = 30). The threat-model inequalities below are
then checked against the worst case (all T colluders and D dropouts in one neighbourhood),
which raises k further when T or D are large.
"""


@dataclass(frozen=True)
class SecAggParams:
    """Everything every participant must agree on before a round starts."""

    round_number: int
    round_nonce: bytes
    participants: tuple[str, ...]
    threshold: int
    neighbours: int
    vector_length: int
    announcement_digest: bytes = NO_ANNOUNCEMENT_DIGEST
    """SHA-256 of everything the coordinator told the site for this round (study and
    model hashes, clip, bits, bins, deadlines; computed by the caller). Bound into the
    session id and into every AdvertiseKeys signature, so sites told different stories
    refuse each other's keys at the roster, before any share or masked input leaves.
    Defaults to 32 zero bytes: nothing beyond the parameters here."""

    def __post_init__(self) -> None:
        if isinstance(self.round_number, bool) or not isinstance(self.round_number, int):
            raise ConfigError("round_number", "must be an integer")
        if self.round_number < 0:
            raise ConfigError("round_number", "must be non-negative")
        if not isinstance(self.round_nonce, bytes) or len(self.round_nonce) != ROUND_NONCE_BYTES:
            raise ConfigError("round_nonce", f"must be {ROUND_NONCE_BYTES} bytes")
        participants = self.participants
        if not isinstance(participants, tuple) or not all(
            isinstance(site, str) and site for site in participants
        ):
            raise ConfigError("participants", "must be a tuple of non-empty site ids")
        if list(participants) != sorted(set(participants)):
            raise ConfigError("participants", "must be sorted and unique")
        if len(participants) < 2:
            raise ConfigError("participants", "secure aggregation needs at least 2 sites")
        if isinstance(self.neighbours, bool) or not isinstance(self.neighbours, int):
            raise ConfigError("neighbours", "must be an integer")
        if self.neighbours < 0:
            raise ConfigError("neighbours", "must be >= 0 (0 means the complete graph)")
        if 0 < self.neighbours < len(participants) - 1 and self.neighbours % 2:
            raise ConfigError("neighbours", "a Harary graph needs an even degree k")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int):
            raise ConfigError("threshold", "must be an integer")
        if not 1 <= self.threshold <= self.neighbourhood_size:
            raise ConfigError(
                "threshold",
                f"must be in [1, {self.neighbourhood_size}] (the neighbourhood size k + 1)",
            )
        if isinstance(self.vector_length, bool) or not isinstance(self.vector_length, int):
            raise ConfigError("vector_length", "must be an integer")
        if self.vector_length < 1:
            raise ConfigError("vector_length", "must be positive")
        if (
            not isinstance(self.announcement_digest, bytes)
            or len(self.announcement_digest) != ANNOUNCEMENT_DIGEST_BYTES
        ):
            raise ConfigError(
                "announcement_digest", f"must be {ANNOUNCEMENT_DIGEST_BYTES} bytes (SHA-256)"
            )

    @property
    def effective_neighbours(self) -> int:
        """k as used for n = len(participants): n - 1 for the complete graph."""
        n = len(self.participants)
        if self.neighbours == 0 or self.neighbours >= n - 1:
            return n - 1
        return self.neighbours

    @property
    def neighbourhood_size(self) -> int:
        """k + 1: how many sites (including the owner) hold shares of one site's secrets."""
        return self.effective_neighbours + 1


@dataclass(frozen=True)
class ThreatModel:
    """At most `max_colluding_sites` sites collude with the coordinator; at most
    `max_dropouts` sites drop out of a round (worst case: all in one neighbourhood)."""

    max_colluding_sites: int
    max_dropouts: int

    def __post_init__(self) -> None:
        for name in ("max_colluding_sites", "max_dropouts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(name, "must be a non-negative integer")


def round_floor(*, min_round_sites: int, max_colluding_sites: int) -> int:
    """Fewest sites whose inputs a sum may cover before this site takes part.

    max(min_round_sites, T + 2): with T colluders (who know their own inputs) inside
    the sum, at least two honest inputs remain, so no single honest update can be
    recovered by subtraction; a sum of two would hand each party the other's update.
    """
    for name, value, low in (
        ("min_round_sites", min_round_sites, 2),
        ("max_colluding_sites", max_colluding_sites, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(name, f"must be an integer >= {low}")
    return max(min_round_sites, max_colluding_sites + 2)


def minimum_threshold(*, neighbourhood_size: int, colluding: int) -> int:
    """Smallest t with t > T and 2t > m + T (see the module docstring)."""
    return max(colluding + 1, (neighbourhood_size + colluding) // 2 + 1)


def validate_against_threat_model(params: SecAggParams, threat: ThreatModel) -> None:
    """Raise ConfigError unless t and k defend against `threat` (checked at start-up)."""
    m = params.neighbourhood_size
    t = params.threshold
    colluding = threat.max_colluding_sites
    low = minimum_threshold(neighbourhood_size=m, colluding=colluding)
    if t < low:
        raise ConfigError(
            "threshold",
            f"t = {t} is too small: with {colluding} colluding sites and neighbourhoods "
            f"of {m} the coordinator could collect both secrets of a site; need t >= {low} "
            f"(t > T and 2t > k + 1 + T)",
        )
    if t > m - threat.max_dropouts:
        raise ConfigError(
            "threshold",
            f"t = {t} is too large: {threat.max_dropouts} dropouts in a neighbourhood of "
            f"{m} would leave fewer than t share holders (need t <= k + 1 - D)",
        )


def choose_parameters(
    n_sites: int, threat: ThreatModel, neighbours: Literal["auto"] | int = "auto"
) -> tuple[int, int]:
    """Pick (threshold t, neighbours k) for `n_sites` under `threat`.

    k = 0 (complete graph) up to COMPLETE_GRAPH_MAX_SITES sites; beyond, an even
    k >= 3 ceil(log2 n) that also satisfies k + 1 > T + 2D (needed for a t to exist).
    t is the smallest value the threat model allows, which leaves the most room for
    dropouts. Raises ConfigError when no (t, k) satisfies the threat model.
    """
    if isinstance(n_sites, bool) or not isinstance(n_sites, int) or n_sites < 2:
        raise ConfigError("n_sites", "secure aggregation needs at least 2 sites")
    colluding, dropouts = threat.max_colluding_sites, threat.max_dropouts
    if neighbours == "auto":
        if n_sites <= COMPLETE_GRAPH_MAX_SITES:
            k = 0
        else:
            k = NEIGHBOURS_PER_LOG2_SITES * math.ceil(math.log2(n_sites))
            # Room for a threshold: need m - D >= minimum_threshold(m, T).
            while minimum_threshold(neighbourhood_size=k + 1, colluding=colluding) > (
                k + 1 - dropouts
            ):
                k += 1
            k += k % 2
            if k >= n_sites - 1:
                k = 0
    elif isinstance(neighbours, bool) or not isinstance(neighbours, int) or neighbours < 0:
        raise ConfigError("neighbours", "must be 'auto' or a non-negative even integer")
    else:
        k = neighbours
        if 0 < k < n_sites - 1 and k % 2:
            raise ConfigError("neighbours", "a Harary graph needs an even degree k")
    m = n_sites if k == 0 or k >= n_sites - 1 else k + 1
    t = minimum_threshold(neighbourhood_size=m, colluding=colluding)
    if t > m - dropouts:
        raise ConfigError(
            "threat_model",
            f"no threshold fits: neighbourhoods of {m} sites cannot tolerate {dropouts} "
            f"dropouts and {colluding} colluders at once (need k + 1 > T + 2D)",
        )
    return t, k
