"""Unmask at the site: which share of each owner it reveals, and the guard that never
reveals both secrets of one site.

The single most important rule of SecAgg (Bonawitz et al. 2017, sec. 4, Unmask):
revealing both b_u and s_u^SK of one site unmasks its input. A site reveals b_v for a
surviving owner v and s_v^SK for a dropped one, and whatever the coordinator says, a
second kind for the same owner aborts instead.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from common.core.errors import AbortReason, ProtocolAbort
from common.protocol.secagg.messages import RevealedShare, ShareKind, UnmaskShares


class RevealGuard:
    """Remembers which kind of share was revealed for each owner."""

    def __init__(self) -> None:
        self._revealed: dict[str, ShareKind] = {}

    def record(self, owner: str, kind: ShareKind) -> None:
        previous = self._revealed.get(owner)
        if previous is not None and previous is not kind:
            raise ProtocolAbort(
                AbortReason.PEER_BOTH_ALIVE_AND_DROPPED,
                f"refusing to reveal the {kind.name} share of {owner}: "
                f"its {previous.name} share was already revealed",
            )
        self._revealed[owner] = kind

    def revealed(self, owner: str) -> ShareKind | None:
        return self._revealed.get(owner)


def reveal_shares(
    owners: Iterable[str], *, alive: Collection[str],
    held: Mapping[str, tuple[bytes, bytes]], guard: RevealGuard,
) -> UnmaskShares:
    """For each owner (sorted), its self-mask seed share if it is `alive`, else its
    masking key share, from the (seed share, key share) pairs `held`; each recorded
    with `guard` first."""
    revealed: list[RevealedShare] = []
    for owner in sorted(owners):
        seed_share, key_share = held[owner]
        if owner in alive:
            kind, share = ShareKind.SELF_MASK_SEED, seed_share
        else:
            kind, share = ShareKind.MASKING_KEY, key_share
        guard.record(owner, kind)
        revealed.append(RevealedShare(owner_site_id=owner, kind=kind, share=share))
    return UnmaskShares(shares=tuple(revealed))
