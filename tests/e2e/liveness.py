"""Reading the liveness bound off a coordinator's structured log.

A site that stops answering while it trains (frozen, cut off, killed) must cost the
round at most `HEARTBEAT_MISSES` heartbeat intervals: the round completes within that
many intervals after the last live site's masked input was added to the sum. Measured
on the coordinator's own log timestamps, not on the test's clock.
"""

from __future__ import annotations

import datetime as dt

from common.core.processes import Line, ManagedProcess

HEARTBEAT_MISSES = 3  # the coordinator's default `deadlines.heartbeat_misses`
SLACK_SECONDS = 5.0
"""Generous allowance on top of the bound, for what follows the drop (ConsistencyCheck,
Unmask, the model update and the checkpoint) and for a loaded test machine. Without
heartbeats the same round would wait for `train_seconds` (set far larger in these
tests), so the bound still tells the two apart."""


def log_time(line: Line) -> dt.datetime:
    return dt.datetime.fromisoformat(str(line["ts"]))


def events(proc: ManagedProcess, name: str, **fields: object) -> list[Line]:
    return [
        line for line in list(proc.lines)
        if line.get("event") == name and all(line.get(k) == v for k, v in fields.items())
    ]


def assert_liveness_bound(
    coordinator: ManagedProcess, *, round_number: int, gone: str, interval: float
) -> Line:
    """The round completed without `gone`, which was dropped for silence, within
    HEARTBEAT_MISSES intervals (+ slack) of the last live upload; returns the
    round_completed event."""
    completed = coordinator.wait_event("round_completed", round_number=round_number,
                                       timeout=120)
    assert gone not in str(completed["survivors"]).split(",")
    assert gone in str(completed["dropped"]).split(",")
    silent = events(coordinator, "sites_silent", round_number=round_number)
    assert any(gone in str(e["sites"]).split(",") for e in silent), silent
    uploads = [e for e in events(coordinator, "masked_input_added", round_number=round_number)
               if e["site"] != gone]
    assert sorted(e["site"] for e in uploads) == sorted(
        str(completed["survivors"]).split(",")
    )
    last_upload = max(log_time(e) for e in uploads)
    waited = (log_time(completed) - last_upload).total_seconds()
    bound = HEARTBEAT_MISSES * interval + SLACK_SECONDS
    assert waited <= bound, (
        f"round {round_number} completed {waited:.1f} s after the last live upload "
        f"(bound {HEARTBEAT_MISSES} x {interval:g} s heartbeats + {SLACK_SECONDS:g} s slack)"
    )
    return completed
