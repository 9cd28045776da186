"""Calls the coordinator refuses before any servicer runs (revoked or unknown-status
certificate, wrong role, no certificate), and scrapes of /metrics over HTTPS refused
for their certificate: one warning line and one metric sample each.

`RequireCertificateRole` (common/protocol/tls.py) aborts such calls itself, so without this the
servicer's log and `medfed_coordinator_grpc_requests_total` never saw them: a security
officer could not tell a revoked hospital still knocking, or a missing CRL refusing
everyone, from a quiet federation. A site retries with backoff for as long as it runs,
so the log says each (certificate, reason) once per `window_seconds` and, the next time
it speaks, how many identical refusals it left out; the metric counts every one.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes

from common.protocol.metrics_http import METRICS_PATH
from common.protocol.tls import FEDERATION_PREFIX, MONITOR_SERVICE_PREFIX, Refusal
from coordinator.metrics import CoordinatorMetrics

log = logging.getLogger("medfed.coordinator.security")

WINDOW_SECONDS = 60.0
"""A repeat of the same refusal (same certificate, same reason) within this many
seconds of the last logged one is counted but not logged."""

MAX_TRACKED = 1024
"""Distinct (certificate, reason) pairs remembered for rate limiting; beyond it the
least recently logged are forgotten (their repeats are then logged again: never lost)."""


def method_label(method: str) -> str:
    """The `method` label: "Enroll" for the Federation and Monitor services (as the
    servicer counts them), "Health.Check" for the others. Only methods with a
    registered handler reach the interceptor, so the label set stays bounded."""
    for prefix in (FEDERATION_PREFIX, MONITOR_SERVICE_PREFIX):
        if method.startswith(prefix):
            return method[len(prefix):]
    service, _, name = method.strip("/").partition("/")
    return f"{service.rsplit('.', 1)[-1]}.{name}" if name else "unknown"


@dataclass
class _Seen:
    logged_at: float
    suppressed: int = 0


class RefusalLog:
    """`RequireCertificateRole(on_refused=...)`: count every refusal, log it at warning
    level at most once per certificate and reason per `window_seconds`."""

    def __init__(
        self,
        metrics: CoordinatorMetrics,
        *,
        window_seconds: float = WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._window = window_seconds
        self._clock = clock
        self._seen: OrderedDict[tuple[str, str], _Seen] = OrderedDict()

    def __call__(self, refusal: Refusal) -> None:
        if refusal.method == METRICS_PATH:
            # A scrape of /metrics over HTTPS (common.protocol.metrics_http), not a gRPC call.
            method = METRICS_PATH
            self._metrics.metrics_scrapes_refused.inc()
        else:
            method = method_label(refusal.method)
            self._metrics.grpc_requests.labels(method=method, code=refusal.code.name).inc()
        cert = refusal.certificate
        fingerprint = cert.fingerprint(hashes.SHA256()).hex() if cert is not None else "none"
        key = (fingerprint, refusal.reason)
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen.logged_at < self._window:
            seen.suppressed += 1
            return
        suppressed = seen.suppressed if seen is not None else 0
        self._seen[key] = _Seen(logged_at=now)
        self._seen.move_to_end(key)
        while len(self._seen) > MAX_TRACKED:
            self._seen.popitem(last=False)
        subject = cert.subject.rfc4514_string() if cert is not None else "(no certificate)"
        serial = format(cert.serial_number, "x") if cert is not None else "none"
        repeats = (
            f"; {suppressed} identical refusals not logged since it was last logged"
            if suppressed else ""
        )
        log.warning(
            "refused %s from %s: %s: %s (certificate %s, serial %s, sha256 %s)%s",
            method, refusal.peer, refusal.code.name, refusal.reason, subject, serial,
            fingerprint, repeats,
            extra={
                "event": "call_refused", "method": method, "code": refusal.code.name,
                "reason": refusal.reason, "subject": subject, "serial": serial,
                "fingerprint_sha256": fingerprint, "peer": refusal.peer,
                "suppressed": suppressed,
            },
        )
