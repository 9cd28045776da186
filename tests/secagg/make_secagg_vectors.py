"""Generate the pinned SecAgg+ vectors once; they are checked in.

Run from the repository root: ``.venv/bin/python tests/secagg/make_secagg_vectors.py``.
Re-running must reproduce tests/vectors/pinned_secagg.json byte for byte; a difference
means the wire-level behaviour (session id, neighbour graph, signed messages, masks)
changed, so sites and coordinators of different versions could no longer interoperate.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from secagg_harness import make_federation  # noqa: E402

from common.crypto.random import DeterministicRandom  # noqa: E402
from common.protocol.secagg.graph import neighbourhoods  # noqa: E402
from common.protocol.secagg.messages import (  # noqa: E402
    RosterEntry,
    advertise_message,
    survivors_message,
)
from common.protocol.secagg.params import SecAggParams  # noqa: E402
from common.protocol.secagg.session import session_id  # noqa: E402

OUTPUT = HERE.parent / "vectors" / "pinned_secagg.json"
SITES = tuple(f"site-{i:03d}" for i in range(12))
ANNOUNCEMENT_DIGEST = hashlib.sha256(b"pinned-announcement").digest()


def fixed_params() -> SecAggParams:
    return SecAggParams(
        round_number=42,
        round_nonce=bytes(range(16)),
        participants=SITES,
        threshold=3,
        neighbours=4,
        vector_length=1000,
        announcement_digest=ANNOUNCEMENT_DIGEST,
    )


def fixed_roster() -> list[RosterEntry]:
    rng = DeterministicRandom(b"pinned-roster")
    return [RosterEntry(site, rng(32), rng(32), b"", b"") for site in SITES]


def masked_digests() -> dict[str, str]:
    """SHA-256 of every site's masked input in a deterministic 5-site round."""
    federation = make_federation(
        5,
        threshold=3,
        vector_length=1000,
        seed=b"pinned",
        announcement_digest=ANNOUNCEMENT_DIGEST,
    )
    server = federation.server
    assert server is not None
    clients = federation.clients
    for site, client in clients.items():
        server.receive_advertisement(
            site, client.advertise_keys(), certificate_der=federation.certificate(site)
        )
    roster = server.close_advertise()
    for site in clients:
        server.receive_shares(site, clients[site].receive_roster(roster))
    inboxes = server.close_shares()
    digests = {}
    for index, site in enumerate(clients):
        vector = np.arange(index, index + 1000, dtype=np.uint32)
        masked = clients[site].receive_shares(inboxes[site], vector)
        digests[site] = hashlib.sha256(masked.vector.astype("<u4").tobytes()).hexdigest()
    return digests


def build() -> dict[str, object]:
    params = fixed_params()
    roster = fixed_roster()
    sid = session_id(params, roster)
    graph = neighbourhoods(sid, SITES, params.neighbours)
    return {
        "description": "SecAgg+ wire-level pins (see tests/secagg/make_secagg_vectors.py)",
        "roster_seed": "pinned-roster",
        "session_id": sid.hex(),
        "graph_k4": {site: list(peers) for site, peers in graph.items()},
        "advertise_message_sha256": hashlib.sha256(
            advertise_message(
                round_number=42,
                round_nonce=bytes(range(16)),
                site_id="site-000",
                encryption_public_key=roster[0].encryption_public_key,
                masking_public_key=roster[0].masking_public_key,
                announcement_digest=ANNOUNCEMENT_DIGEST,
            )
        ).hexdigest(),
        "survivors_message_sha256": hashlib.sha256(
            survivors_message(
                round_number=42, session_id=sid, survivors=SITES[:10], dropped=SITES[10:]
            )
        ).hexdigest(),
        "masked_input_sha256": masked_digests(),
    }


if __name__ == "__main__":
    OUTPUT.write_text(json.dumps(build(), indent=2, sort_keys=True) + "\n")
    print(f"wrote {OUTPUT}")
