"""The study: one definition of what a federation trains, checked by every site.

`schema` holds the study file's model and its canonical bytes and digest;
`global_statistics` the preprocessing statistics the DP statistics release produces;
`policy` a site's privacy policy and the check it runs against a study. Every name is
importable from `common.study`.
"""

from __future__ import annotations

from common.study.global_statistics import (
    CategoricalStatistics,
    GlobalStatistics,
    NumericStatistics,
    check_statistics,
    load_statistics,
    statistics_bytes,
    statistics_from_bytes,
)
from common.study.policy import (
    SitePrivacyPolicy,
    check_study_against_policy,
    study_round_terms,
)
from common.study.schema import (
    FACTORY_PATTERN,
    FORMULA_STARTS,
    MAX_NAME_CHARS,
    MAX_STUDY_BYTES,
    MISSING_SUFFIX,
    NAME_PATTERN,
    STUDY_FORMAT,
    UNIT_STRENGTH,
    ClassLabel,
    DataSection,
    EvaluationSection,
    FeatureSpec,
    ModelSection,
    PrivacyUnit,
    Study,
    StudyModel,
    StudyPrivacySection,
    StudySection,
    TrainingSection,
    check_name,
    class_index,
    encoded_feature_names,
    first_problem,
    intermediaries_warning,
    load_study,
    study_bytes,
    study_from_bytes,
    study_from_enrolment,
    study_from_mapping,
    study_sha256,
)

__all__ = [
    "FACTORY_PATTERN",
    "FORMULA_STARTS",
    "MAX_NAME_CHARS",
    "MAX_STUDY_BYTES",
    "MISSING_SUFFIX",
    "NAME_PATTERN",
    "STUDY_FORMAT",
    "UNIT_STRENGTH",
    "CategoricalStatistics",
    "ClassLabel",
    "DataSection",
    "EvaluationSection",
    "FeatureSpec",
    "GlobalStatistics",
    "ModelSection",
    "NumericStatistics",
    "PrivacyUnit",
    "SitePrivacyPolicy",
    "Study",
    "StudyModel",
    "StudyPrivacySection",
    "StudySection",
    "TrainingSection",
    "check_name",
    "check_statistics",
    "check_study_against_policy",
    "class_index",
    "encoded_feature_names",
    "first_problem",
    "intermediaries_warning",
    "load_statistics",
    "load_study",
    "statistics_bytes",
    "statistics_from_bytes",
    "study_bytes",
    "study_from_bytes",
    "study_from_enrolment",
    "study_from_mapping",
    "study_round_terms",
    "study_sha256",
]
