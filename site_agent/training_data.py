"""A site's training data under its study: an image folder (`load_site_images`) split
by patient under the site's secret key (`split_site_images`), a study table encoded with
the federation's global statistics and split by patient (`encode_study_table`), and its
contribution to the statistics release (`statistics_contribution`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from common.config import SiteSettings
from common.errors import ConfigError

if TYPE_CHECKING:
    from common.study import GlobalStatistics, Study

log = logging.getLogger("medfed.site")


def load_site_study(settings: SiteSettings) -> Study | None:
    """The study in the site's own ``study_file``, if it names one, else the study
    approved with `medfed site approve` (STATE/approved/study.json), if any."""
    from common.study import load_study
    from site_agent.approvals import Approvals

    if settings.study_file is None:
        return Approvals(settings.state).study()
    return load_study(settings.study_file)


def load_site_images(settings: SiteSettings, study: Study) -> Any:
    """This site's image folder (`data.path`, with labels.csv) for an images study."""
    from site_agent.imaging import image_spec_for_study, load_image_folder

    if settings.data.path is None:
        raise ConfigError("data.path", "an images study needs --data FOLDER (with labels.csv)")
    return load_image_folder(settings.data.path, image_spec_for_study(study))


def split_site_images(data: Any, settings: SiteSettings) -> tuple[Any, Any]:
    """(training, held-out) split of a site's image folder by patient, with the site's
    held-out fraction under its secret split key (`unit_split`; tables:
    `encode_study_table`)."""
    from site_agent.unit_split import site_split_key, split_by_patient

    return split_by_patient(data, held_out_fraction=settings.data.holdout_fraction,
                            key=site_split_key(settings.state))


def encode_study_table(
    table: Any, study: Study, statistics: GlobalStatistics, settings: SiteSettings, *, dp: bool
) -> tuple[Any, Any, int, int]:
    """(training split, held-out split, features, training patients) of a study table
    encoded with the federation's global statistics, split by patient with the site's
    held-out fraction under its secret split key; with DP the cohort must be large
    enough."""
    from site_agent.data import Preprocessor, check_cohort_size
    from site_agent.unit_split import site_split_key, split_by_patient, study_record_keys

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


def statistics_contribution(study: Study, table: Any, *, image_units: int) -> np.ndarray:
    """A site's noiseless integer contribution to the study's statistics release
    (common/statistics.py; the agent adds the noise): an images study's unit count
    alone, or the table's encoded release."""
    from common.crypto.random import numpy_generator, system_random
    from common.statistics import encode_release, statistics_length

    if study.data.kind == "images":
        # An images study has no features: its release is the unit count alone.
        units = np.zeros(statistics_length(study), dtype=np.int64)
        units[0] = image_units
        return units
    gen = numpy_generator(system_random)
    return encode_release(table, study, uniform=lambda n: gen.random(n))
