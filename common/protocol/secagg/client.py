"""The site side of SecAgg+ as a pure state machine (no I/O, no clock, rng passed in).

Bonawitz et al. 2017 (CCS), "Practical Secure Aggregation for Privacy-Preserving
Machine Learning", sec. 4 (Fig. 4, the actively secure variant with signatures and the
consistency check), restricted to SecAgg+ neighbourhoods (Bell et al. 2020, CCS,
"Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", sec. 3-4).

Every method is accepted in exactly one phase. Any ProtocolAbort moves the client to
ABORTED for good; afterwards every call raises UNEXPECTED_MESSAGE and no secret share
is ever revealed.

The class keeps the round's state and the phase order; each concern lives in its own
module: the roster both sides settle on (`roster`), which peer signatures are verified
and why that suffices (`client_signatures`), the checks of coordinator messages that
need no state (`checks`), the secrets and masks (`masking`) and what Unmask reveals
(`client_reveal`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, TypeVar

import numpy as np

from common.core.errors import (
    AbortReason,
    ConfigError,
    CryptoError,
    ProtocolAbort,
    ValidationError,
)
from common.crypto.kdf import KdfInfo
from common.crypto.keyagreement import X25519KeyPair, derive_key, generate_keypair
from common.crypto.random import RandomSource
from common.crypto.signing import SigningKey
from common.protocol.secagg.checks import (
    check_input_vector,
    check_survivor_list,
    checked_roster,
    open_shares,
)
from common.protocol.secagg.client_reveal import RevealGuard, reveal_shares
from common.protocol.secagg.client_signatures import PeerSignatures
from common.protocol.secagg.identity import IdentityVerifier
from common.protocol.secagg.masking import (
    DealtSecrets,
    agree,
    deal_secrets,
    mask_input,
    prepared_mask,
)
from common.protocol.secagg.messages import (
    AdvertiseKeys,
    ConsistencySignature,
    ConsistencySignatures,
    MaskedInput,
    Message,
    Roster,
    ShareKeysOut,
    ShareKind,
    SharesForRecipient,
    SurvivorList,
    UnmaskShares,
    advertisement_to_sign,
    survivor_list_to_sign,
)
from common.protocol.secagg.params import (
    DEFAULT_MAX_COLLUDING_SITES,
    DEFAULT_MIN_ROUND_SITES,
    SecAggParams,
    round_floor,
)
from common.protocol.secagg.phases import Phase, PhaseTracker
from common.protocol.secagg.roster import RoundRoster, settle_roster

_P = ParamSpec("_P")
_R = TypeVar("_R")


class PeerStatus(enum.Enum):
    """What this client knows about one neighbour."""

    AWAITING_SHARES = "awaiting_shares"
    ALIVE = "alive"
    DROPPED = "dropped"


@dataclass
class PeerState:
    """Per-neighbour state: alive, or dropped and in which phase it was noticed."""

    status: PeerStatus
    dropped_in: Phase | None = None


@dataclass(frozen=True)
class AdvertisedKeys:
    """The two fresh X25519 key pairs of this round: share encryption and masking."""

    encryption: X25519KeyPair
    masking: X25519KeyPair


@dataclass(frozen=True)
class PreparedMask:
    """Masks expanded before the input existed (`SecAggClient.prepare_masks`), and the
    neighbours' pairwise seeds they include."""

    mask: np.ndarray
    seeds: dict[str, bytes]


def _aborts_on_failure(
    method: Callable[Concatenate[SecAggClient, _P], _R],
) -> Callable[Concatenate[SecAggClient, _P], _R]:
    """Any ProtocolAbort leaves the client ABORTED (terminal)."""

    def wrapper(self: SecAggClient, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, *args, **kwargs)
        except ProtocolAbort:
            self._tracker.abort()
            raise

    # Not functools.wraps: mypy cannot type it together with ParamSpec.
    wrapper.__name__ = method.__name__
    wrapper.__qualname__ = method.__qualname__
    wrapper.__doc__ = method.__doc__
    return wrapper


