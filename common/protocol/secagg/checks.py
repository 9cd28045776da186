"""The site's checks of SecAgg+ messages that need no client state, as pure functions:
the roster (`checked_roster`), the neighbours' encrypted shares (`open_shares`) and
the survivor list (`check_survivor_list`); each refuses with a `ProtocolAbort` naming
the reason (Bonawitz et al. 2017, sec. 4; Bell et al. 2020, sec. 3-4).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping

import numpy as np

from common.core.errors import (
    AbortReason,
    CryptoError,
    ProtocolAbort,
    ValidationError,
)
from common.crypto.aead import open_sealed, share_associated_data
from common.crypto.keyagreement import KEY_BYTES
from common.crypto.shamir import SHARE_BYTES
from common.protocol.secagg.graph import NeighbourGraph
from common.protocol.secagg.messages import (
    SHARE_PLAINTEXT_BYTES,
    ConsistencySignatures,
    Roster,
    RosterEntry,
    SharesForRecipient,
    SurvivorList,
)


def checked_roster(
    roster: Roster,
    *,
    participants: Container[str],
    site_id: str,
    keys: tuple[bytes, bytes],
    round_floor: int,
    threshold: int,
) -> dict[str, RosterEntry]:
    """The roster's entries by site id, refused (`ProtocolAbort`) when an entry is not an
    invited participant, appears twice or has keys of the wrong length, when this site
    (`site_id`, whose (encryption, masking) public `keys` these are) is missing or listed
    with other keys, or when the roster is smaller than `round_floor` or `threshold`."""
    entries: dict[str, RosterEntry] = {}
    for entry in roster.entries:
        if entry.site_id not in participants:
            raise ProtocolAbort(AbortReason.UNKNOWN_PEER, f"{entry.site_id!r} in roster")
        if entry.site_id in entries:
            raise ProtocolAbort(AbortReason.DUPLICATE_PEER, f"{entry.site_id!r} in roster")
        if (
            len(entry.encryption_public_key) != KEY_BYTES
            or len(entry.masking_public_key) != KEY_BYTES
        ):
            raise ProtocolAbort(AbortReason.WRONG_LENGTH, f"keys of {entry.site_id!r}")
        entries[entry.site_id] = entry
    mine = entries.get(site_id)
    if mine is None:
        raise ProtocolAbort(AbortReason.SELF_MISSING, "this site is not in the roster")
    if (mine.encryption_public_key, mine.masking_public_key) != keys:
        raise ProtocolAbort(AbortReason.KEY_MISMATCH, "roster has other keys for this site")
    if len(entries) < round_floor:
        raise ProtocolAbort(
            AbortReason.ROUND_TOO_SMALL,
            f"{len(entries)} sites in roster; this site needs at least {round_floor}",
        )
    if len(entries) < threshold:
        raise ProtocolAbort(
            AbortReason.TOO_FEW_PARTICIPANTS,
            f"{len(entries)} sites in roster, threshold is {threshold}",
        )
    return entries


def check_survivor_list(
    message: SurvivorList,
    *,
    roster: Container[str],
    site_id: str,
    neighbours: set[str],
    held: set[str],
    threshold: int,
    round_floor: int,
) -> None:
    """Refuse (`ProtocolAbort`) a survivor list that repeats or invents a site, lists this
    site (`site_id`) as dropped or not at all, lists a site both ways, disagrees with the
    `neighbours` whose shares this site `held`, or is smaller than `threshold` or
    `round_floor` (Bonawitz et al. 2017, sec. 4, ConsistencyCheck)."""
    survivors, dropped = message.survivors, message.dropped
    for listed in (survivors, dropped):
        if len(set(listed)) != len(listed):
            raise ProtocolAbort(AbortReason.DUPLICATE_PEER, "survivor list repeats a site")
        unknown = [site for site in listed if site not in roster]
        if unknown:
            raise ProtocolAbort(AbortReason.UNKNOWN_PEER, f"survivor list names {unknown}")
    if site_id in dropped:
        raise ProtocolAbort(AbortReason.SELF_LISTED_AS_DROPPED, "")
    both = set(survivors) & set(dropped)
    if both:
        raise ProtocolAbort(AbortReason.PEER_BOTH_ALIVE_AND_DROPPED, f"{sorted(both)}")
    if site_id not in survivors:
        raise ProtocolAbort(AbortReason.SELF_MISSING, "not listed as a survivor")
    listed_neighbours = (set(survivors) | set(dropped)) & neighbours
    if listed_neighbours != held:
        # Every neighbour whose shares we hold must be accounted for, and none
        # whose shares we lack may be: otherwise the coordinator could ask us about
        # a peer we did not mask against.
        raise ProtocolAbort(
            AbortReason.SURVIVORS_NOT_SUBSET,
            "survivor list disagrees with the neighbours that sent shares",
        )
    if len(survivors) < threshold:
        raise ProtocolAbort(AbortReason.TOO_FEW_PARTICIPANTS, f"{len(survivors)} survivors")
    if len(survivors) < round_floor:
        # Checked again on the authenticated survivors before Unmask; refusing to
        # sign already stops the round here.
        raise ProtocolAbort(
            AbortReason.SURVIVORS_BELOW_FLOOR,
            f"{len(survivors)} survivors; this site needs at least {round_floor}",
        )


def open_shares(
    message: SharesForRecipient,
    *,
    keys: Mapping[str, bytes],
    roster: Container[str],
    neighbours: Container[str],
    site_id: str,
    round_number: int,
    session_id: bytes,
) -> dict[str, tuple[bytes, bytes]]:
    """Each neighbour's (self-mask seed share, masking key share) for this site, decrypted
    with the pairwise share `keys` and bound to sender, recipient, round and session;
    `ProtocolAbort` for a share from a stranger, a non-neighbour or twice from one
    sender, one that does not decrypt, or one of the wrong length."""
    received: dict[str, tuple[bytes, bytes]] = {}
    for share in message.shares:
        sender = share.peer_site_id
        if sender not in roster:
            raise ProtocolAbort(AbortReason.UNKNOWN_PEER, f"share from {sender!r}")
        if sender not in neighbours:
            raise ProtocolAbort(AbortReason.NOT_A_NEIGHBOUR, f"share from {sender!r}")
        if sender in received:
            raise ProtocolAbort(AbortReason.DUPLICATE_PEER, f"second share from {sender!r}")
        key = keys[sender]
        try:
            plaintext = open_sealed(
                key,
                share.ciphertext,
                associated_data=share_associated_data(
                    sender=sender,
                    recipient=site_id,
                    round_number=round_number,
                    session_id=session_id,
                ),
            )
        except CryptoError:
            raise ProtocolAbort(
                AbortReason.DECRYPTION_FAILED, f"share from {sender!r}"
            ) from None
        if len(plaintext) != SHARE_PLAINTEXT_BYTES:
            raise ProtocolAbort(AbortReason.WRONG_LENGTH, f"share from {sender!r}")
        received[sender] = (plaintext[:SHARE_BYTES], plaintext[SHARE_BYTES:])
    return received




def relayed_signatures(
    message: ConsistencySignatures, *, roster: Container[str], alive: Container[str]
) -> dict[str, bytes]:
    """The relayed consistency signatures by signer; `ProtocolAbort` for a signer listed
    twice, one not in the roster, or one not among the `alive` survivors."""
    relayed: dict[str, bytes] = {}
    for signer, signature in message.signatures:
        if signer in relayed:
            raise ProtocolAbort(AbortReason.DUPLICATE_PEER, f"two signatures by {signer!r}")
        if signer not in roster:
            raise ProtocolAbort(AbortReason.UNKNOWN_PEER, f"signature by {signer!r}")
        if signer not in alive:
            raise ProtocolAbort(
                AbortReason.INCONSISTENT_SURVIVOR_SETS, f"{signer!r} signed but is not alive"
            )
        relayed[signer] = signature
    return relayed


def check_neighbourhood_quorum(
    owners: Iterable[str], *, signers: set[str], graph: NeighbourGraph, threshold: int
) -> None:
    """SecAgg+ quorum: the t confirmations must come from each owner's own closed
    neighbourhood, the only sites holding its shares; otherwise two halves of a large
    federation could be told two stories about the same owner."""
    for owner in owners:
        closed = {owner, *graph[owner]}
        if len(signers & closed) < threshold:
            raise ProtocolAbort(
                AbortReason.INCONSISTENT_SURVIVOR_SETS,
                f"fewer than t confirmations in the neighbourhood of {owner!r}",
            )


def check_input_vector(vector: np.ndarray, *, length: int) -> None:
    """ValidationError unless `vector` is a writeable, contiguous uint32 vector of
    `length` (it is masked in place)."""
    if (
        not isinstance(vector, np.ndarray)
        or vector.dtype != np.uint32
        or vector.shape != (length,)
        or not vector.flags.c_contiguous
        or not vector.flags.writeable
    ):
        raise ValidationError(
            f"input must be a writeable contiguous uint32 vector of length {length}"
        )
