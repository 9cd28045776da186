"""AdvertiseKeys at the coordinator: each invited site's two fresh public keys, accepted
only with a valid signature by the key of that site's verified TLS certificate
(Bonawitz et al. 2017, sec. 4, Round 0), then settled into the round's roster.

The coordinator relays the roster with each certificate, so every site can check its
neighbours' signatures itself; checking here too refuses a bad advertisement at its
sender instead of letting it abort every neighbour's round.
"""

from __future__ import annotations

from common.core.errors import ValidationError
from common.crypto.keyagreement import KEY_BYTES
from common.protocol.secagg.identity import IdentityVerifier
from common.protocol.secagg.messages import AdvertiseKeys, RosterEntry, advertisement_to_sign
from common.protocol.secagg.params import SecAggParams
from common.protocol.secagg.phases import require_sender
from common.protocol.secagg.roster import RoundRoster, settle_roster


class KeyAdvertisements:
    """The advertisements accepted so far this round, by site id."""

    def __init__(self, params: SecAggParams, *, identity: IdentityVerifier) -> None:
        self._params = params
        self._identity = identity
        self._entries: dict[str, RosterEntry] = {}

    @property
    def sites(self) -> set[str]:
        """Sites whose advertisement was accepted."""
        return set(self._entries)

    def accept(self, site_id: str, message: AdvertiseKeys, *, certificate_der: bytes) -> None:
        """Keep one site's signed keys; `certificate_der` is its verified TLS certificate.
        ValidationError or CryptoError (the state unchanged) for a bad advertisement."""
        require_sender(site_id, self._params.participants, "invited")
        if site_id in self._entries:
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
            advertisement_to_sign(
                self._params,
                site_id=site_id,
                encryption_public_key=message.encryption_public_key,
                masking_public_key=message.masking_public_key,
            ),
            message.signature,
        )
        self._entries[site_id] = RosterEntry(
            site_id=site_id,
            encryption_public_key=message.encryption_public_key,
            masking_public_key=message.masking_public_key,
            signature=message.signature,
            certificate_der=certificate_der,
        )

    def settle(self) -> RoundRoster:
        """The round's roster: every accepted advertisement, sorted by site id."""
        return settle_roster(self._params, self._entries)
