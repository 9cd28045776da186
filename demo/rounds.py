"""The demo's rounds as they happen: which site is killed mid-round (and whether the
federation can survive it), each round followed from the coordinator's events with the
victim killed when it pauses and restarted after its round, each round's line printed
and its row kept for the report (`demo.report`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from common.core.errors import StateError
from common.core.processes import Line, ManagedProcess
from demo.options import WAIT_NOTE_SECONDS, DemoOptions, RoundRow
from demo.processes import FederationProcesses
from demo.report import dp_auc_text, epsilon_by_site
from demo.terms import FederationTerms, dropout_decision
from demo.watch import waiting_for

ROUND_EVENTS = ("round_completed", "round_aborted")


class RoundFollower:
    """Follows one demo's rounds: the fault plan, the victim's kill and restart, and
    the rounds seen (`rows`, `aborted`, `statistics_round`, what `demo.tasks.FollowedRounds`
    reads)."""

    def __init__(self, processes: FederationProcesses, options: DemoOptions, *,
                 say: Callable[[str], None]) -> None:
        self.processes = processes
        self.o = options
        self.say = say
        self.rows: list[RoundRow] = []
        self.aborted: list[dict[str, Any]] = []
        self.statistics_round: int | None = None

    def kill_round_number(self) -> int:
        """The coordinator's number of the `--kill-round`th training round (round 1 is
        the study's federated DP statistics round)."""
        return self.o.kill_round + 1

    def plan_fault(self, sites: list[str], terms: FederationTerms) -> str | None:
        """The site to kill mid-round, or None where the federation could not survive
        losing one (`dropout_decision`, said in one line) or `--kill-round 0`."""
        if not self.o.kill_round:
            return None
        decision = dropout_decision(len(sites), aggregation=terms.aggregation,
                                    policy=terms.policy)
        self.say(decision.line)
        return sites[-1] if decision.inject else None

    def follow(self, coordinator: ManagedProcess, sites: list[str],
               victim: str | None) -> None:
        """Every training round and the final evaluation round, to the last; the
        statistics round and aborted rounds are said and kept apart."""
        total = self.o.rounds + 1  # training rounds + the final evaluation round
        done = 0
        restarted = False
        seen = 0
        while done < total:
            line, seen = self._next_round_event(coordinator, seen, sites)
            if victim is not None and not restarted and self.processes.was_killed(victim):
                # After the round it was killed in (completed or aborted), before the
                # next round's selection, which waits for every site.
                self.processes.restart_site(victim)
                restarted = True
                self.say(f"[fault] {victim} restarted with its ledger: it rejoins next round")
            if line.get("event") == "round_aborted":
                self.aborted.append({"round": int(line.get("round_number", 0)),
                                     "reason": str(line.get("reason", ""))})
                self.say(f"[round {line.get('round_number')}] aborted: {line.get('reason')}")
                continue
            if line.get("kind") == "statistics":
                self.statistics_round = int(line.get("round_number", 0))
                self.say(f"[round {self.statistics_round}] federated DP statistics: "
                         f"{len(str(line.get('survivors', '')).split(','))} sites released "
                         "noised sums and counts; every site standardises and imputes with "
                         "the same global values")
                continue
            done += 1
            self.record_round(line, sites)

    def _next_round_event(self, coordinator: ManagedProcess, seen: int,
                          sites: list[str]) -> tuple[Line, int]:
        """Wait for the coordinator's next round event; meanwhile kill a paused victim,
        and every WAIT_NOTE_SECONDS without one say what the federation waits for."""
        waiting_since = last_note = time.monotonic()
        while True:
            lines = coordinator.lines
            for index in range(seen, len(lines)):
                if lines[index].get("event") in ROUND_EVENTS:
                    return lines[index], index + 1
            if not coordinator.alive:
                try:  # its last lines may still be in the pipe
                    return self._last_round_event(coordinator, seen)
                except RuntimeError:
                    raise StateError(
                        self.processes.coordinator_failure(coordinator, sites)) from None
            self.processes.check_sites()
            for site in self.processes.kill_paused():
                self.say(f"[fault] kill -9 {site} mid-round, after it sent its masked "
                         "update: the survivors' Shamir shares will remove its masks")
            now = time.monotonic()
            if now - last_note >= WAIT_NOTE_SECONDS:
                last_note = now
                self.say(f"[wait] {now - waiting_since:.0f} s: "
                         + waiting_for(list(lines), self.processes.site_states(sites)))
            try:
                coordinator.wait_for(lambda e: e.get("event") in ROUND_EVENTS,
                                     timeout=1.0, what="a round event", start=seen)
            except RuntimeError:
                continue

    @staticmethod
    def _last_round_event(coordinator: ManagedProcess, seen: int) -> tuple[Line, int]:
        """A round event an exited coordinator printed from line `seen` on (read to the
        end of its output); RuntimeError when there is none."""
        event = coordinator.wait_for(lambda e: e.get("event") in ROUND_EVENTS,
                                     timeout=30.0, what="a round event", start=seen)
        return event, next(i for i in range(seen, len(coordinator.lines))
                           if coordinator.lines[i] is event) + 1

    def record_round(self, line: Line, sites: list[str]) -> None:
        """Keep a completed training or evaluation round as a `RoundRow` (with each
        site's epsilon so far, read from its ledger) and print its line."""
        participants = [s for s in str(line.get("participants", "")).split(",") if s]
        dropped = sorted(
            s for key in ("dropped", "dropped_after_input")
            for s in str(line.get(key, "")).split(",") if s
        )
        eps = epsilon_by_site(self.o.out, sites)
        auc = line.get("auc")
        row = RoundRow(
            round=int(line["round_number"]),
            participants=participants,
            dropped=dropped,
            secure_aggregation=bool(line.get("secure", True)),
            auc=float(auc) if auc is not None else None,
            evaluation_only=bool(line.get("evaluation_only", False)),
            epsilon=eps,
            metrics={k: line.get(k) for k in ("auc", "sensitivity", "specificity", "ppv",
                                              "auc_interval_low", "auc_interval_high")},
            intermediaries=(int(line["intermediaries"])
                            if line.get("intermediaries") is not None else None),
        )
        self.rows.append(row)
        kind = "final evaluation" if row.evaluation_only else "training"
        auc_text = dp_auc_text(row.metrics) if row.auc is not None else "  -  "
        eps_text = " ".join(f"{s}={e:.2f}" for s, e in eps.items())
        lost = f" ({','.join(dropped)})" if dropped else ""
        split = (f" | v={row.intermediaries}" if row.intermediaries is not None else "")
        self.say(
            f"[round {row.round}] {kind:<16} sites {len(participants)}, dropped "
            f"{len(dropped)}{lost} | AUC {auc_text} | epsilon {eps_text}{split}"
        )
