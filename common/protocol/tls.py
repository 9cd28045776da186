"""Mutual-TLS credentials for gRPC and the caller's identity from its certificate.

There is one mode: the coordinator requires a client certificate signed by the
federation CA (``require_client_auth=True``); no insecure port exists. Files are
checked at start-up so that a misconfigured hospital container fails with one clear
`PkiError` (missing file, key not matching the certificate, expired, foreign CA)
instead of an opaque handshake failure later.

After the handshake, `authenticate_peer` re-verifies the peer certificate with a
`PeerVerifier` (CRL, clientAuth, site id) and returns the site id: the caller's
identity comes from here, never from a message field (docs/pki.md, "In code").
The servicer maps `CertificateRejected` to UNAUTHENTICATED in its one error mapper.

`RequireCertificateRole`, installed on the coordinator's server, decides per method
which certificate roles may call it (`ACCESS_RULES`): sites the Federation service,
monitors Health, reflection and read-only status; revoked certificates nothing. Each
refusal is handed to its `on_refused` callback (`Refusal`) before the call is aborted:
the coordinator logs and counts it (coordinator/refusals.py), since no servicer runs.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import inspect
import logging
import os
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from common.core.errors import CertificateRejected, PkiError
from common.protocol.pki import (
    CA_CERT,
    COORDINATOR_CERT,
    COORDINATOR_KEY,
    CertificateIdentity,
    PeerVerifier,
    Role,
    certificate_identity,
    check_issued_by,
    check_validity_window,
    has_extended_key_usage,
    monitor_paths,
    parse_certificate,
    read_private_key_pem,
    site_paths,
)

log = logging.getLogger("medfed.tls")

# Key of the PEM peer certificate in gRPC's `ServicerContext.auth_context()`.
PEER_CERT_KEY = "x509_pem_cert"


@dataclass(frozen=True)
class TlsMaterial:
    """Validated PEM bytes, ready for gRPC."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    certificate: x509.Certificate


@dataclass(frozen=True, kw_only=True)
class TlsFiles:
    """The PEM files one party mounts: the federation CA certificate and its own
    certificate and key, which must carry `role` (a hospital container mounts its
    three, e.g. ``--tls-ca``, ``--tls-cert``, ``--tls-key``)."""

    role: Role
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def for_site(cls, directory: str | os.PathLike[str], site_id: str) -> TlsFiles:
        """A site's files in a `medfed pki` folder."""
        cert, key = site_paths(directory, site_id)
        return cls(role=Role.SITE, ca=Path(directory) / CA_CERT, cert=cert, key=key)

    @classmethod
    def for_monitor(cls, directory: str | os.PathLike[str], name: str) -> TlsFiles:
        """A monitor's client files (health probe, status dashboard) in a PKI folder."""
        cert, key = monitor_paths(directory, name)
        return cls(role=Role.MONITOR, ca=Path(directory) / CA_CERT, cert=cert, key=key)

    @classmethod
    def for_coordinator(cls, directory: str | os.PathLike[str]) -> TlsFiles:
        """The coordinator's server pair in a PKI folder."""
        root = Path(directory)
        return cls(role=Role.COORDINATOR, ca=root / CA_CERT, cert=root / COORDINATOR_CERT,
                   key=root / COORDINATOR_KEY)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PkiError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise PkiError(f"cannot read {what} {path}: {exc.strerror}") from None


