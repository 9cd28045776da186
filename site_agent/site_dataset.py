"""A site's data under its study: one seam for tables and images.

`open_site_dataset` reads the site's `data.path` as its study declares it: a table
(`TableDataset`, CSV or Parquet) or an image folder with labels.csv
(`ImageFolderDataset`). Both answer the same questions, so the training hook and the
trainer hold one path each:

* **split by unit** (`split`): each privacy unit (a patient, or a record without a
  patient column) is held out or trained on by a keyed hash under the site's secret
  split key (`site_agent.unit_split`). A table is split once the federation's global
  statistics encoded it (`needs_statistics`); pixels need none, so a folder splits as
  soon as it is checked.
* **loader**: both splits are `Records`; `records.loader(device)` maps a tensor of
  record indices to model inputs (a table's rows live on the device whole, images are
  decoded per physical batch through a bounded cache) and `records.load(index)` gives
  a batch on the CPU for scoring.
* **loss and scorer**: the study's task decides them, not the data's kind:
  `site_agent.task_loss` over the labels, `site_agent.held_out.held_out_histogram`
  over the held-out `Records`.
* the site's contribution to the study's **statistics release**
  (`statistics_contribution`, noiseless; the agent adds the noise).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from common.core.config import SiteSettings
from common.core.errors import ConfigError
from site_agent.unit_split import (
    site_split_key,
    split_by_patient,
    training_unit_count,
    unit_ids,
)

if TYPE_CHECKING:
    import torch

    from common.study import GlobalStatistics, Study
    from site_agent.data import StudyTable
    from site_agent.imaging import ImageDataset

log = logging.getLogger("medfed.site")


class Records(Protocol):
    """Labelled records a site trains on or scores: a table's encoded rows
    (`site_agent.data.SiteData`) or an image folder's files
    (`site_agent.imaging.ImageDataset`)."""

    @property
    def labels(self) -> np.ndarray: ...

    @property
    def patient_ids(self) -> np.ndarray | None: ...

    @property
    def source(self) -> str: ...

    def __len__(self) -> int: ...

    @property
    def num_patients(self) -> int: ...

    @property
    def record_shape(self) -> tuple[int, ...]: ...

    def subset(self, index: np.ndarray) -> Any: ...

    def load(self, index: np.ndarray) -> torch.Tensor: ...

    def loader(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]: ...


@dataclass(frozen=True)
class UnitSplit:
    """A site's records split by privacy unit: what it trains on, what it holds out."""

    train: Records
    holdout: Records
    in_features: int | None  # a table's encoded width; None for images
    patients: int  # training patients (0 without a patient column)


class SiteDataset(Protocol):
    """A site's data under its study (module docstring)."""

    needs_statistics: ClassVar[bool]
    # `grad_sample_mode = "auto"` measures record-level DP-SGD's path when the study is
    # joined (a network large enough that measuring takes minutes on a CPU), not in a round.
    measure_at_join: ClassVar[bool]

    @property
    def has_patients(self) -> bool: ...

    def statistics_contribution(self) -> np.ndarray: ...

    def split(self, statistics: GlobalStatistics | None) -> UnitSplit: ...

    def training_units(self, *, unit: str) -> int: ...


def open_site_dataset(
    study: Study, settings: SiteSettings, *, path: Path, dp: bool
) -> SiteDataset:
    """This site's `path` read as `study` declares it (checked: `DataError` naming the
    file, row and column)."""
    if study.data.kind == "images":
        return ImageFolderDataset.open(study, settings, path=path)
    return TableDataset.open(study, settings, path=path, dp=dp)


