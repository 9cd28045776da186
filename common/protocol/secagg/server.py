"""The coordinator side of SecAgg+ as a pure state machine (no I/O, no clock).

Bonawitz et al. 2017 (CCS), sec. 4 (Fig. 4), with SecAgg+ neighbourhoods of Bell et al.
2020 (CCS), sec. 3. The caller attributes every message to the site id taken from the
verified mTLS certificate. A bad message from one site (ValidationError, CryptoError, or
ProtocolAbort(UNEXPECTED_MESSAGE) when it arrives in the wrong phase) is refused for
that site only and leaves the round state unchanged; only the `close_*` methods can
abort the round, and then nothing is revealed.

Memory is O(d): masked vectors are added into one accumulator as they arrive, and the
masks are removed with the chunked PRG of common.crypto.prg.

Unmask is robust (common.protocol.secagg.reconstruction): each secret is accepted only if it
passes its check (the owner's ShareKeys commitment to b_u, or its advertised masking
public key) and every share beyond the first t is checked against the polynomial.
Wrong shares are corrected when enough right ones remain, and their holders are
reported in `misbehaving_sites`; otherwise the round aborts (RECONSTRUCTION_FAILED)
and no sum is returned. Never a silently wrong sum.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from functools import partial

import numpy as np

from common.core.errors import AbortReason, CryptoError, ProtocolAbort, ValidationError
from common.crypto.aead import NONCE_BYTES, TAG_BYTES
from common.crypto.kdf import KdfInfo
from common.crypto.keyagreement import KEY_BYTES, derive_key, public_key_of
from common.crypto.prg import apply_masks
from common.crypto.shamir import PRIME, SHARE_BYTES
from common.protocol.secagg.checks import SHARE_PLAINTEXT_BYTES
from common.protocol.secagg.client import IdentityVerifier, self_mask_seed
from common.protocol.secagg.graph import neighbourhoods
from common.protocol.secagg.messages import (
    COMMITMENT_BYTES,
    AdvertiseKeys,
    ConsistencySignature,
    ConsistencySignatures,
    EncryptedShare,
    MaskedInput,
    Roster,
    RosterEntry,
    ShareKeysOut,
    ShareKind,
    SharesForRecipient,
    SurvivorList,
    UnmaskShares,
    advertise_message,
    self_mask_commitment,
    survivors_message,
)
from common.protocol.secagg.params import SecAggParams
from common.protocol.secagg.phases import Phase, PhaseTracker
from common.protocol.secagg.reconstruction import SecretCheck, reconstruct_checked
from common.protocol.secagg.session import session_id as compute_session_id

CIPHERTEXT_BYTES = NONCE_BYTES + SHARE_PLAINTEXT_BYTES + TAG_BYTES


class SiteProgress(enum.IntEnum):
    """The last step a site completed in this round (ordered)."""

    INVITED = 0
    ADVERTISED = 1
    SHARED = 2
    MASKED = 3
    CONFIRMED = 4
    UNMASKED = 5


@dataclass
class SiteStatus:
    """Per-site view: how far it got, and in which phase it was declared dropped."""

    progress: SiteProgress = SiteProgress.INVITED
    dropped_in: Phase | None = None


class SecAggServer:
    """The coordinator's side of one SecAgg+ round."""

    def __init__(self, params: SecAggParams, *, identity: IdentityVerifier) -> None:
        self.params = params
        self._identity = identity
        self._tracker = PhaseTracker()
        self.status: dict[str, SiteStatus] = {site: SiteStatus() for site in params.participants}
        self._advertisements: dict[str, RosterEntry] = {}
        self._roster: dict[str, RosterEntry] = {}
        self._x: dict[str, int] = {}
        self._graph: dict[str, tuple[str, ...]] = {}
        self._session_id = b""
        self._outgoing_shares: dict[str, ShareKeysOut] = {}
        self._accumulator: np.ndarray | None = None
        self._poisoned = False
        self._masked: set[str] = set()
        self._survivor_list: SurvivorList | None = None
        self._survivor_message = b""
        self._signatures: dict[str, bytes] = {}
        self._revealed: dict[str, dict[str, int]] = {}  # holder -> owner -> share y
        self._misbehaving: dict[str, set[str]] = {}  # holder -> owners of its wrong shares

    # ----------------------------------------------------------------- properties
    @property
    def phase(self) -> Phase:
        return self._tracker.phase

    @property
    def session_id(self) -> bytes:
        return self._session_id

    @property
    def graph(self) -> Mapping[str, tuple[str, ...]]:
        return self._graph

    @property
    def misbehaving_sites(self) -> Mapping[str, tuple[str, ...]]:
        """Holder -> owners whose secrets it revealed wrong shares of at Unmask.

        Filled by `close_unmask` (also when it aborts) for the operator to act on; a
        wrong share was corrected, or the round aborted: it never reached the sum."""
        return {holder: tuple(sorted(owners)) for holder, owners in self._misbehaving.items()}

    @property
    def survivors(self) -> tuple[str, ...]:
        """Sites whose masked input is in the sum (empty before MaskedInput closes)."""
        return self._survivor_list.survivors if self._survivor_list else ()

    # ------------------------------------------------------- phase 1: AdvertiseKeys
    def receive_advertisement(
        self, site_id: str, message: AdvertiseKeys, *, certificate_der: bytes
    ) -> None:
        """Accept one site's signed keys; `certificate_der` is its verified TLS cert."""
        self._tracker.require(Phase.ADVERTISE_KEYS, "advertisement")
        _check_site(site_id, self.params.participants, "invited")
        if site_id in self._advertisements:
            raise ValidationError(f"{site_id!r} already advertised keys this round")
        if message.site_id != site_id:
            raise ValidationError("advertisement names another site than the caller")
        if (
            len(message.encryption_public_key) != KEY_BYTES
            or len(message.masking_public_key) != KEY_BYTES
        ):
            raise ValidationError("public keys must be 32 bytes")
        if message.encryption_public_key == message.masking_public_key:
            raise ValidationError("the two public keys must differ")
        self._identity(site_id, certificate_der).verify(
            advertise_message(
                round_number=self.params.round_number,
                round_nonce=self.params.round_nonce,
                site_id=site_id,
                encryption_public_key=message.encryption_public_key,
                masking_public_key=message.masking_public_key,
                announcement_digest=self.params.announcement_digest,
            ),
            message.signature,
        )
        self._advertisements[site_id] = RosterEntry(
            site_id=site_id,
            encryption_public_key=message.encryption_public_key,
            masking_public_key=message.masking_public_key,
            signature=message.signature,
            certificate_der=certificate_der,
        )
        self.status[site_id].progress = SiteProgress.ADVERTISED

    def close_advertise(self) -> Roster:
        """End phase 1: the roster of every valid advertisement, sorted by site id."""
        self._tracker.require(Phase.ADVERTISE_KEYS, "close_advertise")
        sites = sorted(self._advertisements)
        self._mark_dropped(set(self.params.participants) - set(sites), Phase.ADVERTISE_KEYS)
        self._require_quorum(len(sites), "sites advertised keys")
        self._roster = {site: self._advertisements[site] for site in sites}
        self._x = {site: index + 1 for index, site in enumerate(sites)}
        self._session_id = compute_session_id(self.params, self._roster.values())
        self._graph = neighbourhoods(self._session_id, sites, self.params.neighbours)
        self._tracker.advance(Phase.SHARE_KEYS)
        return Roster(entries=tuple(self._roster.values()))

    # ----------------------------------------------------------- phase 2: ShareKeys
    def receive_shares(self, site_id: str, message: ShareKeysOut) -> None:
        """Accept one encrypted share pair for each of the site's neighbours."""
        self._tracker.require(Phase.SHARE_KEYS, "shares")
        _check_site(site_id, self._roster, "in the roster")
        if site_id in self._outgoing_shares:
            raise ValidationError(f"{site_id!r} already sent its shares")
        recipients = [share.peer_site_id for share in message.shares]
        if sorted(recipients) != list(self._graph[site_id]):
            raise ValidationError("shares must go to each neighbour exactly once")
        if any(len(share.ciphertext) != CIPHERTEXT_BYTES for share in message.shares):
            raise ValidationError(f"share ciphertexts must be {CIPHERTEXT_BYTES} bytes")
        if len(message.self_mask_commitment) != COMMITMENT_BYTES:
            raise ValidationError(f"self-mask commitment must be {COMMITMENT_BYTES} bytes")
        self._outgoing_shares[site_id] = message
        self.status[site_id].progress = SiteProgress.SHARED

    def close_shares(self) -> dict[str, SharesForRecipient]:
        """End phase 2: route every share to its recipient (among sites that shared)."""
        self._tracker.require(Phase.SHARE_KEYS, "close_shares")
        senders = set(self._outgoing_shares)
        self._mark_dropped(set(self._roster) - senders, Phase.SHARE_KEYS)
        self._require_quorum(len(senders), "sites sent shares")
        inbox: dict[str, list[EncryptedShare]] = {site: [] for site in sorted(senders)}
        for sender in sorted(senders):
            for share in self._outgoing_shares[sender].shares:
                if share.peer_site_id in inbox:
                    inbox[share.peer_site_id].append(
                        EncryptedShare(peer_site_id=sender, ciphertext=share.ciphertext)
                    )
        self._accumulator = np.zeros(self.params.vector_length, dtype=np.uint32)
        self._tracker.advance(Phase.MASKED_INPUT)
        return {site: SharesForRecipient(shares=tuple(shares)) for site, shares in inbox.items()}

    # --------------------------------------------------------- phase 3: MaskedInput
    def receive_masked_input(self, site_id: str, vector: np.ndarray | MaskedInput) -> None:
        """Add one masked vector into the single accumulator (mod 2^32)."""
        self._tracker.require(Phase.MASKED_INPUT, "masked input")
        _check_site(site_id, self._outgoing_shares, "a site that sent shares")
        if site_id in self._masked:
            raise ValidationError(f"{site_id!r} already sent its masked input")
        array = vector.vector if isinstance(vector, MaskedInput) else vector
        if (
            not isinstance(array, np.ndarray)
            or array.dtype != np.uint32
            or array.shape != (self.params.vector_length,)
        ):
            raise ValidationError(
                f"masked input must be a uint32 vector of length {self.params.vector_length}"
            )
        accumulator = self._require_accumulator()
        np.add(accumulator, array, out=accumulator)  # wraps modulo 2^32
        self._masked.add(site_id)
        self.status[site_id].progress = SiteProgress.MASKED

    def receive_masked_input_windows(
        self, site_id: str, windows: Iterable[np.ndarray]
    ) -> None:
        """As `receive_masked_input`, for a vector delivered in consecutive windows (the
        coordinator stages very large uploads on disk, not in memory).

        The windows must cover exactly `vector_length` elements. If they do not, or the
        iterator fails part-way, the accumulator already holds part of the vector and
        cannot be repaired: the round is poisoned and `close_masked_input` aborts it
        (nothing is ever unmasked from a corrupted sum).
        """
        self._tracker.require(Phase.MASKED_INPUT, "masked input")
        _check_site(site_id, self._outgoing_shares, "a site that sent shares")
        if site_id in self._masked:
            raise ValidationError(f"{site_id!r} already sent its masked input")
        accumulator = self._require_accumulator()
        position = 0
        try:
            for window in windows:
                end = position + window.size
                if window.dtype != np.uint32 or window.ndim != 1 or end > accumulator.size:
                    raise ValidationError("masked input window does not fit the vector")
                part = accumulator[position:end]
                np.add(part, window, out=part)  # wraps modulo 2^32
                position = end
            if position != accumulator.size:
                raise ValidationError("masked input windows do not cover the vector")
        except BaseException:
            if position:
                self._poisoned = True
            raise
        self._masked.add(site_id)
        self.status[site_id].progress = SiteProgress.MASKED

    def close_masked_input(self) -> SurvivorList:
        """End phase 3: survivors (masked input in the sum) and dropped (shares only)."""
        self._tracker.require(Phase.MASKED_INPUT, "close_masked_input")
        self._require_accumulator()  # aborts if a windowed input was added only in part
        dropped = set(self._outgoing_shares) - self._masked
        self._mark_dropped(dropped, Phase.MASKED_INPUT)
        self._require_quorum(len(self._masked), "sites sent masked input")
        self._survivor_list = SurvivorList(
            survivors=tuple(sorted(self._masked)), dropped=tuple(sorted(dropped))
        )
        self._survivor_message = survivors_message(
            round_number=self.params.round_number,
            session_id=self._session_id,
            survivors=self._survivor_list.survivors,
            dropped=self._survivor_list.dropped,
        )
        self._tracker.advance(Phase.CONSISTENCY_CHECK)
        return self._survivor_list

    # ---------------------------------------------------- phase 4: ConsistencyCheck
    def receive_consistency(self, site_id: str, message: ConsistencySignature) -> None:
        """Accept a survivor's signature over the survivor list (verified here)."""
        self._tracker.require(Phase.CONSISTENCY_CHECK, "consistency signature")
        _check_site(site_id, self._masked, "a survivor")
        if site_id in self._signatures:
            raise ValidationError(f"{site_id!r} already signed the survivor list")
        self._identity(site_id, self._roster[site_id].certificate_der).verify(
            self._survivor_message, message.signature
        )
        self._signatures[site_id] = message.signature
        self.status[site_id].progress = SiteProgress.CONFIRMED

    def close_consistency(self) -> ConsistencySignatures:
        """End phase 4: relay every signature so sites can cross-check the list."""
        self._tracker.require(Phase.CONSISTENCY_CHECK, "close_consistency")
        signers = set(self._signatures)
        self._mark_dropped(self._masked - signers, Phase.CONSISTENCY_CHECK)
        self._require_quorum(len(signers), "survivors signed the survivor list")
        survivor_list = self._require_survivor_list()
        for owner in (*survivor_list.survivors, *survivor_list.dropped):
            closed = {owner, *self._graph[owner]}
            # Sites apply the same neighbourhood quorum; failing early saves a phase.
            if len(signers & closed) < self.params.threshold:
                self._tracker.abort()
                raise ProtocolAbort(
                    AbortReason.TOO_FEW_PARTICIPANTS,
                    f"fewer than t confirmations around {owner!r}",
                )
        self._tracker.advance(Phase.UNMASK)
        return ConsistencySignatures(signatures=tuple(sorted(self._signatures.items())))

    # -------------------------------------------------------------- phase 5: Unmask
    def receive_unmask(self, site_id: str, message: UnmaskShares) -> None:
        """Accept one survivor's revealed shares, all checked before any is stored."""
        self._tracker.require(Phase.UNMASK, "unmask shares")
        _check_site(site_id, self._signatures, "a site that confirmed the survivors")
        if site_id in self._revealed:
            raise ValidationError(f"{site_id!r} already sent its unmask shares")
        survivor_list = self._require_survivor_list()
        alive, dropped = set(survivor_list.survivors), set(survivor_list.dropped)
        closed = {site_id, *self._graph[site_id]}
        accepted: dict[str, int] = {}
        for revealed in message.shares:
            owner = revealed.owner_site_id
            if owner not in closed:
                raise ValidationError(f"{site_id!r} holds no share of {owner!r}")
            if owner in accepted:
                raise ValidationError(f"two shares of {owner!r}")
            expected = (
                ShareKind.SELF_MASK_SEED
                if owner in alive
                else ShareKind.MASKING_KEY
                if owner in dropped
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
        self.status[site_id].progress = SiteProgress.UNMASKED

    def close_unmask(self) -> np.ndarray:
        """Reconstruct the needed secrets, strip every mask, return the ring sum.

        sum_{u in U3} x_u = sum y_u - sum_{u in U3} PRG(b_u)
                            -/+ sum_{u dropped, v in N(u) & U3} PRG(s_uv)
        If any needed secret has fewer than t shares, or no t-subset of its shares
        yields a secret that passes its check, the round aborts and nothing (not even a
        partial sum) is returned. Holders of wrong shares land in `misbehaving_sites`.
        """
        self._tracker.require(Phase.UNMASK, "close_unmask")
        survivor_list = self._require_survivor_list()
        needed = [(owner, ShareKind.SELF_MASK_SEED) for owner in survivor_list.survivors] + [
            (owner, ShareKind.MASKING_KEY) for owner in survivor_list.dropped
        ]
        holders_of: dict[str, list[str]] = {owner: [] for owner, _ in needed}
        for holder in sorted(self._revealed):
            for owner in self._revealed[holder]:
                holders_of[owner].append(holder)
        threshold = self.params.threshold
        short = [owner for owner, holders in holders_of.items() if len(holders) < threshold]
        if short:
            self.abort()
            raise ProtocolAbort(
                AbortReason.RECONSTRUCTION_FAILED, f"fewer than t shares for {short}"
            )
        add: list[bytes] = []
        subtract: list[bytes] = []
        survivors = set(survivor_list.survivors)
        for owner, kind in needed:
            secret = self._reconstruct(owner, kind, holders_of[owner])
            if kind is ShareKind.SELF_MASK_SEED:
                subtract.append(self_mask_seed(secret, session=self._session_id))
                continue
            for peer in self._graph[owner]:
                if peer not in survivors:
                    continue
                seed = self._derive(secret, self._roster[peer].masking_public_key)
                # The survivor `peer` added +PRG(s) if peer < owner, else -PRG(s).
                (subtract if peer < owner else add).append(seed)
        accumulator = self._require_accumulator()
        apply_masks(accumulator, add=add, subtract=subtract)
        self._tracker.advance(Phase.COMPLETED)
        return accumulator

    def abort(self) -> None:
        """Abandon the round (e.g. coordinator shutdown); nothing more is revealed."""
        self._tracker.abort()
        self._accumulator = None

    # ------------------------------------------------------------------- helpers
    def _reconstruct(self, owner: str, kind: ShareKind, holders: list[str]) -> bytes:
        """The owner's secret of `kind`, checked and error-corrected (see module doc)."""
        check: SecretCheck
        if kind is ShareKind.SELF_MASK_SEED:
            commitment = self._outgoing_shares[owner].self_mask_commitment
            check = partial(
                _matches_commitment, commitment=commitment, session=self._session_id, owner=owner
            )
        else:
            check = partial(
                _matches_public_key, public_key=self._roster[owner].masking_public_key
            )
        holder_at = {self._x[holder]: holder for holder in holders}
        try:
            result = reconstruct_checked(
                [self._x[holder] for holder in holders],
                [self._revealed[holder][owner] for holder in holders],
                threshold=self.params.threshold,
                check=check,
            )
        except (CryptoError, ValidationError):
            self.abort()
            raise ProtocolAbort(
                AbortReason.RECONSTRUCTION_FAILED,
                f"no {self.params.threshold} shares of {owner!r} yield its committed "
                f"{kind.name.lower()} (wrong shares from too many holders, or {owner!r} "
                "committed to another value)",
            ) from None
        for x in result.disagreeing:
            self._misbehaving.setdefault(holder_at[x], set()).add(owner)
        return result.secret

    def _derive(self, private_key: bytes, peer_public_key: bytes) -> bytes:
        try:
            return derive_key(
                private_key,
                peer_public_key,
                session_id=self._session_id,
                info=KdfInfo.PAIRWISE_MASK_SEED,
            )
        except CryptoError:
            self.abort()
            raise ProtocolAbort(AbortReason.RECONSTRUCTION_FAILED, "key agreement failed") from None

    def _mark_dropped(self, sites: set[str], phase: Phase) -> None:
        """Record dropouts for the per-site status. A site that misses the consistency
        check or unmasking stays in the sum: its masked input already arrived."""
        for site in sites:
            status = self.status[site]
            if status.dropped_in is None:
                status.dropped_in = phase

    def _require_quorum(self, count: int, what: str) -> None:
        if count < self.params.threshold:
            self._tracker.abort()
            self._accumulator = None
            raise ProtocolAbort(
                AbortReason.TOO_FEW_PARTICIPANTS,
                f"only {count} {what}; threshold is {self.params.threshold}",
            )

    def _require_accumulator(self) -> np.ndarray:
        if self._accumulator is None:
            raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "no accumulator")
        if self._poisoned:
            self._accumulator = None
            raise ProtocolAbort(
                AbortReason.RECONSTRUCTION_FAILED, "a masked input was added only in part"
            )
        return self._accumulator

    def _require_survivor_list(self) -> SurvivorList:
        if self._survivor_list is None:
            raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "no survivor list yet")
        return self._survivor_list


def _check_site(site_id: str, allowed: Container[str], what: str) -> None:
    """ValidationError unless `site_id` is one of `allowed` (`what` names the set)."""
    if not isinstance(site_id, str) or site_id not in allowed:
        raise ValidationError(f"{site_id!r} is not {what}")


def _matches_commitment(secret: bytes, *, commitment: bytes, session: bytes, owner: str) -> bool:
    expected = self_mask_commitment(secret, session_id=session, site_id=owner)
    return hmac.compare_digest(expected, commitment)


def _matches_public_key(secret: bytes, *, public_key: bytes) -> bool:
    try:
        return hmac.compare_digest(public_key_of(secret), public_key)
    except (CryptoError, ValidationError):
        return False
