"""The CA's CRL as the coordinator relays it to sites.

The coordinator is not trusted with revocation on the sites' behalf: it hands them the
CA-signed CRL (DER) with every Enroll and WaitForRound answer, and each site checks the
signature against its own CA copy. The file is re-read whenever it changes (one `stat`
per call), so `medfed pki revoke` / `medfed pki crl` reach sites without a restart.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from common.core.errors import PkiError
from common.protocol.pki import load_crl
from coordinator.metrics import CoordinatorMetrics

log = logging.getLogger("medfed.coordinator.crl")


class CrlRelay:
    """The current ``crl.pem`` as DER bytes (empty while it is missing or invalid)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        ca_cert: x509.Certificate,
        *,
        metrics: CoordinatorMetrics,
    ) -> None:
        self._path = Path(path)
        self._ca = ca_cert
        self._metrics = metrics
        self._lock = threading.Lock()
        self._key: tuple[int, int, int] | None = None
        self._der = b""

    def _stat_key(self) -> tuple[int, int, int] | None:
        try:
            st = self._path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def der(self) -> bytes:
        key = self._stat_key()
        with self._lock:
            if key != self._key or key is None:
                self._key = key
                self._der = self._reload()
            return self._der

    def _reload(self) -> bytes:
        try:
            crl = load_crl(self._path, self._ca)
        except PkiError as exc:
            # Sites then refuse rounds with "no CRL" until the operator fixes the file.
            log.error("cannot relay the CRL to sites: %s", exc)
            self._metrics.crl_next_update.set(float("nan"))
            return b""
        next_update = crl.next_update_utc
        self._metrics.crl_next_update.set(
            next_update.timestamp() if next_update is not None else float("nan")
        )
        return crl.public_bytes(Encoding.DER)
