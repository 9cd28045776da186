"""RequireCertificateRole over real mTLS sockets: every RPC shape is guarded, Health
too, and each certificate role reaches only the methods `ACCESS_RULES` gives it.

Decision (documented in docs/pki.md): sites may call Health and reflection as well as
the Federation service; monitors call Health, reflection and read-only status only; a
coordinator-role certificate calls nothing; a revoked certificate of any role nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from bench.instrumented import flat_model
from common.core.config import CoordinatorSettings
from common.core.errors import CertificateRejected
from common.protocol import pki, tls
from common.protocol.pki import Role
from coordinator.service import start
from tests.pki.credentials import monitor_credentials, site_credentials

TEST_RULES: Mapping[str, frozenset[Role]] = {
    "/medfed.test.Identity/": frozenset({Role.SITE}),
    tls.HEALTH_PREFIX: frozenset({Role.SITE, Role.MONITOR}),
}


@pytest.fixture
def monitor_pki(pki_dir: Path, now: dt.datetime) -> Path:
    pki.issue_monitor(pki_dir, "probe", now=now)
    return pki_dir


def _identity_handlers() -> grpc.GenericRpcHandler:
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

    return grpc.method_handlers_generic_handler(
        "medfed.test.Identity",
        {
            "WhoAmI": grpc.unary_unary_rpc_method_handler(who_am_i),
            "EchoIds": grpc.stream_stream_rpc_method_handler(echo_ids),
            "CountTo": grpc.unary_stream_rpc_method_handler(count_to),
            "Upload": grpc.stream_unary_rpc_method_handler(upload),
        },
    )


def _status_handlers() -> list[grpc.GenericRpcHandler]:
    """Stand-ins under the real service names: whoever gets in learns its own identity."""

    async def describe(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        identity = tls.current_identity()
        return f"{identity.role.value}:{identity.name}".encode()

    return [
        grpc.method_handlers_generic_handler(
            "medfed.v1.Federation",
            {
                "Enroll": grpc.unary_unary_rpc_method_handler(describe),
                "Status": grpc.unary_unary_rpc_method_handler(describe),
            },
        ),
        grpc.method_handlers_generic_handler(
            "medfed.v1.Monitor", {"Status": grpc.unary_unary_rpc_method_handler(describe)}
        ),
        grpc.method_handlers_generic_handler(
            "medfed.v1.Unlisted", {"Anything": grpc.unary_unary_rpc_method_handler(describe)}
        ),
    ]


@contextlib.asynccontextmanager
async def guarded_server(
    pki_dir: Path, *, rules: Mapping[str, frozenset[Role]] = tls.ACCESS_RULES
) -> AsyncIterator[str]:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    server = grpc.aio.server(interceptors=[tls.RequireCertificateRole(verifier, rules=rules)])
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        (health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    server.add_generic_rpc_handlers((_identity_handlers(), *_status_handlers()))
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(pki_dir))
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def _requests(*items: bytes) -> AsyncIterator[bytes]:
    for item in items:
        yield item


async def _code(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def _refusal(call: object) -> str:
    """The details of a refused call (AssertionError if it was served)."""
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    raise AssertionError("the call was served")


async def _reflection_code(channel: grpc.aio.Channel) -> grpc.StatusCode:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _health(channel: grpc.aio.Channel) -> object:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


def test_every_rpc_shape_sees_the_certificate_identity(pki_dir: Path) -> None:
    async def scenario() -> None:
        async with (
            guarded_server(pki_dir, rules=TEST_RULES) as address,
            grpc.aio.secure_channel(address, site_credentials(pki_dir, "h1")) as channel,
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
            guarded_server(pki_dir, rules=TEST_RULES) as address,
            grpc.aio.secure_channel(address, site_credentials(pki_dir, "h1")) as channel,
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
                    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert "revoked" in (exc.details() or "")
                else:
                    raise AssertionError("revoked site was served")
            counted = channel.unary_stream("/medfed.test.Identity/CountTo")(b"2", timeout=5)
            try:
                _ = [item async for item in counted]
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
            else:
                raise AssertionError("revoked site was served a stream")

    asyncio.run(scenario())


def test_monitor_calls_health_reflection_and_status_but_no_federation_rpc(
    monitor_pki: Path,
) -> None:
    async def scenario() -> None:
        credentials = monitor_credentials(monitor_pki, "probe")
        async with (
            guarded_server(monitor_pki) as address,
            grpc.aio.secure_channel(address, credentials) as channel,
        ):
            assert await _code(_health(channel)) == grpc.StatusCode.OK
            assert await _reflection_code(channel) == grpc.StatusCode.OK
            for method in ("/medfed.v1.Federation/Status", "/medfed.v1.Monitor/Status"):
                assert await channel.unary_unary(method)(b"", timeout=5) == b"monitor:probe"
            for method in ("/medfed.v1.Federation/Enroll", "/medfed.v1.Unlisted/Anything"):
                refusal = await _refusal(channel.unary_unary(method)(b"", timeout=5))
                assert refusal == (
                    "PERMISSION_DENIED: a monitor certificate may not call this method"
                )

    asyncio.run(scenario())


def test_site_calls_federation_and_health_but_not_the_monitor_service(pki_dir: Path) -> None:
    async def scenario() -> None:
        async with (
            guarded_server(pki_dir) as address,
            grpc.aio.secure_channel(address, site_credentials(pki_dir, "h2")) as channel,
        ):
            assert await channel.unary_unary("/medfed.v1.Federation/Enroll")(
                b"", timeout=5
            ) == b"site:h2"
            assert await _code(_health(channel)) == grpc.StatusCode.OK
            assert (
                await _code(channel.unary_unary("/medfed.v1.Monitor/Status")(b"", timeout=5))
                == grpc.StatusCode.PERMISSION_DENIED
            )

    asyncio.run(scenario())


def test_revoked_monitor_refused_for_health_and_reflection(monitor_pki: Path) -> None:
    async def scenario() -> None:
        credentials = monitor_credentials(monitor_pki, "probe")
        async with (
            guarded_server(monitor_pki) as address,
            grpc.aio.secure_channel(address, credentials) as channel,
        ):
            assert await _code(_health(channel)) == grpc.StatusCode.OK
            pki.revoke(monitor_pki, Role.MONITOR, "probe", now=dt.datetime.now(dt.UTC))
            refusal = await _refusal(_health(channel))
            assert refusal.startswith("PERMISSION_DENIED") and "revoked" in refusal
            assert await _reflection_code(channel) == grpc.StatusCode.PERMISSION_DENIED
            # The other roles are untouched by a monitor's revocation.
        async with (
            guarded_server(monitor_pki) as address,
            grpc.aio.secure_channel(address, site_credentials(monitor_pki, "h1")) as site,
        ):
            assert await _code(_health(site)) == grpc.StatusCode.OK

    asyncio.run(scenario())


def _coordinator_role_client_pair(pki_dir: Path, now: dt.datetime) -> tuple[bytes, bytes]:
    """A CA-signed certificate naming the *coordinator* role but usable as a TLS client
    (clientAuth): what a careless operator might mint for the coordinator's own probe."""
    ca_cert = pki.load_ca(pki_dir)
    ca_key = pki.load_private_key_file(pki_dir / pki.CA_KEY)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "coordinator")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier("medfed://coordinator/coordinator")]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def test_coordinator_role_certificate_calls_nothing(pki_dir: Path, now: dt.datetime) -> None:
    cert_pem, key_pem = _coordinator_role_client_pair(pki_dir, now)

    async def scenario() -> None:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=(pki_dir / pki.CA_CERT).read_bytes(),
            private_key=key_pem,
            certificate_chain=cert_pem,
        )
        async with (
            guarded_server(pki_dir) as address,
            grpc.aio.secure_channel(address, credentials) as channel,
        ):
            for call in (
                _health(channel),
                channel.unary_unary("/medfed.v1.Federation/Enroll")(b"", timeout=5),
                channel.unary_unary("/medfed.v1.Monitor/Status")(b"", timeout=5),
            ):
                assert await _code(call) == grpc.StatusCode.PERMISSION_DENIED
            assert await _reflection_code(channel) == grpc.StatusCode.PERMISSION_DENIED

    asyncio.run(scenario())


