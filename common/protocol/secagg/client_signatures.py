"""Which peer signatures a SecAgg+ site verifies, and why that suffices.

Each signature is verified at most once per round, the signer's key obtained from the
`IdentityVerifier` at most once per site and round:

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
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from common.core.errors import AbortReason, CryptoError, PkiError, ProtocolAbort
from common.crypto.signing import VerifyingKey
from common.protocol.secagg.checks import check_neighbourhood_quorum, relayed_signatures
from common.protocol.secagg.identity import IdentityVerifier
from common.protocol.secagg.messages import (
    ConsistencySignatures,
    SurvivorList,
    advertisement_to_sign,
    survivor_list_to_sign,
)
from common.protocol.secagg.params import SecAggParams
from common.protocol.secagg.roster import RoundRoster


class PeerSignatures:
    """One site's checks of its peers' signatures within one round."""

    def __init__(
        self, identity: IdentityVerifier, *, params: SecAggParams, site_id: str,
        round_floor: int,
    ) -> None:
        self._identity = identity
        self._params = params
        self._site_id = site_id
        self._round_floor = round_floor
        self._keys: dict[str, VerifyingKey] = {}
        self.verified = 0
        """How many signatures were checked so far this round."""

    def verify_neighbours(self, roster: RoundRoster) -> None:
        """ProtocolAbort(BAD_SIGNATURE) unless every neighbour signed its roster entry
        for this round. A swapped key, a roster replayed from another round, or a
        neighbour told another announcement cannot produce these (Bonawitz et al. 2017,
        sec. 4, Round 1)."""
        for peer in roster.graph[self._site_id]:
            entry = roster.entries[peer]
            message = advertisement_to_sign(
                self._params,
                site_id=peer,
                encryption_public_key=entry.encryption_public_key,
                masking_public_key=entry.masking_public_key,
            )
            self._verify(roster, peer, message, entry.signature, AbortReason.BAD_SIGNATURE)

    def verify_confirmations(
        self, message: ConsistencySignatures, *, roster: RoundRoster, listing: SurvivorList,
        owners: Sequence[str], neighbours: Collection[str],
    ) -> None:
        """ProtocolAbort unless enough survivors confirmed `listing` (the list this site
        signed) before it reveals the shares of `owners`: t in total, t around each
        owner, and `round_floor` authenticated survivors (see the module docstring)."""
        threshold = self._params.threshold
        alive = set(listing.survivors)
        # Holders of the shares we reveal: the closed neighbourhoods of their owners.
        holders = {h for owner in owners for h in roster.closed_neighbourhood(owner)}
        relayed = relayed_signatures(message, roster=roster.entries, alive=alive)
        signed = survivor_list_to_sign(
            listing, round_number=self._params.round_number, session_id=roster.session_id
        )
        # Our own confirmation needs no check: we signed this very list to get here.
        signers = {self._site_id}
        for signer in sorted((relayed.keys() & holders) - signers):
            # A signature that does not verify on OUR list means the signer was shown
            # another list or session (or the coordinator forged it): equivocation.
            self._verify(
                roster, signer, signed, relayed[signer], AbortReason.INCONSISTENT_SURVIVOR_SETS
            )
            signers.add(signer)
        if len(signers) < threshold:
            raise ProtocolAbort(
                AbortReason.INCONSISTENT_SURVIVOR_SETS,
                f"only {len(signers)} survivors confirmed the list, need {threshold}",
            )
        check_neighbourhood_quorum(owners, signers=signers, graph=roster.graph,
                                   threshold=threshold)
        # Authenticated: this site, a neighbour (verified roster entry; it sent us shares
        # bound to our session id) or a signer whose signature we verified. Listed names
        # we never checked may be forged entries whose inputs the coordinator knows.
        # Further relayed signatures are verified only while the floor is not yet met.
        confirmed = alive & {self._site_id, *neighbours, *signers}
        for signer in sorted(relayed.keys() - signers):
            if len(confirmed) >= self._round_floor:
                break
            self._verify(
                roster, signer, signed, relayed[signer], AbortReason.INCONSISTENT_SURVIVOR_SETS
            )
            signers.add(signer)
            confirmed.add(signer)
        if len(confirmed) < self._round_floor:
            raise ProtocolAbort(
                AbortReason.SURVIVORS_BELOW_FLOOR,
                f"{len(confirmed)} authenticated survivors; this site needs at least "
                f"{self._round_floor}",
            )

    def _verify(
        self, roster: RoundRoster, site: str, message: bytes, signature: bytes,
        reason: AbortReason,
    ) -> None:
        """Check `site`'s signature with the key of its roster certificate.

        The key comes from `identity` once per site and round; a ProtocolAbort raised
        by `identity` (not_a_site, unknown_member, revoked_peer) propagates unchanged.
        """
        key = self._keys.get(site)
        try:
            if key is None:
                key = self._identity(site, roster.entries[site].certificate_der)
                self._keys[site] = key
            self.verified += 1
            key.verify(message, signature)
        except (CryptoError, PkiError):
            raise ProtocolAbort(reason, f"signature of {site!r} does not verify") from None
