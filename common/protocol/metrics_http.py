"""Serve a Prometheus registry on ``/metrics``; the port is separate from the gRPC port.

Plain HTTP (`serve_metrics` without `tls`) is for a scrape from the same machine, or a
hospital's own network (the site agent). With `MetricsTls` the registry is served over
HTTPS and answered to monitor certificates of the federation only, the rule the gRPC
port applies to its callers (common/protocol/tls.py): the handshake requires a client
certificate signed by the federation CA, and every request re-checks it with a
`PeerVerifier` (validity, the CRL re-read whenever the file changes, clientAuth, role).
A site, coordinator or revoked certificate, or any certificate while the CRL is
missing or past its nextUpdate, gets 403 with the reason; a caller without a
certificate, or with another CA's, never gets past the handshake.

The handshake runs in the connection's own thread under a deadline (prometheus-client's
TLS option shakes hands in the accepting thread, where one stalled client holds every
scrape), and at most `MAX_CONNECTIONS` connections are served at once.
"""

from __future__ import annotations

import datetime as dt
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import grpc
from cryptography import x509
from prometheus_client import CollectorRegistry, make_wsgi_app, start_http_server
from prometheus_client.exposition import ThreadingWSGIServer

from common.core.config import parse_host_port
from common.core.errors import CertificateRejected, ConfigError, PkiError
from common.protocol.pki import PeerVerifier, Role, parse_certificate
from common.protocol.tls import Refusal, TlsFiles, load_tls_material

log = logging.getLogger("medfed.metrics")

METRICS_PATH = "/metrics"
"""The `method` of a `Refusal` reported for a refused scrape."""

HANDSHAKE_SECONDS = 10.0
"""Deadline of a connection's TLS handshake, and of each read and write after it."""

MAX_CONNECTIONS = 32
"""Connections served at once over TLS; one more is closed at once (a scraper retries
at its next interval)."""

_REFUSAL_KEY = "medfed.metrics_refusal"  # WSGI environ: "" for a verified monitor

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class MetricsTls:
    """HTTPS for /metrics: the coordinator's own certificate pair (`files`), monitor
    clients verified by `verifier` (the one the gRPC port uses), each refused
    certificate handed to `on_refused` (the coordinator logs and counts it)."""

    files: TlsFiles
    verifier: PeerVerifier
    on_refused: Callable[[Refusal], None] | None = None
    clock: Callable[[], dt.datetime] = field(default=_utc_now)

    def server_context(self) -> ssl.SSLContext:
        """TLS 1.2+, the coordinator's pair, client certificates required and chained
        to the federation CA (the CRL and the role are checked per request)."""
        # The same start-up checks as the gRPC port: a misplaced or mismatched file
        # fails with one PkiError naming it, not at the first scrape.
        load_tls_material(self.files)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(str(self.files.cert), str(self.files.key))
            context.load_verify_locations(cafile=str(self.files.ca))
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise PkiError(f"cannot serve /metrics over TLS: {exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def refusal(self, der: bytes | None, peer: str) -> str:
        """"" if `der` is a current, unrevoked monitor certificate; otherwise why it is
        refused (reported to `on_refused`)."""
        certificate: x509.Certificate | None = None
        try:
            if der is None:
                raise CertificateRejected("caller presented no client certificate")
            certificate = parse_certificate(der)
            identity = self.verifier.verify_identity(certificate, now=self.clock())
            if identity.role is not Role.MONITOR:
                raise CertificateRejected(
                    f"a {identity.role.value} certificate ({identity.name!r}) may not read "
                    "metrics: scrape with a monitor certificate "
                    "(`medfed pki issue --monitor NAME`)"
                )
        except CertificateRejected as exc:
            reason = str(exc)
            if self.on_refused is not None:
                try:
                    self.on_refused(Refusal(
                        method=METRICS_PATH, code=grpc.StatusCode.PERMISSION_DENIED,
                        reason=reason, certificate=certificate, peer=peer,
                    ))
                except Exception:  # a broken reporter must not turn a refusal into a crash
                    log.exception("reporting a refused scrape failed")
            return reason
        return ""


class _MonitorOnlyHandler(WSGIRequestHandler):
    """Puts the verdict on the caller's certificate into the request's environ."""

    timeout = HANDSHAKE_SECONDS

    def log_message(self, format: str, *args: Any) -> None:
        """No line per scrape (as prometheus-client's own handler)."""

    def get_environ(self) -> dict[str, Any]:
        environ: dict[str, Any] = dict(super().get_environ())
        server = cast(_TlsMetricsServer, self.server)
        connection = cast(ssl.SSLSocket, self.connection)
        host, port = self.client_address[:2]
        environ[_REFUSAL_KEY] = server.tls.refusal(
            connection.getpeercert(binary_form=True), f"{host}:{port}"
        )
        return environ


def _monitors_only(app: WsgiApp) -> WsgiApp:
    """`app` for a verified monitor; 403 and the reason for anyone else (fail closed: a
    request without a verdict is refused too)."""

    def guarded(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        refusal = environ.get(_REFUSAL_KEY)
        if refusal != "":
            start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")])
            return [f"{refusal or 'no verified client certificate'}\n".encode()]
        return app(environ, start_response)

    return guarded


class _TlsMetricsServer(ThreadingWSGIServer):
    """A thread per connection, which does its own TLS handshake (under a deadline)."""

    def __init__(self, address: tuple[str, int], *, tls: MetricsTls,
                 context: ssl.SSLContext) -> None:
        self.tls = tls
        self.context = context
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _MonitorOnlyHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            request.settimeout(HANDSHAKE_SECONDS)
            try:
                connection = self.context.wrap_socket(request, server_side=True)
            except (OSError, ValueError) as exc:  # no or a foreign certificate, not TLS
                log.debug("metrics: TLS handshake with %s failed: %s", client_address, exc)
                self.shutdown_request(request)
                return
            super().process_request_thread(connection, client_address)
        finally:
            self._slots.release()


def _serve_tls(host: str, port: int, registry: CollectorRegistry,
               tls: MetricsTls) -> WSGIServer:
    context = tls.server_context()
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]

    class Server(_TlsMetricsServer):
        address_family = family

    server = Server((host, port), tls=tls, context=context)
    server.set_app(_monitors_only(make_wsgi_app(registry)))
    threading.Thread(target=server.serve_forever, name="metrics-tls", daemon=True).start()
    return server


def serve_metrics(
    listen: str, registry: CollectorRegistry, *, tls: MetricsTls | None = None
) -> tuple[WSGIServer, int]:
    """Start the exporter in a daemon thread (HTTPS for monitors only with `tls`);
    returns (server, bound port)."""
    host, port = parse_host_port(listen)
    try:
        if tls is not None:
            server = _serve_tls(host.strip("[]"), port, registry, tls)
        else:
            server, thread = start_http_server(port, addr=host.strip("[]"), registry=registry)
            if not isinstance(thread, threading.Thread):
                raise RuntimeError("prometheus exporter did not start")
    except OSError as exc:
        raise ConfigError(
            "metrics_listen", f"cannot serve /metrics on {listen}: {exc.strerror or exc}"
        ) from None
    return server, int(server.server_port)
