"""Real mutual-TLS sockets: a grpc.aio server on 127.0.0.1:0 with Health and a WhoAmI RPC.

WhoAmI answers with the caller's site id as `authenticate_peer` derives it from the
verified peer certificate; the request body claims another site and is ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pydantic
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.core.config import SiteSettings
from common.core.errors import CertificateRejected, PkiError
from common.protocol import pki, tls
from tests.pki.credentials import site_credentials

WHOAMI = "/medfed.test.Identity/WhoAmI"


@contextlib.asynccontextmanager
async def serving(pki_dir: Path) -> AsyncIterator[str]:
    """Start the coordinator-shaped test server; yield its address."""
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)

    async def who_am_i(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            site_id = tls.authenticate_peer(
                context.auth_context(), verifier, now=dt.datetime.now(dt.UTC)
            )
        except CertificateRejected as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        return site_id.encode()

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "medfed.test.Identity",
                {"WhoAmI": grpc.unary_unary_rpc_method_handler(who_am_i)},
            ),
        )
    )
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(pki_dir))
    assert port > 0
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def _health(address: str, creds: grpc.ChannelCredentials) -> grpc.StatusCode:
    async with grpc.aio.secure_channel(address, creds) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        return grpc.StatusCode.OK


async def _whoami(address: str, creds: grpc.ChannelCredentials) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.secure_channel(address, creds) as channel:
        call = channel.unary_unary(WHOAMI)
        try:
            reply = await call(b"claimed-site: h2", timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, reply.decode()


def _raw_creds(
    ca: Path, cert: Path | None = None, key: Path | None = None
) -> grpc.ChannelCredentials:
    """Client credentials built without our start-up checks (to play a hostile client)."""
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )


def test_valid_site_gets_its_own_id_from_the_certificate(pki_dir: Path) -> None:
    async def scenario() -> None:
        async with serving(pki_dir) as address:
            creds = site_credentials(pki_dir, "h1")
            assert await _health(address, creds) == grpc.StatusCode.OK
            assert await _whoami(address, creds) == (grpc.StatusCode.OK, "h1")

    asyncio.run(scenario())


def test_client_without_certificate_refused_at_handshake(pki_dir: Path) -> None:
    async def scenario() -> None:
        async with serving(pki_dir) as address:
            creds = _raw_creds(pki_dir / "ca.crt")
            assert await _health(address, creds) == grpc.StatusCode.UNAVAILABLE
            code, _ = await _whoami(address, creds)
            assert code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_client_certificate_from_foreign_ca_refused(pki_dir: Path, foreign_dir: Path) -> None:
    async def scenario() -> None:
        async with serving(pki_dir) as address:
            creds = _raw_creds(
                pki_dir / "ca.crt", foreign_dir / "sites/h1.crt", foreign_dir / "sites/h1.key"
            )
            code, _ = await _whoami(address, creds)
            assert code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_site_refuses_coordinator_from_foreign_ca(pki_dir: Path, foreign_dir: Path) -> None:
    # A server with a certificate from another CA cannot pose as the coordinator.
    async def scenario() -> None:
        async with serving(foreign_dir) as address:
            code, _ = await _whoami(address, site_credentials(pki_dir, "h1"))
            assert code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_expired_client_certificate_refused(pki_dir: Path, now: dt.datetime) -> None:
    pki.issue_site(pki_dir, "old", validity_days=1, now=now - dt.timedelta(days=3))
    # Our own loader refuses to start with it...
    with pytest.raises(PkiError, match="expired"):
        site_credentials(pki_dir, "old")

    # ...and a client that presents it anyway is refused by the server.
    async def scenario() -> None:
        async with serving(pki_dir) as address:
            creds = _raw_creds(
                pki_dir / "ca.crt", pki_dir / "sites/old.crt", pki_dir / "sites/old.key"
            )
            code, _ = await _whoami(address, creds)
            assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)

    asyncio.run(scenario())


def test_revoked_after_server_start_is_refused_without_restart(pki_dir: Path) -> None:
    async def scenario() -> None:
        async with serving(pki_dir) as address:
            creds = site_credentials(pki_dir, "h1")
            assert await _whoami(address, creds) == (grpc.StatusCode.OK, "h1")
            pki.revoke_site(pki_dir, "h1")
            code, details = await _whoami(address, creds)
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert "revoked" in details
            # Other sites keep working on the same server.
            assert await _whoami(address, site_credentials(pki_dir, "h2")) == (
                grpc.StatusCode.OK,
                "h2",
            )

    asyncio.run(scenario())


def test_ed25519_ca_with_p256_leaves_over_mtls(tmp_path: Path) -> None:
    pki.init_ca(tmp_path, algorithm="ed25519")
    pki.issue_coordinator(tmp_path, ["127.0.0.1"])
    pki.issue_site(tmp_path, "h1")

    async def scenario() -> None:
        async with serving(tmp_path) as address:
            creds = site_credentials(tmp_path, "h1")
            assert await _whoami(address, creds) == (grpc.StatusCode.OK, "h1")

    asyncio.run(scenario())


def test_ed25519_leaf_refused_at_startup_with_reason(tmp_path: Path) -> None:
    pki.init_ca(tmp_path, algorithm="ed25519")
    pki.issue_site(tmp_path, "h1", algorithm="ed25519")
    pki.issue_coordinator(tmp_path, ["127.0.0.1"], algorithm="ed25519")
    with pytest.raises(PkiError, match="ecdsa-p256"):
        site_credentials(tmp_path, "h1")
    with pytest.raises(PkiError, match="ecdsa-p256"):
        tls.server_credentials(tmp_path)


# --------------------------------------------------------------------------- start-up checks


def test_hospital_container_with_only_its_own_files(pki_dir: Path, tmp_path: Path) -> None:
    mount = tmp_path / "mount"
    mount.mkdir()
    for source in (pki_dir / "ca.crt", pki_dir / "sites/h1.crt", pki_dir / "sites/h1.key"):
        shutil.copy(source, mount / source.name)
    files = tls.TlsFiles(role=pki.Role.SITE, ca=mount / "ca.crt", cert=mount / "h1.crt",
                         key=mount / "h1.key")
    material = tls.load_tls_material(files)
    assert pki.site_id_from_certificate(material.certificate) == "h1"

    async def scenario() -> None:
        async with serving(pki_dir) as address:
            creds = tls.channel_credentials_from_files(files)
            assert await _whoami(address, creds) == (grpc.StatusCode.OK, "h1")

    asyncio.run(scenario())


def test_startup_errors_are_specific(pki_dir: Path, foreign_dir: Path) -> None:
    sites = pki_dir / "sites"
    ca = pki_dir / "ca.crt"
    site = functools.partial(tls.TlsFiles, role=pki.Role.SITE)
    cases: list[tuple[tls.TlsFiles, str]] = [
        (site(ca=ca, cert=sites / "h9.crt", key=sites / "h1.key"), "does not exist"),
        (site(ca=ca, cert=sites / "h1.crt", key=sites / "h2.key"), "does not match"),
        (
            site(ca=ca, cert=foreign_dir / "sites/h1.crt", key=foreign_dir / "sites/h1.key"),
            "not signed by the federation CA",
        ),
        (
            site(ca=ca, cert=pki_dir / "coordinator.crt", key=pki_dir / "coordinator.key"),
            "not a site",
        ),
        (
            tls.TlsFiles(role=pki.Role.COORDINATOR, ca=ca, cert=sites / "h1.crt",
                         key=sites / "h1.key"),
            "not a coordinator",
        ),
        (site(ca=ca, cert=ca, key=sites / "h1.key"), "does not match"),
        (
            site(ca=sites / "h1.key", cert=sites / "h1.crt", key=sites / "h1.key"),
            "not a PEM certificate",
        ),
    ]
    for files, message in cases:
        with pytest.raises(PkiError, match=message):
            tls.load_tls_material(files)


def test_not_yet_valid_certificate_refused_at_startup(pki_dir: Path, now: dt.datetime) -> None:
    pki.issue_site(pki_dir, "early", now=now + dt.timedelta(days=2))
    with pytest.raises(PkiError, match="not valid yet"):
        site_credentials(pki_dir, "early")
    # Passing `now` lets a caller check a future deployment date.
    assert tls.load_tls_material(
        tls.TlsFiles.for_site(pki_dir, "early"), now=now + dt.timedelta(days=3)
    )


def test_authenticate_peer_without_certificate(pki_dir: Path, now: dt.datetime) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    assert tls.peer_certificate_pem({}) is None
    assert tls.peer_certificate_pem({"x509_pem_cert": [b""]}) is None
    for context in ({}, {"transport_security_type": [b"ssl"]}):
        with pytest.raises(CertificateRejected, match="no client certificate"):
            tls.authenticate_peer(context, verifier, now=now)
    pem = (pki_dir / "sites/h2.crt").read_bytes()
    assert tls.authenticate_peer({"x509_pem_cert": [pem]}, verifier, now=now) == "h2"


def test_explicit_tls_files_override_the_pki_folder(pki_dir: Path, tmp_path: Path) -> None:
    """`medfed site run`: --tls-ca/--tls-cert/--tls-key win over --pki, whose layout is
    the one `medfed pki` writes."""
    base: dict[str, Any] = {"site": "h1", "coordinator": "localhost:7443",
                            "state": tmp_path / "state"}
    layout = tls.TlsFiles.for_site(pki_dir, "h1")
    from_dir = SiteSettings(pki=pki_dir, **base).tls_paths()
    assert from_dir == (layout.ca, layout.cert, layout.key)
    other_key = tmp_path / "elsewhere.key"
    overridden = SiteSettings(pki=pki_dir, tls_key=other_key, **base).tls_paths()
    assert overridden == (layout.ca, layout.cert, other_key)
    mounted = SiteSettings(tls_ca=tmp_path / "ca", tls_cert=tmp_path / "c",
                           tls_key=tmp_path / "k", **base).tls_paths()
    assert mounted == (tmp_path / "ca", tmp_path / "c", tmp_path / "k")
    with pytest.raises(pydantic.ValidationError, match="all of tls_ca, tls_cert and tls_key"):
        SiteSettings(tls_ca=tmp_path / "ca", **base)


def test_credentials_refuse_files_of_the_wrong_side(pki_dir: Path) -> None:
    """A site's (valid) pair never serves the federation port, nor the coordinator's
    pair dials it as a client."""
    with pytest.raises(PkiError, match="coordinator's files"):
        tls.server_credentials_from_files(tls.TlsFiles.for_site(pki_dir, "h1"))
    with pytest.raises(PkiError, match="a site's or a monitor's files"):
        tls.channel_credentials_from_files(tls.TlsFiles.for_coordinator(pki_dir))
