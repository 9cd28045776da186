"""Unmask at the coordinator: the shares each confirmed survivor reveals, every secret the
sum needs rebuilt from them, and the masks those secrets expand to.

    sum_{u in U3} x_u = sum y_u - sum_{u in U3} PRG(b_u)
                        -/+ sum_{u dropped, v in N(u) & U3} PRG(s_uv)

(Bonawitz et al. 2017, sec. 4, Unmask; Bell et al. 2020, sec. 3.) Every secret is
accepted only if it passes its check: the owner's ShareKeys commitment to b_u, or the
masking public key it advertised (`common.protocol.secagg.reconstruction`, which also
corrects wrong shares and names their holders). A secret with fewer than t shares, or
none that passes its check, is a ProtocolAbort(RECONSTRUCTION_FAILED): never a silently
wrong sum.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from functools import partial

from common.core.errors import AbortReason, CryptoError, ProtocolAbort, ValidationError
from common.crypto.kdf import KdfInfo
from common.crypto.keyagreement import derive_key, public_key_of
from common.crypto.shamir import PRIME, SHARE_BYTES
from common.protocol.secagg.masking import self_mask_seed
from common.protocol.secagg.messages import (
    ShareKind,
    SurvivorList,
    UnmaskShares,
    self_mask_commitment,
)
from common.protocol.secagg.phases import require_sender
from common.protocol.secagg.reconstruction import SecretCheck, reconstruct_checked
from common.protocol.secagg.roster import RoundRoster

UnmaskSeeds = tuple[list[bytes], list[bytes]]
"""(add, subtract): the PRG seeds whose masks unmasking adds to, and subtracts from, the
masked sum."""


class RevealedShares:
    """The shares revealed so far this round, by holder, and what they rebuild."""

    def __init__(
        self, *, roster: RoundRoster, listing: SurvivorList, threshold: int,
        commitment: Callable[[str], bytes],
    ) -> None:
        """`commitment(owner)`: `owner`'s ShareKeys commitment to its self-mask seed."""
        self._roster = roster
        self._alive = frozenset(listing.survivors)
        self._dropped = frozenset(listing.dropped)
        self._needed = [(owner, ShareKind.SELF_MASK_SEED) for owner in listing.survivors] + [
            (owner, ShareKind.MASKING_KEY) for owner in listing.dropped
        ]
        self._threshold = threshold
        self._commitment = commitment
        self._revealed: dict[str, dict[str, int]] = {}  # holder -> owner -> share y
        self._misbehaving: dict[str, set[str]] = {}  # holder -> owners of its wrong shares

    @property
    def misbehaving(self) -> dict[str, tuple[str, ...]]:
        """Holder -> owners whose secrets it revealed wrong shares of (filled by
        `unmask_seeds`, also when it aborts)."""
        return {holder: tuple(sorted(owners)) for holder, owners in self._misbehaving.items()}

    def accept(self, site_id: str, message: UnmaskShares, *, confirmed: set[str]) -> None:
        """Keep one survivor's revealed shares once every one is checked: only from a
        site in `confirmed` (it signed the survivor list), only of owners in its closed
        neighbourhood, once each, of the kind the list entitles (b_u of a survivor, s_u^SK
        of a dropped site), a field element. ValidationError (nothing kept) otherwise."""
        require_sender(site_id, confirmed, "a site that confirmed the survivors")
        if site_id in self._revealed:
            raise ValidationError(f"{site_id!r} already sent its unmask shares")
        closed = self._roster.closed_neighbourhood(site_id)
        accepted: dict[str, int] = {}
        for revealed in message.shares:
            owner = revealed.owner_site_id
            if owner not in closed:
                raise ValidationError(f"{site_id!r} holds no share of {owner!r}")
            if owner in accepted:
                raise ValidationError(f"two shares of {owner!r}")
            expected = (
                ShareKind.SELF_MASK_SEED
                if owner in self._alive
                else ShareKind.MASKING_KEY
                if owner in self._dropped
                else None
            )
            if revealed.kind is not expected:
                raise ValidationError(f"wrong share kind for {owner!r}")
            if len(revealed.share) != SHARE_BYTES:
                raise ValidationError(f"shares must be {SHARE_BYTES} bytes")
            y = int.from_bytes(revealed.share, "big")
            if y >= PRIME:
                raise ValidationError("share is not a field element")
            accepted[owner] = y
        self._revealed[site_id] = accepted

    def unmask_seeds(self) -> UnmaskSeeds:
        """Rebuild every needed secret and expand it to the seeds of the masks to strip;
        ProtocolAbort(RECONSTRUCTION_FAILED) when one cannot be rebuilt."""
        holders_of: dict[str, list[str]] = {owner: [] for owner, _ in self._needed}
        for holder in sorted(self._revealed):
            for owner in self._revealed[holder]:
                holders_of[owner].append(holder)
        short = [owner for owner, holders in holders_of.items() if len(holders) < self._threshold]
        if short:
            raise ProtocolAbort(
                AbortReason.RECONSTRUCTION_FAILED, f"fewer than t shares for {short}"
            )
        session = self._roster.session_id
        add: list[bytes] = []
        subtract: list[bytes] = []
        for owner, kind in self._needed:
            secret = self._reconstruct(owner, kind, holders_of[owner])
            if kind is ShareKind.SELF_MASK_SEED:
                subtract.append(self_mask_seed(secret, session=session))
                continue
            for peer in self._roster.graph[owner]:
                if peer not in self._alive:
                    continue
                seed = _pairwise_seed(
                    secret, self._roster.entries[peer].masking_public_key, session=session
                )
                # The survivor `peer` added +PRG(s) if peer < owner, else -PRG(s).
                (subtract if peer < owner else add).append(seed)
        return add, subtract

    def _reconstruct(self, owner: str, kind: ShareKind, holders: list[str]) -> bytes:
        """The owner's secret of `kind`, checked and error-corrected (see module doc)."""
        check: SecretCheck
        if kind is ShareKind.SELF_MASK_SEED:
            check = partial(
                _matches_commitment, commitment=self._commitment(owner),
                session=self._roster.session_id, owner=owner,
            )
        else:
            check = partial(
                _matches_public_key, public_key=self._roster.entries[owner].masking_public_key
            )
        points = self._roster.points
        holder_at = {points[holder]: holder for holder in holders}
        try:
            result = reconstruct_checked(
                [points[holder] for holder in holders],
                [self._revealed[holder][owner] for holder in holders],
                threshold=self._threshold,
                check=check,
            )
        except (CryptoError, ValidationError):
            raise ProtocolAbort(
                AbortReason.RECONSTRUCTION_FAILED,
                f"no {self._threshold} shares of {owner!r} yield its committed "
                f"{kind.name.lower()} (wrong shares from too many holders, or {owner!r} "
                "committed to another value)",
            ) from None
        for x in result.disagreeing:
            self._misbehaving.setdefault(holder_at[x], set()).add(owner)
        return result.secret


def _pairwise_seed(private_key: bytes, peer_public_key: bytes, *, session: bytes) -> bytes:
    try:
        return derive_key(
            private_key, peer_public_key, session_id=session, info=KdfInfo.PAIRWISE_MASK_SEED
        )
    except CryptoError:
        raise ProtocolAbort(AbortReason.RECONSTRUCTION_FAILED, "key agreement failed") from None


def _matches_commitment(secret: bytes, *, commitment: bytes, session: bytes, owner: str) -> bool:
    expected = self_mask_commitment(secret, session_id=session, site_id=owner)
    return hmac.compare_digest(expected, commitment)


def _matches_public_key(secret: bytes, *, public_key: bytes) -> bool:
    try:
        return hmac.compare_digest(public_key_of(secret), public_key)
    except (CryptoError, ValidationError):
        return False
