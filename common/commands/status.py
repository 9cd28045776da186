"""`medfed status`: the study as the coordinator sees it, for operators.

Calls the read-only Monitor/Status RPC over mutual TLS with a monitor certificate
(`medfed pki issue --monitor NAME`); site and coordinator certificates are refused
(a site has no need to see the other hospitals' states and budgets).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import grpc

from common.core.errors import ConfigError, Unavailable
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.protocol.pki import Role
from common.protocol.tls import TlsFiles, channel_credentials_from_files
from common.releases.evaluation_interval import interval_text

FAILED_PHASE_PREFIX = "failed: "
"""The phase of a study that ended unfinished, followed by why: the Status RPC's
`phase` string carries the reason (coordinator/status.py), shown as the headline."""

DEFAULT_TIMEOUT_SECONDS = 10.0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the study's progress: statistics round, training round k of N, "
        "evaluation round, phase, sites, budgets, ETA",
        description="Read-only; needs a monitor certificate (medfed pki issue --monitor NAME).",
    )
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    parser.add_argument("--tls-ca", type=Path, required=True, help="federation CA certificate")
    parser.add_argument("--tls-cert", type=Path, required=True, help="monitor certificate")
    parser.add_argument("--tls-key", type=Path, required=True, help="monitor private key")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS,
                        help="seconds to wait for the coordinator")
    parser.set_defaults(func=_status)


def fetch_status(coordinator: str, *, ca: Path, cert: Path, key: Path,
                 timeout: float) -> dict[str, Any]:
    """The coordinator's status as a plain dict (the `--json` output)."""
    credentials = channel_credentials_from_files(
        TlsFiles(role=Role.MONITOR, ca=ca, cert=cert, key=key))
    with grpc.secure_channel(coordinator, credentials) as channel:
        stub = pb_grpc.MonitorStub(channel)  # type: ignore[no-untyped-call]
        try:
            resp = stub.Status(pb.StatusRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                details = exc.details() or code.name
                raise ConfigError(
                    "tls-cert", f"the coordinator refused this certificate ({details}); "
                    + refusal_hint(details),
                ) from None
            raise Unavailable(f"coordinator {coordinator}: {code.name}: {exc.details()}") from None
    now_ms = resp.now_unix_ms
    return {
        "federation_id": resp.federation_id,
        "finished": resp.finished,
        "failed": failure_of(resp.phase),
        "phase": resp.phase,
        "current_round": resp.current_round,
        "completed_rounds": resp.completed_rounds,
        "aborted_rounds": resp.aborted_rounds,
        "total_rounds": resp.total_rounds,
        # total_rounds = training_rounds + the evaluation round; the statistics round is
        # apart. A coordinator older than these fields reports training_rounds 0.
        "training_rounds": resp.training_rounds or resp.total_rounds,
        "evaluation_round": resp.evaluation_round,
        "statistics_round": resp.statistics_round or "none",
        "current_kind": resp.current_kind,
        "eta_seconds": None if resp.eta_seconds < 0 else resp.eta_seconds,
        # The last completed round's DP AUC with its 95% interval for the exact
        # held-out AUC (null before any evaluation, or the interval from an older
        # coordinator).
        "dp_auc": None if resp.auc_round == 0 else {
            "round": resp.auc_round, "auc": resp.auc,
            "interval_low": resp.auc_interval_low
            if math.isfinite(resp.auc_interval_low) else None,
            "interval_high": resp.auc_interval_high
            if math.isfinite(resp.auc_interval_high) else None,
        },
        "sites": [
            {
                "site_id": s.site_id,
                "state": s.state,
                "last_contact_seconds_ago": (
                    None if s.last_contact_unix_ms == 0
                    else max(now_ms - s.last_contact_unix_ms, 0) / 1000
                ),
                "epsilon_spent": s.epsilon_spent,
                "epsilon_budget": s.epsilon_budget,
                "privacy_unit": s.privacy_unit,
            }
            for s in resp.sites
        ],
    }


def refusal_hint(details: str) -> str:
    """What to do about the coordinator's refusal, by its stated reason. The local
    checks already made sure the certificate is a monitor certificate, so "you need a
    monitor certificate" is the hint only when the coordinator says the role is wrong."""
    if "revocation status unknown" in details:
        return ("the coordinator cannot check revocation, so it refuses every caller; "
                "this certificate may well be fine: on the CA host run "
                "`medfed pki crl --dir D` and install the new crl.pem at the coordinator")
    if "revoked" in details:
        return ("this certificate is revoked: issue a new one with "
                "medfed pki issue --monitor NAME")
    if "expired" in details:
        return ("the coordinator says a certificate expired (this one, or the CA: "
                "`medfed pki list --dir D`); renew it")
    if "may not call" in details:
        return "status needs a monitor certificate: medfed pki issue --monitor NAME"
    return "the coordinator's log names the refused call and why"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _progress(status: dict[str, Any]) -> str:
    """Each kind of round by its name: "statistics round completed, 1 of 3 training
    rounds completed, final evaluation round to come"."""
    training = status["training_rounds"]
    done = status["completed_rounds"]
    parts = []
    if status["statistics_round"] != "none":
        parts.append("statistics round " + (
            "completed" if status["statistics_round"] == "completed" else "to come"))
    parts.append(f"{min(done, training)} of {training} training rounds completed")
    if status["evaluation_round"]:
        parts.append("final evaluation round " + (
            "completed" if done > training else "to come"))
    return ", ".join(parts)


def _in_flight(status: dict[str, Any]) -> str:
    kind = status["current_kind"]
    if kind == "statistics":
        return "the statistics round"
    if kind == "evaluation":
        return "the final evaluation round"
    k = min(status["completed_rounds"] + 1, status["training_rounds"])
    return f"training round {k} of {status['training_rounds']}"


def failure_of(phase: str) -> str | None:
    """Why the study failed, from the phase the coordinator reports (None: it has not)."""
    return phase.removeprefix(FAILED_PHASE_PREFIX) if phase.startswith(FAILED_PHASE_PREFIX) \
        else None


def render(status: dict[str, Any]) -> str:
    """Human-readable status: one headline, then one row per site."""
    eta = _duration(status["eta_seconds"])
    if status["finished"]:
        head = f"study finished: {_progress(status)}"
    elif failure_of(status["phase"]) is not None:
        head = f"study FAILED: {failure_of(status['phase'])}; {_progress(status)}"
    elif status["current_round"]:
        head = (f"{_in_flight(status)} in flight (round number {status['current_round']}, "
                f"phase {status['phase']}); {_progress(status)}; ETA {eta}")
    else:
        head = f"{_progress(status)}; waiting for sites (selecting); ETA {eta}"
    lines = [f"federation {status['federation_id']}: {head}"]
    if status["aborted_rounds"]:
        lines.append(f"aborted rounds: {status['aborted_rounds']}")
    reading = status.get("dp_auc")
    if reading:
        low, high = reading["interval_low"], reading["interval_high"]
        text = (interval_text(reading["auc"], low, high) if low is not None and high is not None
                else f"{reading['auc']:.3f}")
        lines.append(f"DP-evaluated AUC after round {reading['round']}: {text}")
    rows = [("SITE", "STATE", "LAST CONTACT", "EPSILON SPENT / BUDGET")]
    for site in status["sites"]:
        ago = site["last_contact_seconds_ago"]
        contact = "never" if ago is None else f"{_duration(ago)} ago"
        if site["epsilon_budget"] > 0:
            eps = (f"{site['epsilon_spent']:.3f} / {site['epsilon_budget']:g}"
                   f" ({site['privacy_unit'] or 'record'})")
        else:
            # No budget reported: a site reports its ledger once it has joined the
            # study (and one whose study runs without DP never does); not "no DP".
            eps = "nothing spent yet (no budget reported)"
        rows.append((site["site_id"], site["state"], contact, eps))
    if len(rows) == 1:
        lines.append("no site has enrolled since the coordinator started")
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines += [
            "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r[:3])) + "  " + r[3]
            for r in rows
        ]
    if any(site["state"] == "enrolled" for site in status["sites"]):
        lines.append(
            "enrolled: the site enrolled but has not asked for a round since; a site that "
            "refuses the study (data check, or privacy policy) stops right after enrolling "
            "and its own log says why")
    if any(site["state"] == "silent" for site in status["sites"]):
        lines.append(
            "silent: selected for this round but no heartbeat for 1.5 intervals "
            "(frozen or cut off); the round drops it after heartbeat_misses intervals")
    if any(site["state"] == "gone" for site in status["sites"]):
        lines.append(
            "gone: the site stopped asking for rounds (it exited, e.g. after --once, or "
            "cannot reach the coordinator); it rejoins when it polls again")
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    status = fetch_status(args.coordinator, ca=args.tls_ca, cert=args.tls_cert,
                          key=args.tls_key, timeout=args.timeout)
    print(json.dumps(status) if args.json else render(status), flush=True)
    return 0


if __name__ == "__main__":
    from common.commands.cli import main_with
    from common.core.logs import quiet_grpc_core

    quiet_grpc_core()
    sys.exit(main_with([register]))
