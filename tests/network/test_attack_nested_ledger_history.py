"""A site (any holder of a site certificate) sends the coordinator a "ledger history"
nested 50,000 levels deep: the coordinator's JSON parser answers INVALID_ARGUMENT with
a clear message (before, RecursionError reached the servicer: INTERNAL), and goes on
serving, the same site's genuine history included. Live coordinator, real mTLS."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import grpc

from common.core.parsing import MAX_DEPTH
from common.privacy.accountant import Segment
from common.privacy.ledger import LedgerSigner, PrivacyLedger
from common.proto.medfed.v1 import federation_pb2 as pb
from common.protocol import pki
from tests.network.conftest import InProcessCoordinator, PkiLayout, health_status, raw_stub

SERVING = 1
DEEP = 50_000  # 100 KB: within the coordinator's largest message, far past any stack


def test_attack_deeply_nested_ledger_history_at_the_coordinator(
    coordinator: Callable[..., InProcessCoordinator], pki_layout: PkiLayout, tmp_path: Path
) -> None:
    coord = coordinator()
    stub = raw_stub(pki_layout, coord.address, cert_of="a")
    hostile = b'{"format":' + b"[" * DEEP + b"]" * DEEP + b"}"
    try:
        stub.ReplicateLedger(pb.ReplicateLedgerRequest(history=hostile), timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
        assert f"nested deeper than {MAX_DEPTH} levels" in (exc.details() or "")
    else:
        raise AssertionError("the coordinator accepted a nested ledger history")
    assert health_status(pki_layout, coord.address) == SERVING

    # The same site's genuine signed history is still replicated.
    ledger = PrivacyLedger(tmp_path / "a.db", site_id="a", budget_epsilon=8.0, delta=1e-5,
                           signer=LedgerSigner.from_files(*pki.site_paths(pki_layout.root, "a")))
    ledger.reserve(1, [Segment(1.0, 0.01, 10)], now=dt.datetime.now(dt.UTC))
    reply = stub.ReplicateLedger(
        pb.ReplicateLedgerRequest(history=ledger.export().to_bytes()), timeout=30)
    assert reply.ledger_seq_held == 1
