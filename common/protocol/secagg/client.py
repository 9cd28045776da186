"""The site side of SecAgg+ as a pure state machine (no I/O, no clock, rng passed in).

Bonawitz et al. 2017 (CCS), "Practical Secure Aggregation for Privacy-Preserving
Machine Learning", sec. 4 (Fig. 4, the actively secure variant with signatures and the
consistency check), restricted to SecAgg+ neighbourhoods (Bell et al. 2020, CCS,
"Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", sec. 3-4).

Every method is accepted in exactly one phase. Any ProtocolAbort moves the client to
ABORTED for good; afterwards every call raises UNEXPECTED_MESSAGE and no secret share
is ever revealed.

Which signatures a client verifies (each at most once per round, the signer's key
obtained from `identity` at most once per site and round):

* Roster: only the AdvertiseKeys signatures of its neighbours N(u) (Bell et al. 2020,
  sec. 4: a client needs only its neighbourhood), not all n. Why that suffices:
  u encrypts its shares only under neighbours' encryption keys and masks only against
  neighbours' masking keys, and those entries ARE verified; its own entry is checked
  against the keys it made. A forged non-neighbour entry is never used for u's secrets.
  It does change u's session id (the hash of the whole roster), and with it u's
  neighbour graph; but the session id salts every pairwise mask and share key and sits
  in every AEAD associated data and survivor-list signature, so u only ever combines
  with sites that hold the identical roster, and each of them verified ITS neighbours
  in it and checked its own entry. A coordinator forging far entries can re-roll the
  graph, which it can already do by choosing which advertisements to include (or via
  one colluding site's fresh keys); nothing here relies on the graph being random
  against the coordinator: the thresholds are checked for the worst-case graph
  (`validate_against_threat_model`, applied by the site to every announcement) and
  the survivor floor counts only authenticated sites (below).
* Consistency check: only the survivor-list signatures of sites in the closed
  neighbourhoods of the owners whose shares u reveals (its two-hop neighbourhood,
  2k + 1 sites in a Harary graph), plus, only if the floor is not met otherwise, just
  enough further signers to meet it. Why that suffices: the rule that protects owner o
  is "t holders of o's shares confirmed the same list" and only o's closed
  neighbourhood holds them; a signature from outside concerns owners whose shares u
  never reveals, so ignoring it (forged or not) changes nothing u sends. A signature
  that verifies on u's list under the signer's certified key proves that the signer
  derived u's session id (so saw u's roster and announcement) and was shown u's list.
* Survivor floor: a listed survivor counts towards the floor only if u authenticated
  it: u itself, a neighbour (verified entry, and it sent u shares bound to u's session
  id), or a signer whose signature u verified. A coordinator padding the list with
  forged entries (keys it holds, so inputs it knows) therefore cannot lift a sum of
  too few real sites over the floor.
With the complete graph (up to 20 sites) N(u) is everyone, so every entry is verified
and sites told different announcements all abort at the roster. With SecAgg+
neighbourhoods, every site with a neighbour told another story aborts there; sites
further apart end up in different sessions, whose inputs cannot meet in one sum.

The message checks that need no client state (the roster, the decrypted shares, the
survivor list) are pure functions in `common.protocol.secagg.checks`.
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
    PkiError,
    ProtocolAbort,
    ValidationError,
)
from common.crypto.kdf import KdfInfo, hkdf_sha256
from common.crypto.keyagreement import X25519KeyPair, derive_key, generate_keypair
from common.crypto.random import RandomSource
from common.crypto.shamir import SECRET_BYTES
from common.crypto.signing import SigningKey, VerifyingKey
from common.protocol.secagg.checks import (
    check_input_vector,
    check_neighbourhood_quorum,
    check_survivor_list,
    checked_roster,
    open_shares,
    relayed_signatures,
)
from common.protocol.secagg.graph import NeighbourGraph, neighbour_graph
from common.protocol.secagg.masking import agree, encrypted_shares, mask_input, prepared_mask
from common.protocol.secagg.messages import (
    AdvertiseKeys,
    ConsistencySignature,
    ConsistencySignatures,
    MaskedInput,
    Message,
    RevealedShare,
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
from common.protocol.secagg.params import (
    DEFAULT_MAX_COLLUDING_SITES,
    DEFAULT_MIN_ROUND_SITES,
    SecAggParams,
    round_floor,
)
from common.protocol.secagg.phases import Phase, PhaseTracker
from common.protocol.secagg.session import session_id as compute_session_id

IdentityVerifier = Callable[[str, bytes], VerifyingKey]
"""(site_id, certificate_der) -> the key that must have signed for that site.

