"""A site's training data: its file, image folder or synthetic slice
(`load_configured_data`), split by patient under the site's key (`split_site_data`), the
privacy unit it trains under (`configured_privacy_unit`), a study table encoded with the
federation's global statistics and split by patient (`encode_study_table`), and its
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
    """The study in the site's own ``study_file``, if it names one."""
    from common.study import load_study

    if settings.study_file is None:
        return None
    return load_study(settings.study_file)


def load_configured_data(settings: SiteSettings, study: Study | None = None) -> Any:
    """This site's records: its image folder for an images study, its file with the
    declared schema, or its slice of the embedded synthetic cohort."""
    from site_agent.data import DatasetSchema, load_site_data
    from site_agent.synthetic import FEATURES, generate_cohort

    data_cfg = settings.data
    if study is not None and study.data.kind == "images":
        from site_agent.imaging import image_spec_for_study, load_image_folder

        if data_cfg.path is None:
            raise ConfigError("data.path", "an images study needs --data FOLDER (with labels.csv)")
        return load_image_folder(data_cfg.path, image_spec_for_study(study))
    if data_cfg.synthetic:
        # Only when asked for explicitly (--synthetic): a site's own file is never
        # replaced by the embedded cohort.
        return generate_cohort(
            [settings.site],
            seed=data_cfg.synthetic_cohort_seed or 0,
            patients_per_site=data_cfg.synthetic_patients,
        )[settings.site]
    if data_cfg.path is None:
        raise ConfigError(
            "data.path", "name this site's data file (--data FILE), or ask for the built-in "
            "demo cohort explicitly with --synthetic"
        )
    features = data_cfg.features or list(FEATURES)
    schema = DatasetSchema(
        features=features,
        label=data_cfg.label_column,
        patient_id=data_cfg.patient_column,
        nan_policy=data_cfg.nan_policy,
    )
    return load_site_data(data_cfg.path, schema)


def split_site_data(data: Any, settings: SiteSettings) -> tuple[Any, Any]:
    """(training, held-out) split of a site's records (a table, encoded and standardised
    on its training part, or an image folder) by patient, with the site's held-out
    fraction under its secret split key (`unit_split`)."""
    from site_agent.data import prepare_site_split
    from site_agent.imaging import ImageDataset
    from site_agent.unit_split import site_split_key, split_by_patient

    fraction, key = settings.data.holdout_fraction, site_split_key(settings.state)
    if isinstance(data, ImageDataset):
        return split_by_patient(data, held_out_fraction=fraction, key=key)
    train, holdout, _ = prepare_site_split(data, held_out_fraction=fraction, key=key)
    return train, holdout


def configured_privacy_unit(settings: SiteSettings, *, dp: bool, has_patients: bool) -> str:
    """The site's `privacy.privacy_unit` ("auto": patient with a patient column, else
    record); "none" without DP."""
    unit = settings.privacy.privacy_unit
    if not dp:
        return "none"
    if unit == "auto":
        return "patient" if has_patients else "record"
    return unit


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
