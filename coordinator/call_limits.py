"""Per-site shares of the coordinator: calls and request bytes in flight.

One site certificate could open hundreds of calls at once or send near-limit request
bodies in parallel: the coordinator's memory grows with them and honest sites' calls
wait behind them. Every Federation call holds a slot of its site's share while it runs,
and the bytes of its (parsed) request while it runs; a call beyond the site's share,
or beyond the coordinator's whole request-bytes budget, is refused at once with
RESOURCE_EXHAUSTED (`common.core.errors.ResourceExhausted`), counted per site. The other
sites' shares are untouched, so they are served. The shares are operator settings
(`[limits]` of the coordinator's config, `common.core.config.LimitsSection`; defaults below).
Pure bookkeeping: no grpc, no clock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from common.core.config import LimitsSection
from common.core.errors import ResourceExhausted

_DEFAULTS = LimitsSection()
MAX_CALLS_PER_SITE = _DEFAULTS.max_calls_per_site
"""An honest site holds at most a long poll, a heartbeat, a model download, one phase
call, an upload and a ledger replication at once (and, reconnecting, a second poll
before the first is cancelled): 16 leaves room."""
MAX_REQUEST_BYTES_PER_SITE = _DEFAULTS.max_request_bytes_per_site
"""Four ledger histories of the 4 MiB bound, or many upload chunks, at once."""
MAX_REQUEST_BYTES = _DEFAULTS.max_request_bytes
"""All sites' parsed requests in flight together: the memory budget for parsing."""


@dataclass
class _Share:
    calls: int = 0
    nbytes: int = 0


@dataclass
class CallLimits:
    """Shares of calls and request bytes in flight, per site and in all."""

    max_calls_per_site: int = MAX_CALLS_PER_SITE
    max_bytes_per_site: int = MAX_REQUEST_BYTES_PER_SITE
    max_bytes: int = MAX_REQUEST_BYTES
    _shares: dict[str, _Share] = field(default_factory=dict)
    _nbytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_settings(cls, limits: LimitsSection) -> CallLimits:
        """The shares an operator set in `[limits]`."""
        return cls(max_calls_per_site=limits.max_calls_per_site,
                   max_bytes_per_site=limits.max_request_bytes_per_site,
                   max_bytes=limits.max_request_bytes)

    def in_flight(self, site: str) -> tuple[int, int]:
        """(calls, request bytes) `site` holds now."""
        share = self._shares.get(site)
        return (0, 0) if share is None else (share.calls, share.nbytes)

    @contextmanager
    def hold(self, site: str, *, nbytes: int) -> Iterator[None]:
        """Hold one call of `site` with an `nbytes` request while the block runs;
        ResourceExhausted (nothing held) when that exceeds a share."""
        with self._lock:
            share = self._shares.setdefault(site, _Share())
            if share.calls + 1 > self.max_calls_per_site:
                raise ResourceExhausted(
                    f"site {site} has {share.calls} calls in flight, the most one site may "
                    f"hold (limits.max_calls_per_site): refused, retry when one of them "
                    "ended")
            if share.nbytes + nbytes > self.max_bytes_per_site:
                raise ResourceExhausted(
                    f"site {site} has {share.nbytes} request bytes in flight; this "
                    f"{nbytes}-byte request would pass its share of "
                    f"{self.max_bytes_per_site} (limits.max_request_bytes_per_site): refused, "
                    "retry later")
            if self._nbytes + nbytes > self.max_bytes:
                raise ResourceExhausted(
                    f"the coordinator holds {self._nbytes} request bytes in flight; this "
                    f"{nbytes}-byte request would pass its budget of {self.max_bytes} "
                    "(limits.max_request_bytes): refused, retry later")
            share.calls += 1
            share.nbytes += nbytes
            self._nbytes += nbytes
        try:
            yield
        finally:
            with self._lock:
                share.calls -= 1
                share.nbytes -= nbytes
                self._nbytes -= nbytes
                if share.calls == 0:
                    del self._shares[site]
