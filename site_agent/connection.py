"""The site's line to the coordinator: one mTLS channel it dials out (it never listens),
exponential backoff with full jitter between tries, what repeated TLS handshake
failures mean, and the heartbeats that tell the coordinator a site is alive (in a round,
and waiting in its long-poll between rounds).
"""

from __future__ import annotations

import logging
import random
import threading
import time

import grpc

from common.core.config import SiteSettings
from common.core.errors import CertificateRejected
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.protocol.tls import TlsFiles, channel_credentials_from_files, server_host_names

log = logging.getLogger("medfed.site")

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
HEARTBEAT_FINAL = {
    grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.UNIMPLEMENTED,
}
"""Heartbeat answers after which beating on is pointless (the round ended for us, or
the coordinator does not listen for heartbeats)."""
# What gRPC's details say when the TLS handshake itself failed (another CA, an expired or
# revoked certificate, a server name that does not match): retrying does not heal these.
TLS_FAILURE_MARKERS = ("handshake", "CERTIFICATE_VERIFY_FAILED", "certificate", "tlsv1 alert",
                       "SSL_ERROR", "Hostname Verification", "verification check failed")
HOSTNAME_MISMATCH_MARKER = "hostname verification"
"""gRPC's words when the coordinator's certificate does not name the host dialled."""


def tls_failure(exc: grpc.RpcError) -> str | None:
    """The handshake failure gRPC reports in `exc`, or None if it is not one."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    details = str(exc.details() or "")
    lowered = details.lower()
    if any(marker.lower() in lowered for marker in TLS_FAILURE_MARKERS):
        return details
    return None


class Connection:
    """The channel (opened on first use, closed to reconnect) and its backoff."""

    def __init__(self, settings: SiteSettings, tls_files: TlsFiles, *,
                 stop: threading.Event) -> None:
        self.settings = settings
        self.tls_files = tls_files
        self.stop = stop
        self.credentials = channel_credentials_from_files(tls_files)
        self.backoff = settings.reconnect.initial_backoff_seconds
        self.tls_failures = 0
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.FederationStub | None = None
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def _close_on_stop(self) -> None:
        """A stop cancels every RPC in flight: an upload on a link that went dead would
        otherwise hold a SIGTERM until TCP gives up, well past `docker stop`'s ten
        seconds."""
        self.stop.wait()
        self.close()

    def stub(self) -> pb_grpc.FederationStub:
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._close_on_stop,
                                             name="close-on-stop", daemon=True)
            self._watcher.start()
        with self._lock:
            return self._open()

    def _open(self) -> pb_grpc.FederationStub:
        if self._stub is None:
            self._channel = grpc.secure_channel(
                self.settings.coordinator,
                self.credentials,
                options=[
                    ("grpc.max_receive_message_length", 8 << 20),
                    ("grpc.max_send_message_length", 8 << 20),
                    ("grpc.keepalive_time_ms", 30_000),
                    # The coordinator's certificate names its host; tests and single-host
                    # demos dial 127.0.0.1, which the certificate lists as an IP SAN.
                ],
            )
            # The generated stub is untyped; every call on it is checked by the tests.
            self._stub = pb_grpc.FederationStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = None
            self._stub = None

    def established(self) -> None:
        """The coordinator answered: the next failure starts the backoff afresh."""
        self.backoff = self.settings.reconnect.initial_backoff_seconds
        self.tls_failures = 0

    def sleep_backoff(self) -> None:
        """Exponential backoff with full jitter, so restarted coordinators are not
        hammered by every hospital at once."""
        delay = random.uniform(0, self.backoff)  # noqa: S311 - jitter, not a secret
        self.backoff = min(self.backoff * 2, self.settings.reconnect.max_backoff_seconds)
        self.stop.wait(delay)

    def count_tls_failure(self, exc: grpc.RpcError) -> None:
        """Count handshake failures in a row; CertificateRejected after
        `reconnect.max_tls_failures` of them (retrying does not heal a handshake)."""
        cause = tls_failure(exc)
        self.tls_failures = self.tls_failures + 1 if cause is not None else 0
        if cause is not None and self.tls_failures >= self.settings.reconnect.max_tls_failures:
            raise CertificateRejected(
                f"TLS handshake with coordinator {self.settings.coordinator} failed "
                f"{self.tls_failures} times in a row, giving up: {cause}. "
                + self.tls_advice(cause)
            ) from None

    def tls_advice(self, cause: str) -> str:
        """What to check after repeated handshake failures; for a name mismatch, the
        names the coordinator's certificate holds (read without checking the name)."""
        address = self.settings.coordinator
        if HOSTNAME_MISMATCH_MARKER not in cause.lower():
            return ("Check that the CA file is this federation's and that this site's "
                    "certificate is valid and not expired")
        host = address.rpartition(":")[0] or address
        names = server_host_names(address, self.tls_files)
        held = (f"holds {', '.join(names)}" if names
                else "could not be read (see `openssl s_client -connect " + address + "`)")
        return (f"The coordinator's certificate does not name {host!r}: it {held}. Dial "
                "the coordinator by one of the names its certificate holds (`--coordinator` "
                "or `coordinator` in site.toml), or ask the operator to re-issue its "
                "certificate with this name (`medfed pki issue --coordinator "
                "HOST1,HOST2 --force`)")


class Heartbeats:
    """Tells the coordinator this site is alive, every `interval` seconds from a
    background thread, while the site downloads, plans its noise, trains and encodes:
    otherwise a frozen or cut-off site would hold the round until its deadline. Round 0:
    while it waits in its long-poll for a round (`medfed status` shows it silent when
    the beats stop)."""

    def __init__(self, stub: pb_grpc.FederationStub, round_number: int, interval: float) -> None:
        self.stub = stub
        self.round_number = round_number
        self.interval = interval
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"heartbeat-{round_number}", daemon=True
        )

    def __enter__(self) -> Heartbeats:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.done.set()

    def _run(self) -> None:
        # Fixed rate: a slow call does not push every later beat back.
        due = time.monotonic()
        while not self.done.is_set():
            try:
                self.stub.Heartbeat(
                    pb.HeartbeatRequest(round=self.round_number), timeout=self.interval
                )
            except grpc.RpcError as exc:
                if exc.code() in HEARTBEAT_FINAL:
                    log.info("round %d: heartbeats stop: %s", self.round_number, exc.details())
                    return
                log.debug("round %d: heartbeat failed: %s", self.round_number, exc.code())
            due = max(due + self.interval, time.monotonic())
            self.done.wait(due - time.monotonic())
