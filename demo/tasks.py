"""What a demo task supplies to the one `Demo`: its data, its study, baselines and site
configuration. `demo.tabular` and `demo.imaging` are the two tasks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from demo.options import DemoOptions, RoundRow
from demo.terms import FederationTerms


class FollowedRounds(Protocol):
    """The rounds a demo saw (`demo.rounds.RoundFollower`): each completed training or
    evaluation round, the aborted ones, and the number of the statistics round."""

    rows: list[RoundRow]
    aborted: list[dict[str, Any]]
    statistics_round: int | None


class Demo(Protocol):
    """What a task and the report read of the running demo (`demo.run.Demo` is the one
    implementation): its options and output folder, the study it serves, the sites'
    split keys, the rounds it followed, and its console."""

    o: DemoOptions
    out: Path
    task: DemoTask
    study: Any
    served_study: Path | None
    split_keys: dict[str, bytes]
    terms: FederationTerms
    audit: dict[str, Any]
    started: float

    @property
    def follower(self) -> FollowedRounds:
        """The rounds the demo followed."""

    def say(self, text: str) -> None:
        """One line on the demo's console."""


class DemoTask(Protocol):
    """The task strategy of a `Demo`; every method gets the running demo."""

    name: str
    """"tabular" or "imaging" (``--task``)."""

    histogram_bins: int
    """Score bins of the federation's DP evaluation histogram."""

    centralized_label: str
    """The table's row of the centralized non-private baseline (`baselines`)."""

    def prepare(self, demo: Demo) -> dict[str, Path | None]:
        """Write the task's inputs under ``demo.out`` and the study the coordinator
        serves (``demo.served_study``, ``demo.study``); site ids and their data."""

    def load_datasets(
        self, demo: Demo, files: dict[str, Path | None]
    ) -> tuple[dict[str, Any], list[str]]:
        """The records the sites train on, for the in-process baselines and audit, and
        the feature names (none for images)."""

    def baselines(self, demo: Demo, datasets: dict[str, Any]) -> dict[str, dict[str, float]]:
        """Centralized and federated non-private baselines, in process."""

    def site_config(self, demo: Demo, site: str, data: Path | None) -> str:
        """The site agent's configuration file (TOML)."""

    def exact_final(self, demo: Demo, bundle: Path) -> dict[str, Any]:
        """The final model bundle's exact metrics on every hospital's held-out patients
        (the sites' own splits, pooled; at the bundle's decision threshold): only a demo,
        holding every hospital's data, can compute them. The table shows them beside the
        exact non-private baselines, so the row says the gap; the federation's own DP
        estimate follows it."""

    def finish_report(self, demo: Demo, report: dict[str, Any]) -> None:
        """Add the task's own figures to the written report (after the table)."""