Raises CryptoError or CertificateRejected (the client turns these into the abort
reason of the check at hand), or ProtocolAbort with its own reason (NOT_A_SITE,
UNKNOWN_MEMBER, REVOKED_PEER), which propagates unchanged. The networked layer checks
the chain to the federation CA and that the certificate names `site_id`. Called only
for the sites whose signatures this client verifies (see the module docstring)."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


def self_mask_seed(seed: bytes, *, session: bytes) -> bytes:
    """PRG seed of the self mask: HKDF(b_u, salt=session id, info=SELF_MASK_SEED)."""
    return hkdf_sha256(seed, salt=session, info=KdfInfo.SELF_MASK_SEED.value)


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


class RevealGuard:
    """Remembers which kind of share was revealed for each owner.

    The single most important rule of SecAgg (Bonawitz et al. 2017, sec. 4, Unmask):
    revealing both b_u and s_u^SK of one site unmasks its input. Whatever the
    coordinator says, a second kind for the same owner aborts instead.
    """

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
        self._participants = frozenset(params.participants)
        self.site_id = site_id
        self._signing_key = signing_key
        self._identity = identity
        self._rng = rng
        self._tracker = PhaseTracker()
        self._encryption_keys: X25519KeyPair | None = None
        self._masking_keys: X25519KeyPair | None = None
        self._roster: dict[str, RosterEntry] = {}
        self._x: dict[str, int] = {}
        self._graph: NeighbourGraph = NeighbourGraph((), 0)
        self._session_id = b""
        self._own_shares: tuple[bytes, bytes] = (b"", b"")
        self._held_shares: dict[str, tuple[bytes, bytes]] = {}
        self._share_keys: dict[str, bytes] = {}  # neighbour -> AEAD key (both directions)
        self._self_mask_seed = b""
        self.peers: dict[str, PeerState] = {}
        self._survivors: SurvivorList | None = None
        self._reveal_guard = RevealGuard()
        self._verifying_keys: dict[str, VerifyingKey] = {}
        self._signatures_verified = 0
        # prepare_masks: the expanded masks and the neighbours' seeds they include.
        self._premask: np.ndarray | None = None
        self._premasked: dict[str, bytes] = {}

    # ----------------------------------------------------------------- properties
    @property
    def phase(self) -> Phase:
        return self._tracker.phase

    @property
    def session_id(self) -> bytes:
        return self._session_id

    @property
    def neighbours(self) -> tuple[str, ...]:
        return self._graph.get(self.site_id, ())

    @property
    def aborted_in(self) -> Phase | None:
        """Where the round was aborted (ADVERTISE_KEYS: at the roster, nothing sent)."""
        return self._tracker.aborted_in

    @property
    def signatures_verified(self) -> int:
        """How many signatures this client verified so far this round."""
        return self._signatures_verified

    def revealed_kind(self, owner: str) -> ShareKind | None:
        """Which share of `owner` this client revealed, if any (for audits and tests)."""
        return self._reveal_guard.revealed(owner)

    # ------------------------------------------------------- phase 1: AdvertiseKeys
    @_aborts_on_failure
    def advertise_keys(self) -> AdvertiseKeys:
        """Two fresh X25519 key pairs, public halves signed with the site's key."""
        self._tracker.require(Phase.ADVERTISE_KEYS, "advertise_keys")
        if self._encryption_keys is not None:
            raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "keys already advertised")
        self._encryption_keys = generate_keypair(self._rng)
        self._masking_keys = generate_keypair(self._rng)
        signature = self._signing_key.sign(
            advertise_message(
                round_number=self.params.round_number,
                round_nonce=self.params.round_nonce,
                site_id=self.site_id,
                encryption_public_key=self._encryption_keys.public_key,
                masking_public_key=self._masking_keys.public_key,
                announcement_digest=self.params.announcement_digest,
            )
        )
        return AdvertiseKeys(
            site_id=self.site_id,
            encryption_public_key=self._encryption_keys.public_key,
            masking_public_key=self._masking_keys.public_key,
            signature=signature,
        )

    # ----------------------------------------------------------- phase 2: ShareKeys
    @_aborts_on_failure
    def receive_roster(self, roster: Roster) -> ShareKeysOut:
        """Check the roster, then Shamir-share b_u and s_u^SK among the neighbourhood."""
        self._tracker.require(Phase.ADVERTISE_KEYS, "roster")
        encryption_keys, masking_keys = self._keys()
        entries = checked_roster(
            roster,
            participants=self._participants,
            site_id=self.site_id,
            keys=(encryption_keys.public_key, masking_keys.public_key),
            round_floor=self.round_floor,
            threshold=self.params.threshold,
        )
        sites = sorted(entries)
        self._roster = {site: entries[site] for site in sites}
        self._x = {site: index + 1 for index, site in enumerate(sites)}
        self._session_id = compute_session_id(self.params, self._roster.values())
        self._graph = neighbour_graph(self._session_id, sites, self.params.neighbours)
        for peer in self._graph[self.site_id]:
            # Only neighbours: they alone receive our shares and mask against us (see
            # the module docstring for why the others need no check here). A swapped
            # key, a roster replayed from another round, or a neighbour told another
            # announcement cannot produce these (Bonawitz et al. 2017, sec. 4, Round 1).
            entry = self._roster[peer]
            self._verify(
                peer,
                advertise_message(
                    round_number=self.params.round_number,
                    round_nonce=self.params.round_nonce,
                    site_id=peer,
                    encryption_public_key=entry.encryption_public_key,
                    masking_public_key=entry.masking_public_key,
                    announcement_digest=self.params.announcement_digest,
                ),
                entry.signature,
                AbortReason.BAD_SIGNATURE,
            )
        neighbours = self._graph[self.site_id]
        seed = self._rng(SECRET_BYTES)
        own, self._share_keys, out = encrypted_shares(
            (seed, masking_keys.private_key), site_id=self.site_id,
            holders=sorted((*neighbours, self.site_id)), xs=self._x,
            encryption_private_key=encryption_keys.private_key,
            encryption_public_keys={h: self._roster[h].encryption_public_key for h in neighbours},
            threshold=self.params.threshold, round_number=self.params.round_number,
            session_id=self._session_id, rng=self._rng,
        )
        self._own_shares = (own[0], own[1])
        self._self_mask_seed = self_mask_seed(seed, session=self._session_id)
        self.peers = {peer: PeerState(PeerStatus.AWAITING_SHARES) for peer in neighbours}
        self._tracker.advance(Phase.SHARE_KEYS)
        commitment = self_mask_commitment(seed, session_id=self._session_id, site_id=self.site_id)
        return ShareKeysOut(shares=tuple(out), self_mask_commitment=commitment)

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
        _, masking_keys = self._keys()
        seeds: dict[str, bytes] = {}
        for peer in self.peers:
            try:
                seeds[peer] = derive_key(
                    masking_keys.private_key, self._roster[peer].masking_public_key,
                    session_id=self._session_id, info=KdfInfo.PAIRWISE_MASK_SEED,
                )
            except CryptoError:
                continue  # receive_shares aborts if this peer's shares arrive
        self._premask = prepared_mask(self.site_id, self_mask_seed=self._self_mask_seed,
                                      seeds=seeds, vector_length=self.params.vector_length)
        self._premasked = seeds

    # --------------------------------------------------------- phase 3: MaskedInput
    @_aborts_on_failure
    def receive_shares(self, message: SharesForRecipient, input_vector: np.ndarray) -> MaskedInput:
        """Decrypt neighbours' shares, then mask `input_vector` IN PLACE and return it
        (`common.protocol.secagg.masking.mask_input`)."""
        self._tracker.require(Phase.SHARE_KEYS, "shares")
        check_input_vector(input_vector, length=self.params.vector_length)
        _, masking_keys = self._keys()
        received = open_shares(
            message,
            keys=self._share_keys,
            roster=self._roster,
            neighbours=self.peers,
            site_id=self.site_id,
            round_number=self.params.round_number,
            session_id=self._session_id,
        )
        if len(received) + 1 < self.params.threshold:
            # Our own secrets could never be reconstructed (Bonawitz: |U2| >= t).
            raise ProtocolAbort(
                AbortReason.TOO_FEW_PARTICIPANTS,
                f"only {len(received)} neighbours sent shares, threshold {self.params.threshold}",
            )
        premask, premasked = self._premask, self._premasked
        self._premask, self._premasked = None, {}
        seeds = {
            peer: premasked.get(peer) or self._agree(
                masking_keys.private_key,
                self._roster[peer].masking_public_key,
                KdfInfo.PAIRWISE_MASK_SEED,
            )
            for peer in sorted(received)
        }
        for peer, state in self.peers.items():
            if peer in received:
                state.status = PeerStatus.ALIVE
            else:
                state.status, state.dropped_in = PeerStatus.DROPPED, Phase.SHARE_KEYS
        self._held_shares = received
        mask_input(input_vector, site_id=self.site_id, self_mask_seed=self._self_mask_seed,
                   seeds=seeds, received=received, premask=premask, premasked=premasked)
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
            roster=self._roster,
            site_id=self.site_id,
            neighbours=set(self.peers),
            held=set(self._held_shares),
            threshold=self.params.threshold,
            round_floor=self.round_floor,
        )
        survivors, dropped = message.survivors, message.dropped
        canonical = SurvivorList(tuple(sorted(survivors)), tuple(sorted(dropped)))
        for peer in canonical.dropped:
            state = self.peers.get(peer)
            if state is not None:
                state.status, state.dropped_in = PeerStatus.DROPPED, Phase.MASKED_INPUT
        self._survivors = canonical
        signature = self._signing_key.sign(self._survivors_message(canonical))
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
        # Holders of the shares we reveal: the closed neighbourhoods of their owners.
        holders = {h for owner in owners for h in (owner, *self._graph[owner])}
        relayed = relayed_signatures(message, roster=self._roster, alive=alive)
        signed_message = self._survivors_message(survivors)
        # Our own confirmation needs no check: we signed this very list to get here.
        signers = {self.site_id}
        for signer in sorted((relayed.keys() & holders) - signers):
            # A signature that does not verify on OUR list means the signer was shown
            # another list or session (or the coordinator forged it): equivocation.
            self._verify(
                signer, signed_message, relayed[signer], AbortReason.INCONSISTENT_SURVIVOR_SETS
            )
            signers.add(signer)
        if len(signers) < self.params.threshold:
            raise ProtocolAbort(
                AbortReason.INCONSISTENT_SURVIVOR_SETS,
                f"only {len(signers)} survivors confirmed the list, need {self.params.threshold}",
            )
        check_neighbourhood_quorum(
            owners, signers=signers, graph=self._graph, threshold=self.params.threshold
        )
        self._require_survivor_floor(alive, signers, relayed, signed_message)
        revealed: list[RevealedShare] = []
        for owner in sorted(owners):
            seed_share, key_share = (
                self._own_shares if owner == self.site_id else self._held_shares[owner]
            )
            if owner in alive:
                kind, share = ShareKind.SELF_MASK_SEED, seed_share
            else:
                kind, share = ShareKind.MASKING_KEY, key_share
            self._reveal_guard.record(owner, kind)
            revealed.append(RevealedShare(owner_site_id=owner, kind=kind, share=share))
        self._tracker.advance(Phase.UNMASK)
        return UnmaskShares(shares=tuple(revealed))

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
    def _keys(self) -> tuple[X25519KeyPair, X25519KeyPair]:
        if self._encryption_keys is None or self._masking_keys is None:
            raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "keys were not advertised yet")
        return self._encryption_keys, self._masking_keys

    def _agree(self, private_key: bytes, peer_public_key: bytes, info: KdfInfo) -> bytes:
        return agree(private_key, peer_public_key, session_id=self._session_id, info=info)

    def _verify(self, site: str, message: bytes, signature: bytes, reason: AbortReason) -> None:
        """Check `site`'s signature with the key of its roster certificate.

        The key comes from `identity` once per site and round; a ProtocolAbort raised
        by `identity` (not_a_site, unknown_member, revoked_peer) propagates unchanged.
        """
        key = self._verifying_keys.get(site)
        try:
            if key is None:
                key = self._identity(site, self._roster[site].certificate_der)
                self._verifying_keys[site] = key
            self._signatures_verified += 1
            key.verify(message, signature)
        except (CryptoError, PkiError):
            raise ProtocolAbort(reason, f"signature of {site!r} does not verify") from None

    def _require_survivor_floor(
        self,
        alive: set[str],
        signers: set[str],
        relayed: dict[str, bytes],
        signed_message: bytes,
    ) -> None:
        """Refuse Unmask unless at least `round_floor` survivors are authenticated.

        Authenticated: this site, a neighbour (verified roster entry; it sent us shares
        bound to our session id) or a signer whose signature we verified. Listed names
        we never checked may be forged entries whose inputs the coordinator knows.
        Further relayed signatures are verified only while the floor is not yet met.
        """
        confirmed = alive & {self.site_id, *self.peers, *signers}
        for signer in sorted(relayed.keys() - signers):
            if len(confirmed) >= self.round_floor:
                break
            self._verify(
                signer, signed_message, relayed[signer], AbortReason.INCONSISTENT_SURVIVOR_SETS
            )
            signers.add(signer)
            confirmed.add(signer)
        if len(confirmed) < self.round_floor:
            raise ProtocolAbort(
                AbortReason.SURVIVORS_BELOW_FLOOR,
                f"{len(confirmed)} authenticated survivors; this site needs at least "
                f"{self.round_floor}",
            )

    def _survivors_message(self, survivors: SurvivorList) -> bytes:
        return survivors_message(
            round_number=self.params.round_number,
            session_id=self._session_id,
            survivors=survivors.survivors,
            dropped=survivors.dropped,
        )
