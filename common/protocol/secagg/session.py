"""The session id: one hash that pins a round's announcement, parameters and roster of keys.

It salts every HKDF derivation and is bound into every AEAD associated data and every
survivor-set signature, so nothing from one round (or one roster) can be replayed into
another (Bonawitz et al. 2017, sec. 4: "session id" bound into each message).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from common.crypto.encoding import encode_fields
from common.protocol.secagg.messages import RosterEntry
from common.protocol.secagg.params import SecAggParams

SESSION_ID_BYTES = 32
_SESSION_LABEL = "medfed/v1/secagg/session"


def session_id(params: SecAggParams, roster: Iterable[RosterEntry]) -> bytes:
    """SHA-256 over the canonical encoding of params and the roster sorted by site id.

    Includes the announcement digest and the participants, so sites that were told
    different stories never share a session id: their pairwise masks, share keys and
    survivor-list signatures then cannot combine. Counts precede
    the two lists so that the encoding stays injective.
    """
    entries = sorted(roster, key=lambda e: e.site_id)
    fields: list[bytes | str | int] = [
        _SESSION_LABEL,
        params.round_number,
        params.round_nonce,
        params.announcement_digest,
        params.threshold,
        params.neighbours,
        params.vector_length,
        len(params.participants),
        *params.participants,
        len(entries),
    ]
    for entry in entries:
        fields += [entry.site_id, entry.encryption_public_key, entry.masking_public_key]
    return hashlib.sha256(encode_fields(*fields)).digest()
