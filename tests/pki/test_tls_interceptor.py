"""RequireSiteCertificate over real mTLS sockets: every RPC shape is guarded, Health too."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import pki, tls
from common.errors import CertificateRejected


@contextlib.asynccontextmanager
async def guarded_server(pki_dir: Path) -> AsyncIterator[str]:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)

    async def who_am_i(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        # The request body claims to be someone; the answer comes from the certificate.
        return tls.current_site_id().encode()

    async def echo_ids(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for _ in requests:
            yield tls.current_site_id().encode()

    async def count_to(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for index in range(int(request)):
            yield f"{tls.current_site_id()}:{index}".encode()

    async def upload(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        total = 0
        async for chunk in requests:
            total += len(chunk)
        return f"{tls.current_site_id()}:{total}".encode()

    server = grpc.aio.server(interceptors=[tls.RequireSiteCertificate(verifier)])
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "medfed.test.Identity",
                {
                    "WhoAmI": grpc.unary_unary_rpc_method_handler(who_am_i),
                    "EchoIds": grpc.stream_stream_rpc_method_handler(echo_ids),
                    "CountTo": grpc.unary_stream_rpc_method_handler(count_to),
                    "Upload": grpc.stream_unary_rpc_method_handler(upload),
                },
            ),
        )
    )
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(pki_dir))
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def _requests(*items: bytes) -> AsyncIterator[bytes]:
    for item in items:
        yield item


def test_every_rpc_shape_sees_the_certificate_identity(pki_dir: Path) -> None:
    async def scenario() -> None:
        async with (
            guarded_server(pki_dir) as address,
            grpc.aio.secure_channel(address, tls.channel_credentials(pki_dir, "h1")) as channel,
        ):
            assert (
                await channel.unary_unary("/medfed.test.Identity/WhoAmI")(b"i am h2", timeout=5)
                == b"h1"
            )
            streamed = channel.stream_stream("/medfed.test.Identity/EchoIds")(
                _requests(b"a", b"b"), timeout=5
            )
            assert [item async for item in streamed] == [b"h1", b"h1"]
            counted = channel.unary_stream("/medfed.test.Identity/CountTo")(b"3", timeout=5)
            assert [item async for item in counted] == [b"h1:0", b"h1:1", b"h1:2"]
            uploaded = await channel.stream_unary("/medfed.test.Identity/Upload")(
                _requests(b"xx", b"yyy"), timeout=5
            )
            assert uploaded == b"h1:5"
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # Watch streams with context.write(): the coroutine-shaped path.
            watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=5)
            first = await watch.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()

    asyncio.run(scenario())


def test_revoked_site_refused_on_every_rpc_including_health(pki_dir: Path) -> None:
    async def scenario() -> None:
        async with (
            guarded_server(pki_dir) as address,
            grpc.aio.secure_channel(address, tls.channel_credentials(pki_dir, "h1")) as channel,
        ):
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            pki.revoke_site(pki_dir, "h1", now=dt.datetime.now(dt.UTC))
            calls = [
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5),
                channel.unary_unary("/medfed.test.Identity/WhoAmI")(b"", timeout=5),
                channel.stream_unary("/medfed.test.Identity/Upload")(_requests(b"x"), timeout=5),
            ]
            for call in calls:
                try:
                    await call
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert "revoked" in (exc.details() or "")
                else:
                    raise AssertionError("revoked site was served")
            counted = channel.unary_stream("/medfed.test.Identity/CountTo")(b"2", timeout=5)
            try:
                _ = [item async for item in counted]
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
            else:
                raise AssertionError("revoked site was served a stream")

    asyncio.run(scenario())


def test_current_site_id_outside_a_call_is_an_error() -> None:
    with pytest.raises(CertificateRejected):
        tls.current_site_id()