def load_tls_material(files: TlsFiles, *, now: dt.datetime | None = None) -> TlsMaterial:
    """Read and cross-check CA, certificate and key; PkiError saying what is wrong.

    `now` defaults to the wall clock: this runs once at service start-up, not inside
    protocol code.
    """
    moment = now if now is not None else dt.datetime.now(dt.UTC)
    ca_pem = _read(files.ca, "CA certificate")
    cert_pem = _read(files.cert, "certificate")
    # Refuses a key file that group or others can read (names the file and the fix).
    key_pem = read_private_key_pem(files.key)
    try:
        ca_cert = x509.load_pem_x509_certificate(ca_pem)
    except ValueError:
        raise PkiError(f"{files.ca} is not a PEM certificate") from None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise PkiError(f"{files.cert} is not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise PkiError(f"{files.key} is not an unencrypted PEM private key") from None
    if key.public_key() != cert.public_key():
        raise PkiError(f"private key {files.key} does not match certificate {files.cert}")
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        # Measured with grpcio 1.85: its BoringSSL build offers no Ed25519 signature
        # scheme, so an Ed25519 leaf fails every handshake (NO_COMMON_SIGNATURE_ALGORITHMS).
        # An Ed25519 *CA* is fine: chain signatures are checked outside the handshake.
        raise PkiError(
            f"{files.key} is not an EC P-256 key; gRPC's TLS cannot use Ed25519 leaf keys: "
            "re-issue this certificate with --algorithm ecdsa-p256"
        )
    try:
        check_validity_window(ca_cert, moment, what=f"CA certificate {files.ca}")
        check_validity_window(cert, moment, what=f"certificate {files.cert}")
        check_issued_by(cert, ca_cert, what=f"certificate {files.cert}")
    except CertificateRejected as exc:
        raise PkiError(str(exc)) from None
    expected = files.role
    usage = (
        ExtendedKeyUsageOID.SERVER_AUTH
        if expected is Role.COORDINATOR
        else ExtendedKeyUsageOID.CLIENT_AUTH
    )
    if not has_extended_key_usage(cert, usage):
        kind = "serverAuth" if expected is Role.COORDINATOR else "clientAuth"
        raise PkiError(f"{files.cert} is not a {expected.value} ({kind}) certificate")
    try:
        identity = certificate_identity(cert)
    except CertificateRejected as exc:
        raise PkiError(
            f"{files.cert}: {exc} (re-issue it: certificates name their role, "
            f"{ROLE_URI_HINT[expected]})"
        ) from None
    if identity.role is not expected:
        raise PkiError(
            f"{files.cert} is a {identity.role.value} certificate ({identity.name!r}), "
            f"not a {expected.value} certificate"
        )
    return TlsMaterial(ca_pem=ca_pem, cert_pem=cert_pem, key_pem=key_pem, certificate=cert)


ROLE_URI_HINT = {
    Role.SITE: "medfed://site/ID from `medfed pki request` + `medfed pki sign`",
    Role.MONITOR: "medfed://monitor/NAME from `medfed pki issue --monitor NAME`",
    Role.COORDINATOR: "medfed://coordinator/NAME from `medfed pki issue --coordinator HOSTS`",
}


def server_credentials_from_files(
    files: TlsFiles, *, now: dt.datetime | None = None
) -> grpc.ServerCredentials:
    """Coordinator credentials: own pair, CA as the only trust root, client certs required."""
    if files.role is not Role.COORDINATOR:
        raise PkiError(f"{files.cert}: a server needs the coordinator's files, not a "
                       f"{files.role.value}'s")
    material = load_tls_material(files, now=now)
    return grpc.ssl_server_credentials(
        [(material.key_pem, material.cert_pem)],
        root_certificates=material.ca_pem,
        require_client_auth=True,
    )


def server_credentials(
    pki_dir: str | os.PathLike[str], *, now: dt.datetime | None = None
) -> grpc.ServerCredentials:
    return server_credentials_from_files(TlsFiles.for_coordinator(pki_dir), now=now)


def channel_credentials_from_files(
    files: TlsFiles, *, now: dt.datetime | None = None
) -> grpc.ChannelCredentials:
    """Client credentials: presents the site's (or monitor's) pair, trusts only the CA."""
    if files.role is Role.COORDINATOR:
        raise PkiError(f"{files.cert}: a client needs a site's or a monitor's files, not the "
                       "coordinator's")
    material = load_tls_material(files, now=now)
    return grpc.ssl_channel_credentials(
        root_certificates=material.ca_pem,
        private_key=material.key_pem,
        certificate_chain=material.cert_pem,
    )


def server_host_names(address: str, files: TlsFiles, *, timeout: float = 10) -> list[str] | None:
    """The DNS names and IP addresses the server at HOST:PORT `address` presents in its
    certificate, read over a TLS connection that checks the chain against our CA but not
    the name: what a "Hostname Verification Check failed" error should tell the operator.
    None when they cannot be read (unreachable, another CA, no SAN)."""
    host, _, port = address.rpartition(":")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # the name is what we want to learn; the CA still counts
    try:
        context.load_verify_locations(cafile=str(files.ca))
        context.load_cert_chain(str(files.cert), str(files.key))
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as raw, \
                context.wrap_socket(raw) as tls:
            der = tls.getpeercert(binary_form=True)
        if der is None:
            return None
        san = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):  # ssl.SSLError is an OSError
        return None
    return [*san.get_values_for_type(x509.DNSName),
            *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))]


