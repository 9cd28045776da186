"""Typed SecAgg+ protocol messages, mirroring protos/medfed/v1/federation.proto.

The state machines in client.py / server.py speak only these frozen dataclasses; the
networked layers translate protobuf <-> dataclass. Round, nonce and session id travel
in the protobuf envelopes and are checked there; what matters for security is that
they are bound into every signature and AEAD associated data built below.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

import numpy as np

from common.crypto.aead import NONCE_BYTES, TAG_BYTES
from common.crypto.encoding import encode_fields
from common.crypto.shamir import SHARE_BYTES
from common.protocol.secagg.params import NO_ANNOUNCEMENT_DIGEST, SecAggParams

ADVERTISE_LABEL = "medfed/v1/advertise"
SURVIVORS_LABEL = "medfed/v1/survivors"
SELF_MASK_COMMITMENT_LABEL = "medfed/v1/self-mask-commitment"
COMMITMENT_BYTES = 32  # SHA-256
SHARE_PLAINTEXT_BYTES = 2 * SHARE_BYTES  # self-mask seed share || masking key share
CIPHERTEXT_BYTES = NONCE_BYTES + SHARE_PLAINTEXT_BYTES + TAG_BYTES
"""Length of every `EncryptedShare.ciphertext`: one sealed share pair."""


class ShareKind(enum.Enum):
    """Which secret a revealed share belongs to (proto RevealedShare.Kind numbers)."""

    SELF_MASK_SEED = 1  # owner survived: share of its self-mask seed b_u
    MASKING_KEY = 2  # owner dropped: share of its mask-agreement private key


@dataclass(frozen=True)
class AdvertiseKeys:
    """Phase 1, site -> coordinator: two fresh X25519 public keys, signed."""

    site_id: str
    encryption_public_key: bytes
    masking_public_key: bytes
    signature: bytes


@dataclass(frozen=True)
class RosterEntry:
    """One site's advertisement as relayed by the coordinator, with its certificate."""

    site_id: str
    encryption_public_key: bytes
    masking_public_key: bytes
    signature: bytes
    certificate_der: bytes


@dataclass(frozen=True)
class Roster:
    """Phase 1, coordinator -> every site: all accepted advertisements, sorted by site."""

    entries: tuple[RosterEntry, ...]


@dataclass(frozen=True)
class EncryptedShare:
    """AEAD(nonce || ct || tag) of one (self-mask seed share, mask key share) pair.

    `peer_site_id` is the recipient in ShareKeysOut and the sender in SharesForRecipient.
    """

    peer_site_id: str
    ciphertext: bytes


@dataclass(frozen=True)
class ShareKeysOut:
    """Phase 2, site -> coordinator: one encrypted share pair per neighbour, and the
    commitment to the self-mask seed b_u (see `self_mask_commitment`)."""

    shares: tuple[EncryptedShare, ...]
    self_mask_commitment: bytes


@dataclass(frozen=True)
class SharesForRecipient:
    """Phase 2, coordinator -> site: the share pairs its neighbours addressed to it."""

    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True, eq=False)
class MaskedInput:
    """Phase 3, site -> coordinator: the masked uint32 ring vector."""

    vector: np.ndarray


@dataclass(frozen=True)
class SurvivorList:
    """Phase 3 result: sites whose masked input arrived, and those that sent shares but
    no masked input. Both sorted."""

    survivors: tuple[str, ...]
    dropped: tuple[str, ...]


@dataclass(frozen=True)
class ConsistencySignature:
    """Phase 4, site -> coordinator: signature over the survivor list it was shown."""

    signature: bytes


@dataclass(frozen=True)
class ConsistencySignatures:
    """Phase 4, coordinator -> sites: every (site_id, signature) it collected."""

    signatures: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True)
class RevealedShare:
    """One Shamir y-value of `owner_site_id`'s secret of the given kind."""

    owner_site_id: str
    kind: ShareKind
    share: bytes


@dataclass(frozen=True)
class UnmaskShares:
    """Phase 5, site -> coordinator: the shares the survivor list entitles it to reveal."""

    shares: tuple[RevealedShare, ...]


Message = (
    Roster
    | SharesForRecipient
    | SurvivorList
    | ConsistencySignatures
    | AdvertiseKeys
    | ShareKeysOut
    | MaskedInput
    | ConsistencySignature
    | UnmaskShares
)


def advertise_message(
    *,
    round_number: int,
    round_nonce: bytes,
    site_id: str,
    encryption_public_key: bytes,
    masking_public_key: bytes,
    announcement_digest: bytes = NO_ANNOUNCEMENT_DIGEST,
) -> bytes:
    """What a site signs in AdvertiseKeys.

    Round and nonce stop cross-round replay; the announcement digest makes the
    signature say "these keys are for the round I was told about": a neighbour told
    another story fails to verify it at the roster. Pass
    `params.announcement_digest`; the default is the all-zero placeholder.
    """
    return encode_fields(
        ADVERTISE_LABEL,
        round_number,
        round_nonce,
        announcement_digest,
        site_id,
        encryption_public_key,
        masking_public_key,
    )


def advertisement_to_sign(
    params: SecAggParams, *, site_id: str, encryption_public_key: bytes,
    masking_public_key: bytes,
) -> bytes:
    """`advertise_message` for this round: what `site_id` signs (and every verifier
    checks) for these two public keys."""
    return advertise_message(
        round_number=params.round_number,
        round_nonce=params.round_nonce,
        site_id=site_id,
        encryption_public_key=encryption_public_key,
        masking_public_key=masking_public_key,
        announcement_digest=params.announcement_digest,
    )


def survivors_message(
    *,
    round_number: int,
    session_id: bytes,
    survivors: tuple[str, ...],
    dropped: tuple[str, ...],
) -> bytes:
    """What a site signs in the consistency check.

    The two list lengths are encoded before each list, so ((a, b), ()) and ((a,), (b,))
    can never encode alike, whatever characters site ids contain (injective).
    """
    return encode_fields(
        SURVIVORS_LABEL,
        round_number,
        session_id,
        len(survivors),
        *survivors,
        len(dropped),
        *dropped,
    )


def survivor_list_to_sign(
    listing: SurvivorList, *, round_number: int, session_id: bytes
) -> bytes:
    """`survivors_message` for this list: what every survivor signs in the consistency
    check (and every verifier checks)."""
    return survivors_message(
        round_number=round_number,
        session_id=session_id,
        survivors=listing.survivors,
        dropped=listing.dropped,
    )


def self_mask_commitment(seed: bytes, *, session_id: bytes, site_id: str) -> bytes:
    """SHA-256(encode("medfed/v1/self-mask-commitment", session id, site id, b_u)).

    Lets the coordinator check a b_u rebuilt from Shamir shares at Unmask: a wrong
    share then changes the secret and fails the check instead of silently corrupting
    the sum. Hiding because b_u is a fresh uniform 256-bit secret (SHA-256 as a random
    oracle); binding by collision resistance; the session id and site id stop a
    commitment being replayed in another round or for another site.
    """
    return hashlib.sha256(
        encode_fields(SELF_MASK_COMMITMENT_LABEL, session_id, site_id, seed)
    ).digest()
