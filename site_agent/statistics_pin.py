"""The study's global statistics, pinned on this site's disk.

The federated DP statistics are released once per study; every training announcement
then carries the global statistics decoded from that one release. They must never
change afterwards: a coordinator that sends other statistics in a later round (to probe
how the site encodes its records) or announces another statistics round (to average the
release's noise away) is deviating. The first statistics a site accepts for a study are
written to STATE/statistics/<study sha256>.json and every later announcement, the final
model bundle and any further statistics round of that study are checked against them,
across restarts.
"""

from __future__ import annotations

from pathlib import Path

from common.core.errors import StateError, StudyRefused, ValidationError
from common.core.fileio import atomic_write
from common.study import GlobalStatistics, statistics_bytes, statistics_from_bytes

RELEASED_WAY_OUT = (
    "To take part in the new run deliberately (the hospital's decision: a second "
    "release is charged to this site's privacy ledger again), remove that statistics "
    "file and start the site again with the same state folder; never start over with a "
    "fresh state folder, which would lose the ledger of budget already spent "
    "(docs/operations.md, 'A study run again')."
)
"""What an operator may do when the coordinator runs a study whose statistics this site
already released."""


class StatisticsPin:
    """One file per study; `accept` pins the first statistics and refuses any other."""

    def __init__(self, state: Path) -> None:
        self.folder = state / "statistics"
        self._cache: dict[str, GlobalStatistics] = {}

    def path(self, study_sha256: str) -> Path:
        # study_sha256 is 64 hex digits (GlobalStatistics validates the pattern).
        return self.folder / f"{study_sha256}.json"

    def pinned(self, study_sha256: str) -> GlobalStatistics | None:
        """The statistics this site accepted for the study, or None before the release."""
        if study_sha256 in self._cache:
            return self._cache[study_sha256]
        path = self.path(study_sha256)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateError(f"cannot read {path}: {exc.strerror}") from None
        try:
            statistics = statistics_from_bytes(data)
        except ValidationError as exc:
            raise StateError(f"{path} is corrupt ({exc}); restore it or remove it") from None
        if statistics.study_sha256 != study_sha256:
            raise StateError(f"{path} holds statistics of another study")
        self._cache[study_sha256] = statistics
        return statistics

    def accept(self, statistics: GlobalStatistics) -> None:
        """Pin `statistics` for its study, or raise StudyRefused when other statistics
        were pinned for it: they come from the study's one release and cannot change, so
        every later round of this run of the study would be refused too."""
        current = self.pinned(statistics.study_sha256)
        if current is not None:
            if current != statistics:
                raise StudyRefused(
                    "the announced global statistics differ from the ones this site "
                    f"accepted for the study ({self.path(statistics.study_sha256)}): they "
                    "come from its one release and cannot change; refusing the round, and "
                    "every round of this run of the study, so this site stops. "
                    + RELEASED_WAY_OUT
                )
            return
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.path(statistics.study_sha256)
        atomic_write(path, statistics_bytes(statistics))
        self._cache[statistics.study_sha256] = statistics
