"""What the demo says while it waits for a round, and what a failed process left."""

from __future__ import annotations

from common.core.processes import Line, ManagedProcess


def waiting_for(coordinator_lines: list[Line], site_states: dict[str, str]) -> str:
    """What the federation waits for, from the coordinator's log lines and the sites'
    states: a round in flight (its number and the coordinator's last line) or the
    selection of the next round, and any site agent that is not running."""
    opened: str | None = None
    for line in coordinator_lines:
        message = str(line.get("msg", ""))
        if line.get("event") in ("round_completed", "round_aborted"):
            opened = None
        elif message.startswith("round ") and " open: " in message:
            opened = message
    if opened is not None:
        last = str(coordinator_lines[-1].get("msg", coordinator_lines[-1].get("text", "")))
        text = f"{opened}; in flight" + (
            f" (coordinator: {last.strip()[:160]})" if last.strip() != opened else "")
    else:
        text = "the coordinator is waiting for sites to join the next round"
    down = [f"{site} {state}" for site, state in site_states.items() if state != "running"]
    running = [site for site, state in site_states.items() if state == "running"]
    text += f"; site agents running: {', '.join(running) or 'none'}"
    if down:
        text += "; " + "; ".join(down)
    return text


def last_error(proc: ManagedProcess) -> str:
    """The most telling line a failed process left: its last error, else its last line."""
    lines = list(proc.lines)
    for line in reversed(lines):
        if str(line.get("level", "")) in ("error", "critical"):
            return str(line.get("msg", line))
    for line in reversed(lines):
        text = str(line.get("msg", line.get("text", ""))).strip()
        if text:
            return text
    return "no output"

