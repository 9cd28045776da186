"""ShareKeys at the coordinator: each site's sealed share pairs, one per neighbour, routed
to their recipients (Bonawitz et al. 2017, sec. 4, Round 1; Bell et al. 2020, sec. 3).

The coordinator cannot open a share (each is sealed under a key only its sender and
recipient agree on); it checks only the shape: one share per neighbour, every
ciphertext of the one fixed length. It keeps each sender's commitment to its self-mask
seed, against which Unmask checks the rebuilt seed (`server_unmask`).
"""

from __future__ import annotations

from common.core.errors import ValidationError
from common.protocol.secagg.messages import (
    CIPHERTEXT_BYTES,
    COMMITMENT_BYTES,
    EncryptedShare,
    ShareKeysOut,
    SharesForRecipient,
)
from common.protocol.secagg.phases import require_sender
from common.protocol.secagg.roster import RoundRoster


class ShareRelay:
    """The share pairs sent so far this round, by sender."""

    def __init__(self, roster: RoundRoster) -> None:
        self._roster = roster
        self._sent: dict[str, ShareKeysOut] = {}

    @property
    def senders(self) -> set[str]:
        """Sites whose shares were accepted."""
        return set(self._sent)

    def commitment(self, owner: str) -> bytes:
        """`owner`'s commitment to its self-mask seed b_u."""
        return self._sent[owner].self_mask_commitment

    def accept(self, site_id: str, message: ShareKeysOut) -> None:
        """Keep one site's shares; ValidationError (the state unchanged) unless they go
        to each of its neighbours exactly once, in ciphertexts of the fixed length."""
        require_sender(site_id, self._roster.entries, "in the roster")
        if site_id in self._sent:
            raise ValidationError(f"{site_id!r} already sent its shares")
        recipients = [share.peer_site_id for share in message.shares]
        if sorted(recipients) != list(self._roster.graph[site_id]):
            raise ValidationError("shares must go to each neighbour exactly once")
        if any(len(share.ciphertext) != CIPHERTEXT_BYTES for share in message.shares):
            raise ValidationError(f"share ciphertexts must be {CIPHERTEXT_BYTES} bytes")
        if len(message.self_mask_commitment) != COMMITMENT_BYTES:
            raise ValidationError(f"self-mask commitment must be {COMMITMENT_BYTES} bytes")
        self._sent[site_id] = message

    def route(self) -> dict[str, SharesForRecipient]:
        """Every sender's shares addressed to it, for each sender (a share for a site that
        sent none is dropped: that site is out of the round)."""
        inbox: dict[str, list[EncryptedShare]] = {site: [] for site in sorted(self._sent)}
        for sender in sorted(self._sent):
            for share in self._sent[sender].shares:
                if share.peer_site_id in inbox:
                    inbox[share.peer_site_id].append(
                        EncryptedShare(peer_site_id=sender, ciphertext=share.ciphertext)
                    )
        return {site: SharesForRecipient(shares=tuple(shares)) for site, shares in inbox.items()}
