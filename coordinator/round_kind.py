"""What a kind of round is to the coordinator, and how the run loop finds them.

The round engine (`coordinator.engine`) names no kind of round: it asks the registered
kinds, in `rank` order, which round is due next, selects its participants, and runs it
by the kind's word (cf. Flower's `Strategy`, whose `configure_fit` / `aggregate_fit`
the engine's loop calls without knowing the strategy). A kind says

  due       whether a round of its kind is due, and what it needs (`Due.job`);
  announce  the announcement of that round for its participants;
  serve     the model it serves (b"" for a round that trains nothing);
  complete  what it does with the unmasked sum, recorded (a model step, a release kept);
  after     what it does once the round ended, completed or not (its sites declined for
            good left out of later rounds of the kind, or a query failed).

A kind either is one of the study's own rounds (`StudyRound`: the statistics, training,
the final evaluation), run when it is the first due, or runs in place of the study's
next round with the participants selected for it (`in_place_of_study_round`: an
approved query, between two rounds). Each kind is one module of
``coordinator/round_kinds/`` that calls `register_round_kind` when imported;
`round_kinds` imports every module of that folder (found by file name, as
`common.models.registry` finds networks), so a new kind is one file there.

These are the coordinator's kinds of round, not the announcement's `kind` on the wire
(training, hospital, statistics, release: `common.rounds.wire`), which a kind's
announcement sets: a training round is a hospital round on the wire under hospital-level
DP, and a query round a release round naming its release.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final, Generic, Protocol, TypeVar

from common.core.config import CoordinatorSettings
from common.core.errors import ConfigError
from common.core.observer import RoundObserver
from common.core.plugins import PluginFolder
from common.privacy.federation import FederationBudgetView
from common.rounds.announcement import Announcement
from coordinator.aggregation import Aggregator
from coordinator.ledger_gate import LedgerGate
from coordinator.metrics import CoordinatorMetrics
from coordinator.phases import ActiveRound
from coordinator.store import CoordinatorStore
from coordinator.study_run import StudyRun
from coordinator.training_round import GlobalModel, RoundResult

ROUND_KINDS_PACKAGE: Final = "coordinator.round_kinds"
"""The package whose every module registers one kind of round (`round_kinds`)."""

Job = TypeVar("Job")


class RoundContext(Protocol):
    """What a kind of round reads and drives of the engine running the study."""

    @property
    def settings(self) -> CoordinatorSettings: ...
    @property
    def store(self) -> CoordinatorStore: ...
    @property
    def study(self) -> StudyRun | None: ...
    @property
    def model(self) -> GlobalModel: ...
    @property
    def metrics(self) -> CoordinatorMetrics: ...
    @property
    def observer(self) -> RoundObserver: ...
    @property
    def ledgers(self) -> LedgerGate: ...
    @property
    def budget_view(self) -> FederationBudgetView: ...
    @property
    def last_secagg(self) -> tuple[int, int]: ...
    @property
    def total_rounds(self) -> int: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def rng(self) -> Callable[[int], bytes]: ...

    last_result: RoundResult | None

    def next_round_number(self, participants: list[str]) -> int: ...

    def leave_out_declined_for_good(self, rnd: ActiveRound, *, kind: str) -> None: ...


@dataclass(frozen=True)
class Due(Generic[Job]):
    """A round of `kind` that is due, with what the kind needs to run it."""

    kind: RoundKind[Job]
    job: Job


class RoundKind(ABC, Generic[Job]):
    """One kind of round (module docstring). `Job`: what `due` hands the round's other
    steps (None for a round that needs nothing beyond the study's state)."""

    name: ClassVar[str]
    """Its name in the operator's log and for the sites left out of it."""
    rank: ClassVar[int]
    """The order the engine asks the kinds in (lower first)."""
    in_place_of_study_round: ClassVar[bool] = False
    """Runs, when due, in place of the study's next round and with its participants
    (the study's round then runs next time), rather than being one of the study's own."""
    spends_budget: ClassVar[bool] = True
    """False for a round every site may join whatever its budget (it spends none)."""

    @abstractmethod
    async def due(self, ctx: RoundContext) -> Due[Job] | None:
        """A round of this kind, if one is due now."""

    @abstractmethod
    def announce(self, ctx: RoundContext, participants: list[str], job: Job) -> Announcement:
        """The round's announcement for `participants` (its number from
        `ctx.next_round_number`, its nonce from `ctx.rng`)."""

    def serve(self, ctx: RoundContext) -> bytes | memoryview:
        """The model the round serves: none by default."""
        del ctx
        return b""

    @abstractmethod
    async def complete(self, ctx: RoundContext, rnd: ActiveRound, aggregator: Aggregator,
                       job: Job) -> RoundResult:
        """After the sum is unmasked: use it and record the round."""

    @abstractmethod
    def after(self, ctx: RoundContext, rnd: ActiveRound, job: Job, *, completed: bool) -> None:
        """Once the round ended (recorded, or aborted: `completed` False)."""

    def title(self, ctx: RoundContext) -> str:
        """How the operator reads the next round of this kind ("the statistics round")."""
        del ctx
        return f"the {self.name} round"

    def opening(self, ctx: RoundContext) -> None:
        """The engine starts (or restarts) the study's rounds (worker thread). Nothing
        by default."""
        del ctx

    def closing(self, ctx: RoundContext) -> None:
        """The study completed (worker thread): the kind's last word. Nothing by
        default."""
        del ctx


class StudyRound(RoundKind[None]):
    """One of the study's own rounds: due by the study's state alone, and when it cannot
    run because every participant declined it for good, the study fails (the engine's
    `leave_out_declined_for_good`); its other decliners are left out of it."""

    def after(self, ctx: RoundContext, rnd: ActiveRound, job: None, *, completed: bool) -> None:
        if not completed:
            ctx.leave_out_declined_for_good(rnd, kind=self.name)


ROUND_KINDS: Final[dict[str, RoundKind[Any]]] = {}


def register_round_kind(kind: RoundKind[Any]) -> RoundKind[Any]:
    """Add a kind of round (idempotent for one of the same class); a second kind of the
    same name or the same rank is refused (the engine's order would be ambiguous). The
    plug-ins are loaded first, so a clash with one of them is refused whichever came
    first."""
    _PLUGIN_FOLDER.load()
    existing = ROUND_KINDS.get(kind.name)
    if existing is not None and type(existing) is not type(kind):
        raise ConfigError("round kind", f"{kind.name!r} registered twice, differently")
    clash = [other.name for other in ROUND_KINDS.values()
             if other.rank == kind.rank and other.name != kind.name]
    if clash:
        raise ConfigError("round kind", f"{kind.name!r} has the rank of {clash[0]!r}")
    ROUND_KINDS[kind.name] = kind
    return kind


_PLUGIN_FOLDER: Final = PluginFolder(ROUND_KINDS_PACKAGE, Path(__file__).parent / "round_kinds")


def round_kinds() -> tuple[RoundKind[Any], ...]:
    """Every registered kind, in `rank` order, after importing every module of
    `ROUND_KINDS_PACKAGE` (names starting with ``_`` are helpers) once per process."""
    _PLUGIN_FOLDER.load()
    return tuple(sorted(ROUND_KINDS.values(), key=lambda kind: kind.rank))
