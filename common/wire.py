"""protobuf <-> dataclass translation with validation at the trust boundary.

Both services use these functions, so a message is checked the same way whichever
side reads it: every string, byte field and list is bounded before anything else
looks at it. Problems raise `ValidationError` (gRPC INVALID_ARGUMENT).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from common.codec import TensorSpec
from common.errors import ValidationError
from common.proto.medfed.v1 import federation_pb2 as pb
from common.secagg import messages as sm

SITE_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
MAX_SITES = 10_000
MAX_SIGNATURE_BYTES = 160  # DER ECDSA P-256 is <= 72, Ed25519 is 64
MAX_CERTIFICATE_BYTES = 16 * 1024
MAX_CIPHERTEXT_BYTES = 512
MAX_SHARE_BYTES = 128
X25519_KEY_BYTES = 32
SESSION_ID_BYTES = 32
COMMITMENT_BYTES = sm.COMMITMENT_BYTES
MAX_TENSORS = 10_000


def site_id(value: str, what: str = "site id") -> str:
    if not isinstance(value, str) or not SITE_ID_RE.match(value):
        raise ValidationError(f"{what}: invalid site id {value[:80]!r}")
    return value


def site_ids(values: Iterable[str], what: str) -> tuple[str, ...]:
    out = tuple(values)
    if len(out) > MAX_SITES:
        raise ValidationError(f"{what}: too many entries")
    return tuple(site_id(v, what) for v in out)


def bounded(value: bytes, *, what: str, exact: int | None = None, maximum: int = 0) -> bytes:
    if exact is not None and len(value) != exact:
        raise ValidationError(f"{what}: expected {exact} bytes, got {len(value)}")
    if maximum and len(value) > maximum:
        raise ValidationError(f"{what}: longer than {maximum} bytes")
    return bytes(value)


def session_id(value: bytes) -> bytes:
    return bounded(value, what="session_id", exact=SESSION_ID_BYTES)


# ---------------------------------------------------------------- layouts


def layout_to_pb(layout: Sequence[TensorSpec]) -> list[pb.TensorSpec]:
    return [pb.TensorSpec(name=s.name, dtype=s.dtype, shape=list(s.shape)) for s in layout]


def layout_from_pb(specs: Sequence[pb.TensorSpec]) -> tuple[TensorSpec, ...]:
    if len(specs) > MAX_TENSORS:
        raise ValidationError("model layout has too many tensors")
    return tuple(TensorSpec(s.name, s.dtype, tuple(int(d) for d in s.shape)) for s in specs)


# ---------------------------------------------------------------- phase 1


def advertise_from_pb(req: pb.AdvertiseKeysRequest, *, caller: str) -> sm.AdvertiseKeys:
    return sm.AdvertiseKeys(
        site_id=caller,
        encryption_public_key=bounded(
            req.encryption_public_key, what="encryption_public_key", exact=X25519_KEY_BYTES
        ),
        masking_public_key=bounded(
            req.masking_public_key, what="masking_public_key", exact=X25519_KEY_BYTES
        ),
        signature=bounded(req.signature, what="signature", maximum=MAX_SIGNATURE_BYTES),
    )


def advertise_to_pb(msg: sm.AdvertiseKeys, *, round_number: int, nonce: bytes) -> (
    pb.AdvertiseKeysRequest
):
    return pb.AdvertiseKeysRequest(
        round=round_number,
        round_nonce=nonce,
        encryption_public_key=msg.encryption_public_key,
        masking_public_key=msg.masking_public_key,
        signature=msg.signature,
    )


def roster_to_pb(roster: sm.Roster) -> pb.AdvertiseKeysResponse:
    return pb.AdvertiseKeysResponse(
        roster=[
            pb.RosterEntry(
                site_id=e.site_id,
                encryption_public_key=e.encryption_public_key,
                masking_public_key=e.masking_public_key,
                signature=e.signature,
                certificate_der=e.certificate_der,
            )
            for e in roster.entries
        ]
    )


def roster_from_pb(resp: pb.AdvertiseKeysResponse) -> sm.Roster:
    if len(resp.roster) > MAX_SITES:
        raise ValidationError("roster: too many entries")
    return sm.Roster(
        entries=tuple(
            sm.RosterEntry(
                site_id=site_id(e.site_id, "roster"),
                encryption_public_key=bounded(
                    e.encryption_public_key, what="roster key", exact=X25519_KEY_BYTES
                ),
                masking_public_key=bounded(
                    e.masking_public_key, what="roster key", exact=X25519_KEY_BYTES
                ),
                signature=bounded(
                    e.signature, what="roster signature", maximum=MAX_SIGNATURE_BYTES
                ),
                certificate_der=bounded(
                    e.certificate_der, what="roster certificate", maximum=MAX_CERTIFICATE_BYTES
                ),
            )
            for e in resp.roster
        )
    )


# ---------------------------------------------------------------- phase 2


def _shares(items: Sequence[pb.EncryptedShare], what: str) -> tuple[sm.EncryptedShare, ...]:
    if len(items) > MAX_SITES:
        raise ValidationError(f"{what}: too many shares")
    return tuple(
        sm.EncryptedShare(
            peer_site_id=site_id(s.peer_site_id, what),
            ciphertext=bounded(
                s.ciphertext, what=f"{what} ciphertext", maximum=MAX_CIPHERTEXT_BYTES
            ),
        )
        for s in items
    )


def _shares_to_pb(shares: Sequence[sm.EncryptedShare]) -> list[pb.EncryptedShare]:
    return [pb.EncryptedShare(peer_site_id=s.peer_site_id, ciphertext=s.ciphertext) for s in shares]


def share_keys_from_pb(req: pb.ShareKeysRequest) -> sm.ShareKeysOut:
    return sm.ShareKeysOut(
        shares=_shares(req.shares, "shares"),
        self_mask_commitment=bounded(
            req.self_mask_commitment, what="self_mask_commitment", exact=COMMITMENT_BYTES
        ),
    )


def share_keys_to_pb(msg: sm.ShareKeysOut, *, round_number: int, session: bytes) -> (
    pb.ShareKeysRequest
):
    return pb.ShareKeysRequest(
        round=round_number,
        session_id=session,
        shares=_shares_to_pb(msg.shares),
        self_mask_commitment=msg.self_mask_commitment,
    )


def shares_for_recipient_to_pb(msg: sm.SharesForRecipient) -> pb.ShareKeysResponse:
    return pb.ShareKeysResponse(shares=_shares_to_pb(msg.shares))


def shares_for_recipient_from_pb(resp: pb.ShareKeysResponse) -> sm.SharesForRecipient:
    return sm.SharesForRecipient(shares=_shares(resp.shares, "received shares"))


# ---------------------------------------------------------------- phase 3/4


def survivors_to_pb(msg: sm.SurvivorList) -> pb.MaskedInputResponse:
    return pb.MaskedInputResponse(survivors=list(msg.survivors), dropped=list(msg.dropped))


def survivors_from_pb(resp: pb.MaskedInputResponse) -> sm.SurvivorList:
    return sm.SurvivorList(
        survivors=site_ids(resp.survivors, "survivors"),
        dropped=site_ids(resp.dropped, "dropped"),
    )


def consistency_from_pb(req: pb.ConsistencyCheckRequest) -> sm.ConsistencySignature:
    return sm.ConsistencySignature(
        signature=bounded(req.signature, what="signature", maximum=MAX_SIGNATURE_BYTES)
    )


def signatures_to_pb(msg: sm.ConsistencySignatures) -> pb.ConsistencyCheckResponse:
    return pb.ConsistencyCheckResponse(
        signatures=[pb.SurvivorSignature(site_id=s, signature=sig) for s, sig in msg.signatures]
    )


def signatures_from_pb(resp: pb.ConsistencyCheckResponse) -> sm.ConsistencySignatures:
    if len(resp.signatures) > MAX_SITES:
        raise ValidationError("signatures: too many entries")
    return sm.ConsistencySignatures(
        signatures=tuple(
            (
                site_id(s.site_id, "signatures"),
                bounded(s.signature, what="signature", maximum=MAX_SIGNATURE_BYTES),
            )
            for s in resp.signatures
        )
    )


# ---------------------------------------------------------------- phase 5

_KIND_FROM_PB = {
    pb.RevealedShare.SELF_MASK_SEED: sm.ShareKind.SELF_MASK_SEED,
    pb.RevealedShare.MASKING_KEY: sm.ShareKind.MASKING_KEY,
}
_KIND_TO_PB = {v: k for k, v in _KIND_FROM_PB.items()}


def unmask_from_pb(req: pb.UnmaskRequest) -> sm.UnmaskShares:
    if len(req.shares) > MAX_SITES:
        raise ValidationError("unmask: too many shares")
    shares = []
    for s in req.shares:
        kind = _KIND_FROM_PB.get(s.kind)
        if kind is None:
            raise ValidationError(f"unmask: unknown share kind {s.kind}")
        shares.append(
            sm.RevealedShare(
                owner_site_id=site_id(s.owner_site_id, "unmask owner"),
                kind=kind,
                share=bounded(s.share, what="unmask share", maximum=MAX_SHARE_BYTES),
            )
        )
    return sm.UnmaskShares(shares=tuple(shares))


def unmask_to_pb(msg: sm.UnmaskShares, *, round_number: int, session: bytes) -> pb.UnmaskRequest:
    return pb.UnmaskRequest(
        round=round_number,
        session_id=session,
        shares=[
            pb.RevealedShare(owner_site_id=s.owner_site_id, kind=_KIND_TO_PB[s.kind], share=s.share)
            for s in msg.shares
        ],
    )
