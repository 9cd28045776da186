"""ConsistencyCheck at the coordinator: every survivor's signature over the one survivor
list, verified and relayed, so that the sites can check that they were all told the same
story (Bonawitz et al. 2017, sec. 4, the actively secure variant).

The round goes on only with t confirmations inside the closed neighbourhood of every
listed site (Bell et al. 2020: only those hold its shares). Sites apply the same
neighbourhood quorum before they reveal anything; checking it here too stops a round
that cannot unmask one phase earlier.
"""

from __future__ import annotations

from common.core.errors import AbortReason, ProtocolAbort, ValidationError
from common.protocol.secagg.identity import IdentityVerifier
from common.protocol.secagg.messages import (
    ConsistencySignature,
    ConsistencySignatures,
    SurvivorList,
    survivor_list_to_sign,
)
from common.protocol.secagg.params import SecAggParams
from common.protocol.secagg.phases import require_sender
from common.protocol.secagg.roster import RoundRoster


class SurvivorConfirmations:
    """The survivors' verified signatures over `listing`, by signer."""

    def __init__(
        self, params: SecAggParams, *, roster: RoundRoster, listing: SurvivorList,
        identity: IdentityVerifier,
    ) -> None:
        self._threshold = params.threshold
        self._roster = roster
        self._listing = listing
        self._survivors = frozenset(listing.survivors)
        self._identity = identity
        self._message = survivor_list_to_sign(
            listing, round_number=params.round_number, session_id=roster.session_id
        )
        self._signatures: dict[str, bytes] = {}

    @property
    def signers(self) -> set[str]:
        """Survivors whose signature was accepted."""
        return set(self._signatures)

    def accept(self, site_id: str, message: ConsistencySignature) -> None:
        """Keep one survivor's signature once it verifies under its roster certificate;
        ValidationError or CryptoError (the state unchanged) otherwise."""
        require_sender(site_id, self._survivors, "a survivor")
        if site_id in self._signatures:
            raise ValidationError(f"{site_id!r} already signed the survivor list")
        self._identity(site_id, self._roster.entries[site_id].certificate_der).verify(
            self._message, message.signature
        )
        self._signatures[site_id] = message.signature

    def require_neighbourhood_quorums(self) -> None:
        """ProtocolAbort(TOO_FEW_PARTICIPANTS) unless t survivors around every listed
        site confirmed the list."""
        signers = self.signers
        for owner in (*self._listing.survivors, *self._listing.dropped):
            if len(signers & self._roster.closed_neighbourhood(owner)) < self._threshold:
                raise ProtocolAbort(
                    AbortReason.TOO_FEW_PARTICIPANTS,
                    f"fewer than t confirmations around {owner!r}",
                )

    def relayed(self) -> ConsistencySignatures:
        """Every accepted signature, sorted by signer, for the sites to cross-check."""
        return ConsistencySignatures(signatures=tuple(sorted(self._signatures.items())))