def test_no_certificate_and_foreign_ca_refused_at_the_handshake(
    pki_dir: Path, foreign_dir: Path
) -> None:
    """The interceptor never sees them: TLS refuses the connection (UNAVAILABLE)."""

    async def scenario() -> None:
        no_cert = grpc.ssl_channel_credentials(
            root_certificates=(pki_dir / pki.CA_CERT).read_bytes()
        )
        foreign_cert, foreign_key = pki.site_paths(foreign_dir, "h1")
        foreign = grpc.ssl_channel_credentials(
            root_certificates=(pki_dir / pki.CA_CERT).read_bytes(),
            private_key=foreign_key.read_bytes(),
            certificate_chain=foreign_cert.read_bytes(),
        )
        async with guarded_server(pki_dir) as address:
            for credentials in (no_cert, foreign):
                async with grpc.aio.secure_channel(address, credentials) as channel:
                    assert await _code(_health(channel)) == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_the_coordinator_installs_the_role_interceptor(
    monitor_pki: Path, tmp_path: Path
) -> None:
    """`coordinator.service.start` itself: a monitor gets Health, not Enroll."""
    from common.proto.medfed.v1 import federation_pb2 as pb
    from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc

    settings = CoordinatorSettings(
        pki=monitor_pki,
        listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        state=tmp_path / "state",
        rounds=1,
        min_sites=3,
    )

    async def scenario() -> None:
        running = await start(settings, model_without_study=flat_model(8))
        try:
            address = f"127.0.0.1:{running.port}"
            credentials = monitor_credentials(monitor_pki, "probe")
            async with grpc.aio.secure_channel(address, credentials) as channel:
                assert await _code(_health(channel)) == grpc.StatusCode.OK
                stub = pb_grpc.FederationStub(channel)  # type: ignore[no-untyped-call]
                enroll = stub.Enroll(pb.EnrollRequest(), timeout=5)
                assert await _code(enroll) == grpc.StatusCode.PERMISSION_DENIED
                pki.revoke(monitor_pki, Role.MONITOR, "probe", now=dt.datetime.now(dt.UTC))
                assert "revoked" in await _refusal(_health(channel))
        finally:
            await running.stop()

    asyncio.run(scenario())


def test_access_rules_longest_prefix_and_default_deny() -> None:
    assert tls.allowed_roles("/medfed.v1.Federation/Enroll") == {Role.SITE}
    assert Role.MONITOR in tls.allowed_roles("/medfed.v1.Federation/Status")
    assert tls.allowed_roles("/grpc.health.v1.Health/Check") == {Role.SITE, Role.MONITOR}
    assert tls.allowed_roles("/medfed.v1.Other/Thing") == frozenset()
    assert all(Role.COORDINATOR not in roles for roles in tls.ACCESS_RULES.values())


def test_current_site_id_outside_a_call_is_an_error() -> None:
    with pytest.raises(CertificateRejected):
        tls.current_site_id()
    with pytest.raises(CertificateRejected):
        tls.current_identity()
