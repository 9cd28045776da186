"""A SecAgg+ site's secrets and masks, as pure functions over its round state.

Bonawitz et al. 2017 (CCS), sec. 4, Rounds 1-2, over SecAgg+ neighbourhoods (Bell et al.
2020, CCS, sec. 3-4):

* ShareKeys (`deal_secrets`, `encrypted_shares`): a fresh self-mask seed b_u and the
  masking secret key s_u^SK are Shamir-shared with threshold t among u's closed
  neighbourhood; each neighbour's share pair is sealed under the AEAD key u agrees with
  it, and u commits to b_u for the coordinator's check at Unmask.
* MaskedInput (`mask_input`):
      y_u = x_u + PRG(b_u) + sum_{v in N(u) alive, u < v} PRG(s_uv)
                           - sum_{v in N(u) alive, u > v} PRG(s_uv)   (mod 2^32)
  optionally from masks expanded before the input existed (`prepared_mask`), with the
  neighbours whose shares never came taken out again: bit for bit the same vector.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from common.core.errors import AbortReason, CryptoError, ProtocolAbort
from common.crypto.aead import seal, share_associated_data
from common.crypto.kdf import KdfInfo, hkdf_sha256
from common.crypto.keyagreement import derive_key
from common.crypto.prg import apply_masks
from common.crypto.random import RandomSource
from common.crypto.shamir import SECRET_BYTES, split_secrets
from common.protocol.secagg.messages import EncryptedShare, ShareKeysOut, self_mask_commitment
from common.protocol.secagg.params import SecAggParams
from common.protocol.secagg.roster import RoundRoster


def self_mask_seed(seed: bytes, *, session: bytes) -> bytes:
    """PRG seed of the self mask: HKDF(b_u, salt=session id, info=SELF_MASK_SEED)."""
    return hkdf_sha256(seed, salt=session, info=KdfInfo.SELF_MASK_SEED.value)


def agree(private_key: bytes, peer_public_key: bytes, *, session_id: bytes,
          info: KdfInfo) -> bytes:
    """The key u agrees with a peer for `info` in this session; a failed agreement
    aborts the round."""
    try:
        return derive_key(private_key, peer_public_key, session_id=session_id, info=info)
    except CryptoError:
        # A low-order public key (only a malicious, yet validly signing, peer can
        # send one) makes the agreed secret predictable: refuse the round.
        raise ProtocolAbort(AbortReason.DECRYPTION_FAILED, "key agreement failed") from None


def encrypted_shares(
    secrets: Sequence[bytes],
    *,
    site_id: str,
    holders: Sequence[str],
    xs: Mapping[str, int],
    encryption_private_key: bytes,
    encryption_public_keys: Mapping[str, bytes],
    threshold: int,
    round_number: int,
    session_id: bytes,
    rng: RandomSource,
) -> tuple[tuple[bytes, ...], dict[str, bytes], list[EncryptedShare]]:
    """Shamir-share `secrets` (b_u, s_u^SK) among `holders` (u and its neighbours, at
    their evaluation points `xs`): (u's own shares, the AEAD key agreed with each
    neighbour, each neighbour's sealed shares)."""
    shares = split_secrets(list(secrets), threshold=threshold,
                           xs=[xs[holder] for holder in holders], rng=rng)
    own: tuple[bytes, ...] = ()
    keys: dict[str, bytes] = {}
    out: list[EncryptedShare] = []
    for holder, held in zip(holders, shares):
        if holder == site_id:
            own = tuple(held)
            continue
        key = agree(encryption_private_key, encryption_public_keys[holder],
                    session_id=session_id, info=KdfInfo.SHARE_ENCRYPTION_KEY)
        # The same key decrypts what this neighbour sends us (derive_key is
        # symmetric): kept rather than redoing the X25519 + HKDF next phase.
        keys[holder] = key
        associated = share_associated_data(sender=site_id, recipient=holder,
                                           round_number=round_number, session_id=session_id)
        out.append(EncryptedShare(
            peer_site_id=holder,
            ciphertext=seal(key, b"".join(held), associated_data=associated, rng=rng),
        ))
    return own, keys, out


@dataclass(frozen=True)
class DealtSecrets:
    """What a site keeps from ShareKeys, and the message it sends."""

    own_shares: tuple[bytes, bytes]
    """Its own shares of its (b_u, s_u^SK): revealed at Unmask like a neighbour's."""
    share_keys: Mapping[str, bytes]
    """The AEAD key agreed with each neighbour (it opens their shares too)."""
    self_mask_seed: bytes
    """The PRG seed of its self mask, derived from b_u."""
    message: ShareKeysOut


def deal_secrets(
    params: SecAggParams,
    *,
    site_id: str,
    roster: RoundRoster,
    encryption_private_key: bytes,
    masking_private_key: bytes,
    rng: RandomSource,
) -> DealtSecrets:
    """Draw b_u, share it and `masking_private_key` among the closed neighbourhood of
    `site_id`, seal each neighbour's pair, and commit to b_u."""
    neighbours = roster.graph[site_id]
    seed = rng(SECRET_BYTES)
    own, keys, out = encrypted_shares(
        (seed, masking_private_key), site_id=site_id,
        holders=sorted((*neighbours, site_id)), xs=roster.points,
        encryption_private_key=encryption_private_key,
        encryption_public_keys={h: roster.entries[h].encryption_public_key for h in neighbours},
        threshold=params.threshold, round_number=params.round_number,
        session_id=roster.session_id, rng=rng,
    )
    commitment = self_mask_commitment(seed, session_id=roster.session_id, site_id=site_id)
    return DealtSecrets(
        own_shares=(own[0], own[1]),
        share_keys=keys,
        self_mask_seed=self_mask_seed(seed, session=roster.session_id),
        message=ShareKeysOut(shares=tuple(out), self_mask_commitment=commitment),
    )


def signed_seeds(site_id: str, seeds: Mapping[str, bytes], peers: Sequence[str]) -> tuple[
    list[bytes], list[bytes]
]:
    """(add, subtract): +PRG(s_uv) where u < v, -PRG(s_uv) where u > v."""
    add = [seeds[peer] for peer in peers if site_id < peer]
    return add, [seeds[peer] for peer in peers if site_id > peer]


def prepared_mask(site_id: str, *, self_mask_seed: bytes, seeds: Mapping[str, bytes],
                  vector_length: int) -> np.ndarray:
    """PRG(b_u) +/- PRG(s_uv) for every neighbour v in `seeds`, as if all send shares."""
    mask = np.zeros(vector_length, dtype=np.uint32)
    add, subtract = signed_seeds(site_id, seeds, list(seeds))
    apply_masks(mask, add=[self_mask_seed, *add], subtract=subtract)
    return mask


def mask_input(
    input_vector: np.ndarray,
    *,
    site_id: str,
    self_mask_seed: bytes,
    seeds: Mapping[str, bytes],
    received: Collection[str],
    premask: np.ndarray | None,
    premasked: Mapping[str, bytes],
) -> None:
    """Mask `input_vector` IN PLACE with the self mask and the pairwise masks of the
    neighbours in `received` (`seeds`: their agreed seeds). With a `premask` (covering
    the self mask and the neighbours in `premasked`) it is added instead, then the
    alive neighbours left out there, and the neighbours that sent no shares are taken
    out (opposite signs)."""
    alive = sorted(received)
    if premask is None:
        add, subtract = signed_seeds(site_id, seeds, alive)
        apply_masks(input_vector, add=[self_mask_seed, *add], subtract=subtract)
        return
    np.add(input_vector, premask, out=input_vector)
    missing = [peer for peer in alive if peer not in premasked]
    gone = [peer for peer in sorted(premasked) if peer not in received]
    add, subtract = signed_seeds(site_id, seeds, missing)
    undo_add, undo_subtract = signed_seeds(site_id, premasked, gone)
    apply_masks(input_vector, add=[*add, *undo_subtract], subtract=[*subtract, *undo_add])