class TableDataset:
    """A study table (CSV or Parquet), encoded with the federation's global statistics."""

    needs_statistics: ClassVar[bool] = True
    measure_at_join: ClassVar[bool] = False

    def __init__(self, table: StudyTable, study: Study, settings: SiteSettings, *,
                 dp: bool) -> None:
        self.table = table
        self.study = study
        self.settings = settings
        self.dp = dp

    @classmethod
    def open(cls, study: Study, settings: SiteSettings, *, path: Path,
             dp: bool) -> TableDataset:
        from site_agent.data import load_study_table

        return cls(load_study_table(path, study), study, settings, dp=dp)

    @property
    def has_patients(self) -> bool:
        return self.table.patient_ids is not None

    def statistics_contribution(self) -> np.ndarray:
        """The table's encoded statistics release (common/releases/statistics.py)."""
        from common.crypto.random import numpy_generator, system_random
        from common.releases.statistics import encode_release

        gen = numpy_generator(system_random)
        return encode_release(self.table, self.study, uniform=lambda n: gen.random(n))

    def split(self, statistics: GlobalStatistics | None) -> UnitSplit:
        """The table encoded with the federation's global `statistics`, split by patient
        (`encode_study_table`)."""
        if statistics is None:
            raise ConfigError("statistics", "a study table is encoded with global statistics")
        train, holdout, features, patients = encode_study_table(
            self.table, self.study, statistics, self.settings, dp=self.dp
        )
        return UnitSplit(train, holdout, features, patients)

    def training_units(self, *, unit: str) -> int:
        """The `unit`s DP-SGD will train on after this site's held-out split, known before
        the statistics encode the table (a unit's side depends on its id and the site's
        key alone)."""
        from site_agent.unit_split import study_record_keys

        ids = self.table.patient_ids
        return training_unit_count(
            ids if ids is not None else study_record_keys(self.table),
            key=site_split_key(self.settings.state),
            held_out_fraction=self.settings.data.holdout_fraction, unit=unit)


def encode_study_table(
    table: Any, study: Study, statistics: GlobalStatistics, settings: SiteSettings, *, dp: bool
) -> tuple[Any, Any, int, int]:
    """(training split, held-out split, features, training patients) of a study table
    encoded with the federation's global statistics, split by patient with the site's
    held-out fraction under its secret split key; with DP the cohort must be large
    enough."""
    from site_agent.data import Preprocessor, check_cohort_size
    from site_agent.unit_split import study_record_keys

    pre = Preprocessor(study, statistics)
    data = pre.site_data(table)
    if dp:
        unit = "patient" if data.patient_ids is not None else "record"
        check_cohort_size(data.num_patients, delta=settings.privacy.delta, unit=unit,
                          file=str(settings.data.path))
    imputed = pre.imputations(table)
    if imputed:
        log.info("imputed with the global statistics: %s", imputed)
    # Without a patient column a record is its unit, keyed by its values as read (not
    # as encoded with the federation's statistics).
    train, holdout = split_by_patient(
        data, held_out_fraction=settings.data.holdout_fraction,
        key=site_split_key(settings.state),
        units=None if data.patient_ids is not None else study_record_keys(table),
    )
    patients = train.num_patients if data.patient_ids is not None else 0
    return train, holdout, int(data.features.shape[1]), patients


class ImageFolderDataset:
    """An images study's folder: image files plus labels.csv (`site_agent.imaging`)."""

    needs_statistics: ClassVar[bool] = False
    measure_at_join: ClassVar[bool] = True

    def __init__(self, images: ImageDataset, study: Study, settings: SiteSettings) -> None:
        self.images = images
        self.study = study
        self.settings = settings

    @classmethod
    def open(cls, study: Study, settings: SiteSettings, *, path: Path) -> ImageFolderDataset:
        from site_agent.imaging import image_spec_for_study, load_image_folder

        # A file that no longer decodes in a round is an all-zero image, not a stop
        # (`site_agent.imaging`): the site's rounds never depend on it.
        return cls(load_image_folder(path, image_spec_for_study(study, blank_unreadable=True)),
                   study, settings)

    @property
    def has_patients(self) -> bool:
        return self.images.patient_ids is not None

    def statistics_contribution(self) -> np.ndarray:
        """An images study has no features: its release is the unit count alone."""
        from common.releases.statistics import statistics_length

        units = np.zeros(statistics_length(self.study), dtype=np.int64)
        units[0] = self.images.num_patients
        return units

    def split(self, statistics: GlobalStatistics | None) -> UnitSplit:
        """The folder split by patient (pixels are scaled by fixed rules, so the global
        statistics play no part)."""
        train, holdout = split_by_patient(
            self.images, held_out_fraction=self.settings.data.holdout_fraction,
            key=site_split_key(self.settings.state),
        )
        return UnitSplit(train, holdout, None,
                         train.num_patients if self.has_patients else 0)

    def training_units(self, *, unit: str) -> int:
        """The `unit`s DP-SGD will train on after this site's held-out split."""
        return training_unit_count(
            unit_ids(self.images), key=site_split_key(self.settings.state),
            held_out_fraction=self.settings.data.holdout_fraction, unit=unit)
