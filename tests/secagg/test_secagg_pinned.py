"""Wire-level compatibility: session id, graph, signed messages and masks are pinned."""

from __future__ import annotations

import json
from pathlib import Path

from make_secagg_vectors import OUTPUT, build


def test_pinned_secagg_vectors_still_hold() -> None:
    pinned = json.loads(Path(OUTPUT).read_text())
    current = build()
    for key in (
        "session_id",
        "graph_k4",
        "advertise_message_sha256",
        "survivors_message_sha256",
        "masked_input_sha256",
    ):
        assert current[key] == pinned[key], key