class SecAggClient:
    """One site's participation in one SecAgg+ round."""

    def __init__(
        self,
        params: SecAggParams,
        *,
        site_id: str,
        signing_key: SigningKey,
        identity: IdentityVerifier,
        rng: RandomSource,
        min_round_sites: int = DEFAULT_MIN_ROUND_SITES,
        max_colluding_sites: int = DEFAULT_MAX_COLLUDING_SITES,
    ) -> None:
        """Raises ProtocolAbort(ROUND_TOO_SMALL) when the announced participants are
        fewer than max(min_round_sites, max_colluding_sites + 2): such a round is
        refused before any key is made."""
        if site_id not in params.participants:
            raise ConfigError("site_id", f"{site_id!r} is not a participant of this round")
        self.round_floor = round_floor(
            min_round_sites=min_round_sites, max_colluding_sites=max_colluding_sites
        )
        if len(params.participants) < self.round_floor:
            raise ProtocolAbort(
                AbortReason.ROUND_TOO_SMALL,
                f"{len(params.participants)} participants; this site needs at least "
                f"{self.round_floor}",
            )
        self.params = params
        self.site_id = site_id
        self._signing_key = signing_key
        self._rng = rng
        self._tracker = PhaseTracker()
        self._signatures = PeerSignatures(
            identity, params=params, site_id=site_id, round_floor=self.round_floor
        )
        self._keys: AdvertisedKeys | None = None
        self._roster = RoundRoster()
        self._dealt: DealtSecrets | None = None
        self._held_shares: dict[str, tuple[bytes, bytes]] = {}
        self.peers: dict[str, PeerState] = {}
        self._survivors: SurvivorList | None = None
        self._reveal_guard = RevealGuard()
        self._prepared: PreparedMask | None = None

    # ----------------------------------------------------------------- properties
    @property
    def phase(self) -> Phase:
        return self._tracker.phase

    @property
    def session_id(self) -> bytes:
        return self._roster.session_id

    @property
    def neighbours(self) -> tuple[str, ...]:
        return self._roster.graph.get(self.site_id, ())

    @property
    def aborted_in(self) -> Phase | None:
        """Where the round was aborted (ADVERTISE_KEYS: at the roster, nothing sent)."""
        return self._tracker.aborted_in

    @property
    def signatures_verified(self) -> int:
        """How many signatures this client verified so far this round."""
        return self._signatures.verified

    def revealed_kind(self, owner: str) -> ShareKind | None:
        """Which share of `owner` this client revealed, if any (for audits and tests)."""
        return self._reveal_guard.revealed(owner)

    # ------------------------------------------------------- phase 1: AdvertiseKeys
    @_aborts_on_failure
    def advertise_keys(self) -> AdvertiseKeys:
        """Two fresh X25519 key pairs, public halves signed with the site's key."""
        self._tracker.require(Phase.ADVERTISE_KEYS, "advertise_keys")
        if self._keys is not None:
            raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "keys already advertised")
        keys = self._keys = AdvertisedKeys(
            encryption=generate_keypair(self._rng), masking=generate_keypair(self._rng)
        )
        signature = self._signing_key.sign(
            advertisement_to_sign(
                self.params,
                site_id=self.site_id,
                encryption_public_key=keys.encryption.public_key,
                masking_public_key=keys.masking.public_key,
            )
        )
        return AdvertiseKeys(
            site_id=self.site_id,
            encryption_public_key=keys.encryption.public_key,
            masking_public_key=keys.masking.public_key,
            signature=signature,
        )

    # ----------------------------------------------------------- phase 2: ShareKeys
    @_aborts_on_failure
    def receive_roster(self, roster: Roster) -> ShareKeysOut:
        """Check the roster, then Shamir-share b_u and s_u^SK among the neighbourhood."""
        self._tracker.require(Phase.ADVERTISE_KEYS, "roster")
        keys = self._advertised()
        entries = checked_roster(
            roster,
            participants=frozenset(self.params.participants),
            site_id=self.site_id,
            keys=(keys.encryption.public_key, keys.masking.public_key),
            round_floor=self.round_floor,
            threshold=self.params.threshold,
        )
        self._roster = settle_roster(self.params, entries)
        # Only neighbours: they alone receive our shares and mask against us
        # (`client_signatures` says why the others need no check here).
        self._signatures.verify_neighbours(self._roster)
        dealt = self._dealt = deal_secrets(
            self.params, site_id=self.site_id, roster=self._roster,
            encryption_private_key=keys.encryption.private_key,
            masking_private_key=keys.masking.private_key, rng=self._rng,
        )
        self.peers = {peer: PeerState(PeerStatus.AWAITING_SHARES) for peer in self.neighbours}
        self._tracker.advance(Phase.SHARE_KEYS)
        return dealt.message

    # ------------------------------------------ optional: masks before the input
    def prepare_masks(self) -> None:
        """Expand this round's masks before the input exists (e.g. in a worker thread
        while ShareKeys is in flight): PRG(b_u) +/- PRG(s_uv) for every neighbour v, as
        if all of them send shares. `receive_shares` then adds them to the input in one
        pass and takes out the masks of neighbours whose shares never came: the masked
        vector is bit for bit the one computed without this step. Costs one vector of
        memory until `receive_shares`. A neighbour whose key agreement fails is left
        out here and handled by `receive_shares` exactly as without this step.

        Only between `receive_roster` and `receive_shares`, with no other call on this
        client running meanwhile."""
        self._tracker.require(Phase.SHARE_KEYS, "prepare masks")
        keys, dealt = self._advertised(), self._dealt_secrets()
        seeds: dict[str, bytes] = {}
        for peer in self.peers:
            try:
                seeds[peer] = derive_key(
                    keys.masking.private_key, self._roster.entries[peer].masking_public_key,
                    session_id=self._roster.session_id, info=KdfInfo.PAIRWISE_MASK_SEED,
                )
            except CryptoError:
                continue  # receive_shares aborts if this peer's shares arrive
        mask = prepared_mask(self.site_id, self_mask_seed=dealt.self_mask_seed,
                             seeds=seeds, vector_length=self.params.vector_length)
        self._prepared = PreparedMask(mask=mask, seeds=seeds)

    # --------------------------------------------------------- phase 3: MaskedInput
    @_aborts_on_failure
    def receive_shares(self, message: SharesForRecipient, input_vector: np.ndarray) -> MaskedInput:
        """Decrypt neighbours' shares, then mask `input_vector` IN PLACE and return it
        (`common.protocol.secagg.masking.mask_input`)."""
        self._tracker.require(Phase.SHARE_KEYS, "shares")
        check_input_vector(input_vector, length=self.params.vector_length)
        keys, dealt = self._advertised(), self._dealt_secrets()
        received = open_shares(
            message,
            keys=dealt.share_keys,
            roster=self._roster.entries,
            neighbours=self.peers,
            site_id=self.site_id,
            round_number=self.params.round_number,
            session_id=self._roster.session_id,
        )
        if len(received) + 1 < self.params.threshold:
            # Our own secrets could never be reconstructed (Bonawitz: |U2| >= t).
            raise ProtocolAbort(
                AbortReason.TOO_FEW_PARTICIPANTS,
                f"only {len(received)} neighbours sent shares, threshold {self.params.threshold}",
            )
        prepared, self._prepared = self._prepared, None
        premasked = prepared.seeds if prepared is not None else {}
        seeds = {
            peer: premasked.get(peer) or agree(
                keys.masking.private_key,
                self._roster.entries[peer].masking_public_key,
                session_id=self._roster.session_id,
                info=KdfInfo.PAIRWISE_MASK_SEED,
            )
            for peer in sorted(received)
        }
        for peer, state in self.peers.items():
            if peer in received:
                state.status = PeerStatus.ALIVE
            else:
                state.status, state.dropped_in = PeerStatus.DROPPED, Phase.SHARE_KEYS
        self._held_shares = received
        mask_input(input_vector, site_id=self.site_id, self_mask_seed=dealt.self_mask_seed,
                   seeds=seeds, received=received,
                   premask=prepared.mask if prepared is not None else None,
                   premasked=premasked)
        self._tracker.advance(Phase.MASKED_INPUT)
        return MaskedInput(vector=input_vector)

    # ---------------------------------------------------- phase 4: ConsistencyCheck
    @_aborts_on_failure
    def receive_survivors(self, message: SurvivorList) -> ConsistencySignature:
        """Check the coordinator's survivor list and sign it (Bonawitz et al. 2017,
        sec. 4, ConsistencyCheck); signatures are cross-checked in the next step."""
        self._tracker.require(Phase.MASKED_INPUT, "survivor list")
        check_survivor_list(
            message,
            roster=self._roster.entries,
            site_id=self.site_id,
            neighbours=set(self.peers),
            held=set(self._held_shares),
            threshold=self.params.threshold,
            round_floor=self.round_floor,
        )
        canonical = SurvivorList(tuple(sorted(message.survivors)), tuple(sorted(message.dropped)))
        for peer in canonical.dropped:
            state = self.peers.get(peer)
            if state is not None:
                state.status, state.dropped_in = PeerStatus.DROPPED, Phase.MASKED_INPUT
        self._survivors = canonical
        signature = self._signing_key.sign(survivor_list_to_sign(
            canonical, round_number=self.params.round_number, session_id=self.session_id
        ))
        self._tracker.advance(Phase.CONSISTENCY_CHECK)
        return ConsistencySignature(signature=signature)

    # -------------------------------------------------------------- phase 5: Unmask
    @_aborts_on_failure
    def receive_consistency(self, message: ConsistencySignatures) -> UnmaskShares:
        """Verify that enough survivors signed the same list, then reveal shares:
        b_v for surviving neighbours, s_v^SK for dropped ones, never both for one v."""
        self._tracker.require(Phase.CONSISTENCY_CHECK, "consistency signatures")
        survivors = self._survivors
        if survivors is None:  # unreachable through the phase table; defensive
            raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "no survivor list")
        alive = set(survivors.survivors)
        owners = [o for o in (*self.peers, self.site_id) if o in alive or o in survivors.dropped]
        self._signatures.verify_confirmations(
            message, roster=self._roster, listing=survivors, owners=owners,
            neighbours=self.peers,
        )
        held = {**self._held_shares, self.site_id: self._dealt_secrets().own_shares}
        revealed = reveal_shares(owners, alive=alive, held=held, guard=self._reveal_guard)
        self._tracker.advance(Phase.UNMASK)
        return revealed

    @_aborts_on_failure
    def complete(self) -> None:
        """The coordinator reported the round complete; nothing is left to do."""
        self._tracker.require(Phase.UNMASK, "completion")
        self._tracker.advance(Phase.COMPLETED)

    def abort(self) -> None:
        """Give up on the round (deadline passed, coordinator reported an abort)."""
        self._tracker.abort()

    # ------------------------------------------------------------------ dispatcher
    def handle(self, message: Message, input_vector: np.ndarray | None = None) -> Message:
        """Route a coordinator message to its phase method (for the networked loop)."""
        if isinstance(message, Roster):
            return self.receive_roster(message)
        if isinstance(message, SharesForRecipient):
            if input_vector is None:
                raise ValidationError("SharesForRecipient needs the input vector to mask")
            return self.receive_shares(message, input_vector)
        if isinstance(message, SurvivorList):
            return self.receive_survivors(message)
        if isinstance(message, ConsistencySignatures):
            return self.receive_consistency(message)
        self._tracker.abort()
        raise ProtocolAbort(
            AbortReason.UNEXPECTED_MESSAGE, f"a site never receives {type(message).__name__}"
        )

    # ------------------------------------------------------------------- helpers
    def _advertised(self) -> AdvertisedKeys:
        if self._keys is None:
            raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "keys were not advertised yet")
        return self._keys

    def _dealt_secrets(self) -> DealtSecrets:
        if self._dealt is None:  # unreachable through the phase table; defensive
            raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "no shares dealt yet")
        return self._dealt
