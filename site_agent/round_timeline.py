"""When each step of a site's round happened, for `medfed bench round` and operators
reading the logs: seconds since the site heard of the round, logged with the round's
`site_round_done` event as `t_<step>` fields, with the CPU time the process spent."""

from __future__ import annotations

import threading
import time


class RoundTimeline:
    """Marks taken from any thread (the model download runs in its own)."""

    def __init__(self, heard_at: float | None = None) -> None:
        self.origin = time.perf_counter() if heard_at is None else heard_at
        self.cpu_origin = time.process_time()
        self._marks: dict[str, float] = {}
        self._lock = threading.Lock()

    def mark(self, step: str) -> None:
        with self._lock:
            self._marks[step] = time.perf_counter() - self.origin

    def fields(self) -> dict[str, float]:
        with self._lock:
            out = {f"t_{step}": round(seconds, 6) for step, seconds in self._marks.items()}
        out["cpu_seconds"] = round(time.process_time() - self.cpu_origin, 6)
        return out