def peer_certificate_pem(auth_context: Mapping[str, Sequence[bytes]]) -> bytes | None:
    """The caller's PEM certificate from ``context.auth_context()``, or None if there is none."""
    values = auth_context.get(PEER_CERT_KEY)
    if not values:
        return None
    first = values[0]
    return first if isinstance(first, bytes) and first else None


def authenticate_peer(
    auth_context: Mapping[str, Sequence[bytes]],
    verifier: PeerVerifier,
    *,
    now: dt.datetime,
) -> str:
    """The verified site id of the caller; CertificateRejected if absent or not acceptable."""
    pem = peer_certificate_pem(auth_context)
    if pem is None:
        raise CertificateRejected("caller presented no client certificate")
    return verifier.verify(parse_certificate(pem), now=now)


# --------------------------------------------------------------------------- interceptor

FEDERATION_PREFIX = "/medfed.v1.Federation/"
MONITOR_SERVICE_PREFIX = "/medfed.v1.Monitor/"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = (
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

AccessRules = Mapping[str, frozenset[Role]]

ACCESS_RULES: AccessRules = {
    # Read-only status (hospital-data issue): a future Federation/Status method or a
    # separate Monitor service. Longer prefixes win, so Status is not a "site" method.
    FEDERATION_PREFIX + "Status": frozenset({Role.MONITOR, Role.SITE}),
    MONITOR_SERVICE_PREFIX: frozenset({Role.MONITOR}),
    # Enrolment, rounds, SecAgg: hospitals only.
    FEDERATION_PREFIX: frozenset({Role.SITE}),
    # Liveness and schema: reveal nothing about a round. Sites may call them too (a
    # hospital's operator checking reachability with grpcurl and its own certificate).
    HEALTH_PREFIX: frozenset({Role.MONITOR, Role.SITE}),
    **{prefix: frozenset({Role.MONITOR, Role.SITE}) for prefix in REFLECTION_PREFIXES},
}
"""Who may call what, keyed by full-method-name prefix (longest match wins; no match:
denied). A coordinator certificate appears nowhere: it is a server identity only."""


def allowed_roles(method: str, rules: AccessRules = ACCESS_RULES) -> frozenset[Role]:
    """The roles that may call `method` ("/package.Service/Method"); empty if none."""
    best = ""
    for prefix in rules:
        if method.startswith(prefix) and len(prefix) > len(best):
            best = prefix
    return rules[best] if best else frozenset()


_CURRENT_PEER: contextvars.ContextVar[CertificateIdentity] = contextvars.ContextVar(
    "medfed_peer_identity"
)


def current_identity() -> CertificateIdentity:
    """Inside an RPC guarded by `RequireCertificateRole`: the caller's verified identity."""
    try:
        return _CURRENT_PEER.get()
    except LookupError:
        raise CertificateRejected("no authenticated caller for this call") from None


def current_site_id() -> str:
    """Inside a guarded RPC: the caller's verified site id (CertificateRejected if the
    caller is not a site)."""
    try:
        identity = _CURRENT_PEER.get()
    except LookupError:
        raise CertificateRejected("no authenticated site for this call") from None
    if identity.role is not Role.SITE:
        raise CertificateRejected(f"the caller is a {identity.role.value}, not a site")
    return identity.name


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class Refusal:
    """One call `RequireCertificateRole` refused, for the server's log and metrics."""

    method: str  # full method name, "/package.Service/Method"
    code: grpc.StatusCode  # PERMISSION_DENIED or UNAUTHENTICATED
    reason: str
    certificate: x509.Certificate | None  # None: no (parseable) client certificate
    peer: str  # the caller's address as gRPC names it ("ipv4:10.0.0.5:51234")


class RequireCertificateRole(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """grpc.aio interceptor: every RPC (Health and reflection included) needs a valid,
    unrevoked certificate whose role `rules` allow for that method.

    The TLS handshake already refuses callers without a CA-signed certificate; this adds
    what TLS cannot see (CRL, clientAuth, role) before any handler runs. A refused
    certificate (revoked, expired CRL, wrong role) gets PERMISSION_DENIED, none at all
    UNAUTHENTICATED, as in the servicer's error mapper.
    The identity is exposed via `current_identity()` / `current_site_id()` (a context
    variable: each grpc.aio RPC runs in its own task).
    """

    def __init__(
        self,
        verifier: PeerVerifier,
        *,
        rules: AccessRules = ACCESS_RULES,
        clock: Callable[[], dt.datetime] = _utc_now,
        on_refused: Callable[[Refusal], None] | None = None,
    ) -> None:
        self._verifier = verifier
        self._rules = dict(rules)
        self._clock = clock
        self._on_refused = on_refused

    async def _refuse(
        self, context: Any, method: str, code: grpc.StatusCode, reason: str,
        certificate: x509.Certificate | None,
    ) -> None:
        """Report the refusal (no servicer runs to log or count it), then abort."""
        if self._on_refused is not None:
            peer = context.peer()
            try:
                self._on_refused(Refusal(
                    method=method, code=code, reason=reason, certificate=certificate,
                    peer=peer if isinstance(peer, str) else "unknown",
                ))
            except Exception:  # a broken reporter must not turn a refusal into a crash
                log.exception("reporting a refused call failed")
        await context.abort(code, reason)

    async def _authenticate(
        self, context: Any, method: str, allowed: frozenset[Role]
    ) -> CertificateIdentity:
        # Same codes as the Federation servicer's error mapper: no certificate at all is
        # UNAUTHENTICATED, a certificate we refuse (revoked, wrong role) PERMISSION_DENIED.
        pem = peer_certificate_pem(context.auth_context())
        if pem is None:
            await self._refuse(context, method, grpc.StatusCode.UNAUTHENTICATED,
                               "caller presented no client certificate", None)
            raise CertificateRejected("no client certificate")  # unreachable: abort raises
        certificate: x509.Certificate | None = None
        try:
            certificate = parse_certificate(pem)
            identity = self._verifier.verify_identity(certificate, now=self._clock())
        except CertificateRejected as exc:
            await self._refuse(context, method, grpc.StatusCode.PERMISSION_DENIED, str(exc),
                               certificate)
            raise  # unreachable: abort raises; keeps the type checker honest
        if identity.role not in allowed:
            await self._refuse(
                context, method, grpc.StatusCode.PERMISSION_DENIED,
                f"a {identity.role.value} certificate may not call this method", certificate,
            )
        return identity

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        handler_call_details: Any,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        raw = handler_call_details.method
        method = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        allowed = allowed_roles(method, self._rules)
        if handler.unary_unary is not None:
            return handler._replace(
                unary_unary=self._wrap_unary(handler.unary_unary, method, allowed)
            )
        if handler.stream_unary is not None:
            return handler._replace(
                stream_unary=self._wrap_unary(handler.stream_unary, method, allowed)
            )
        if handler.unary_stream is not None:
            return handler._replace(
                unary_stream=self._wrap_stream(handler.unary_stream, method, allowed)
            )
        return handler._replace(
            stream_stream=self._wrap_stream(handler.stream_stream, method, allowed)
        )

    def _wrap_unary(
        self, behavior: Callable[[Any, Any], Any], method: str, allowed: frozenset[Role]
    ) -> Callable[[Any, Any], Any]:
        async def guarded(request: Any, context: Any) -> Any:
            token = _CURRENT_PEER.set(await self._authenticate(context, method, allowed))
            try:
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result
            finally:
                _CURRENT_PEER.reset(token)

        return guarded

    def _wrap_stream(
        self, behavior: Callable[[Any, Any], Any], method: str, allowed: frozenset[Role]
    ) -> Callable[[Any, Any], Any]:
        # grpc.aio streams either by yielding (generator handler) or by awaiting
        # context.write() (coroutine handler); the wrapper must have the same shape,
        # since a generator that calls context.write() is an error in grpc.aio.
        if inspect.isasyncgenfunction(behavior) or inspect.isgeneratorfunction(behavior):

            async def guarded_generator(request: Any, context: Any) -> AsyncIterator[Any]:
                token = _CURRENT_PEER.set(await self._authenticate(context, method, allowed))
                try:
                    result = behavior(request, context)
                    if inspect.isasyncgen(result):
                        async for item in result:
                            yield item
                    else:
                        for item in result:
                            yield item
                finally:
                    _CURRENT_PEER.reset(token)

            return guarded_generator

        async def guarded_writer(request: Any, context: Any) -> None:
            token = _CURRENT_PEER.set(await self._authenticate(context, method, allowed))
            try:
                await behavior(request, context)
            finally:
                _CURRENT_PEER.reset(token)

        return guarded_writer
