"""SecAgg+ neighbourhoods: who shares secrets with (and masks against) whom.

Bell et al. 2020 (sec. 3) replace the complete graph of Bonawitz et al. 2017 by a
random k-regular graph with k = O(log n). We use the Harary graph H(k, n) (each node
joined to the k/2 nearest on each side of a ring) laid over a random permutation of
the sites. The permutation comes from a PRG keyed by HKDF(session_id, NEIGHBOUR_GRAPH):
the session id hashes every site's fresh public keys, so the coordinator cannot choose
the graph (it could only re-roll it by dropping advertisements, which costs it sites).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from common.core.errors import ConfigError
from common.crypto.kdf import KdfInfo, hkdf_sha256
from common.crypto.prg import expand_mask


def _prg_words(seed: bytes, batch: int) -> Iterator[int]:
    """Endless uint32 words of the ChaCha20 mask PRG keyed by `seed`, in order."""
    produced = 0
    while True:
        # expand_mask(seed, L) is a prefix of expand_mask(seed, L') for L < L'.
        words = expand_mask(seed, produced + batch)[produced:]
        produced += batch
        yield from (int(word) for word in words)


def _random_permutation(seed: bytes, n: int) -> list[int]:
    """Fisher-Yates driven by PRG words, with rejection sampling so that every
    permutation is exactly equally likely (no modulo bias)."""
    words = _prg_words(seed, 2 * n + 16)
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        bound = i + 1
        limit = (1 << 32) - ((1 << 32) % bound)  # largest multiple of bound <= 2^32
        word = next(words)
        while word >= limit:
            word = next(words)
        j = word % bound
        order[i], order[j] = order[j], order[i]
    return order


class NeighbourGraph(Mapping[str, tuple[str, ...]]):
    """site -> its neighbours (excluding itself, sorted), each computed on first lookup.

    A client needs only its two-hop part, O(k^2); building all n neighbourhoods would
    make every client pay O(n k) (a third of its time at n = 200, d = 1e5).
    """

    def __init__(self, ring: Sequence[str], k: int) -> None:
        self._ring = tuple(ring)
        self._position = {site: index for index, site in enumerate(self._ring)}
        self._complete = k == 0 or k >= len(self._ring) - 1
        self._half = k // 2
        self._cache: dict[str, tuple[str, ...]] = {}

    def __getitem__(self, site: str) -> tuple[str, ...]:
        cached = self._cache.get(site)
        if cached is None:
            position = self._position[site]  # KeyError for a stranger, as a dict would
            n = len(self._ring)
            if self._complete:
                peers = set(self._ring) - {site}
            else:
                steps = range(-self._half, self._half + 1)
                peers = {self._ring[(position + step) % n] for step in steps if step}
            cached = self._cache[site] = tuple(sorted(peers))
        return cached

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._position))

    def __len__(self) -> int:
        return len(self._ring)


def neighbour_graph(session_id: bytes, site_ids: Sequence[str], k: int) -> NeighbourGraph:
    """The graph of `neighbourhoods`, computed lazily (what a client uses)."""
    sites = sorted(site_ids)
    if len(set(sites)) != len(sites):
        raise ConfigError("site_ids", "must be unique")
    n = len(sites)
    if k < 0:
        raise ConfigError("neighbours", "must be non-negative")
    if k == 0 or k >= n - 1:
        return NeighbourGraph(sites, k)
    if k % 2:
        raise ConfigError("neighbours", "a Harary graph needs an even degree k")
    # Public randomness (everyone can recompute it), derived like every other key:
    # its own info label, the session id as salt (docs/crypto.md, "Key derivation").
    seed = hkdf_sha256(session_id, salt=session_id, info=KdfInfo.NEIGHBOUR_GRAPH.value)
    order = _random_permutation(seed, n)
    return NeighbourGraph([sites[i] for i in order], k)


def neighbourhoods(
    session_id: bytes, site_ids: Sequence[str], k: int
) -> dict[str, tuple[str, ...]]:
    """Each site's neighbours (excluding itself), sorted by site id.

    Complete graph when k == 0 or k >= n - 1; otherwise a Harary graph of even degree
    k over a permutation derived from the session id. Symmetric and deterministic.
    """
    return dict(neighbour_graph(session_id, site_ids, k).items())


def adjacency_is_symmetric(graph: dict[str, tuple[str, ...]]) -> bool:
    """True when v in N(u) <=> u in N(v) (a cheap invariant the tests check)."""
    return all(site in graph[peer] for site, peers in graph.items() for peer in peers)


__all__ = ["NeighbourGraph", "adjacency_is_symmetric", "neighbour_graph", "neighbourhoods"]
