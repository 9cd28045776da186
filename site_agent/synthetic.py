"""A synthetic sepsis-like EHR cohort for demos and tests (no real patient anywhere).

Generative story, per site (each site draws from its own profile, so the federation is
deliberately non-IID: different ages, prevalence, case mix and sizes):

* each patient has an age, a frailty ``u ~ N(0, 1)`` and chronic offsets (heart rate,
  blood pressure, kidney function); these are shared by all their encounters;
* each encounter has an acute severity ``s = site_shift + 0.7 u + N(0, 1)`` that moves the
  vitals and labs the way sepsis does (tachycardia, tachypnoea, fever or hypothermia,
  hypotension, hypoxia, raised lactate, abnormal white cells, rising creatinine);
* the label is drawn from ONE known logistic model of the observed features,
  `true_logit`, shared by every site. Sites differ in who they see, not in the biology,
  so a federated model can learn the truth and a test can compare against it.

Vital-sign norms depend on age (children have faster hearts and breathing), and the
ground truth scores deviations from the age norm, which a small MLP can learn.
"""

from __future__ import annotations

import csv
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.core.errors import ConfigError
from site_agent.data import DatasetSchema, SiteData

FEATURES = [
    "age",
    "heart_rate",
    "resp_rate",
    "temperature",
    "systolic_bp",
    "spo2",
    "lactate",
    "wbc",
    "creatinine",
]
LABEL = "sepsis"
PATIENT_ID = "patient_id"
SCHEMA = DatasetSchema(features=FEATURES, label=LABEL, patient_id=PATIENT_ID)


@dataclass(frozen=True)
class SiteProfile:
    """How one kind of hospital's population differs from the others."""

    age_range: tuple[float, float]
    patients: int
    mean_extra_encounters: float  # encounters per patient = 1 + Poisson(this)
    severity_shift: float  # higher = sicker case mix = higher prevalence
    creatinine_shift: float  # log-scale chronic kidney offset of the population
    temperature_bias: float  # device / measurement-site bias (rural thermometers)


PROFILES: dict[str, SiteProfile] = {
    "paediatric": SiteProfile((0.0, 17.0), 500, 1.0, -0.6, -0.5, 0.0),
    "geriatric": SiteProfile((65.0, 95.0), 700, 2.5, 0.5, 0.35, -0.1),
    "rural": SiteProfile((18.0, 90.0), 400, 1.5, 0.1, 0.1, 0.25),
    "urban_academic": SiteProfile((18.0, 90.0), 1000, 1.8, 0.3, 0.0, 0.0),
    "community": SiteProfile((25.0, 85.0), 700, 1.2, -0.3, 0.05, 0.0),
}

# Ground-truth coefficients over standardised clinical deviations (see true_logit).
TRUE_INTERCEPT = -3.8
TRUE_COEFFICIENTS = {
    "heart_rate": 0.4,
    "resp_rate": 0.4,
    "temperature": 0.45,
    "systolic_bp": 0.4,
    "spo2": 0.3,
    "lactate": 0.6,
    "wbc": 0.3,
    "creatinine": 0.2,
    "age": 0.15,
}


def _normal_heart_rate(age: np.ndarray) -> np.ndarray:
    return 80.0 + 50.0 * np.exp(-age / 6.0)


def _normal_resp_rate(age: np.ndarray) -> np.ndarray:
    return 16.0 + 22.0 * np.exp(-age / 4.0)


def true_logit(features: np.ndarray) -> np.ndarray:
    """The known log-odds of sepsis given raw features (columns in `FEATURES` order)."""
    age, hr, rr, temp, sbp, spo2, lactate, wbc, creat = (features[:, j] for j in range(9))
    terms = {
        "heart_rate": (hr - _normal_heart_rate(age)) / 15.0,
        "resp_rate": (rr - _normal_resp_rate(age)) / 4.0,
        "temperature": np.abs(temp - 37.0) / 0.8,
        "systolic_bp": (120.0 - sbp) / 15.0,
        "spo2": (97.0 - spo2) / 2.0,
        "lactate": np.log(lactate / 1.2) / 0.35,
        "wbc": np.abs(np.log(wbc / 8.0)) / 0.3,
        "creatinine": np.log(creat / 0.9) / 0.3,
        "age": (age - 50.0) / 25.0,
    }
    logit = np.full(features.shape[0], TRUE_INTERCEPT)
    for name, value in terms.items():
        logit = logit + TRUE_COEFFICIENTS[name] * value
    return logit


def _site_rng(seed: int, site: str) -> np.random.Generator:
    # Seeded per (seed, site name) so a site's data does not depend on which other
    # sites are generated or in what order.
    return np.random.default_rng([seed, zlib.crc32(site.encode())])


def _generate_site(site: str, profile: SiteProfile, *, patients: int, seed: int) -> SiteData:
    rng = _site_rng(seed, site)
    age_p = rng.uniform(*profile.age_range, size=patients)
    frailty_p = rng.normal(size=patients)
    hr_offset_p = rng.normal(0.0, 6.0, size=patients)
    bp_offset_p = rng.normal(0.0, 10.0, size=patients)
    kidney_p = profile.creatinine_shift + 0.012 * (age_p - 50.0) + rng.normal(0.0, 0.15, patients)
    encounters = 1 + rng.poisson(profile.mean_extra_encounters, size=patients)
    owner = np.repeat(np.arange(patients), encounters)
    n = owner.shape[0]

    age = age_p[owner] + rng.uniform(0.0, 0.5, size=n)  # encounters spread over months
    severity = profile.severity_shift + 0.7 * frailty_p[owner] + rng.normal(size=n)
    acute = np.maximum(severity, 0.0)
    fever_sign = np.where(rng.random(n) < 0.85, 1.0, -1.0)  # some septic patients are cold
    heart_rate = _normal_heart_rate(age) + hr_offset_p[owner] + 12.0 * severity
    heart_rate += rng.normal(0.0, 8.0, n)
    resp_rate = _normal_resp_rate(age) + 3.0 * severity + rng.normal(0.0, 2.5, n)
    temperature = 37.0 + profile.temperature_bias + fever_sign * 0.8 * acute
    temperature += rng.normal(0.0, 0.35, n)
    systolic_bp = 118.0 + 0.25 * np.clip(age - 20.0, 0.0, None) + bp_offset_p[owner]
    systolic_bp += -11.0 * severity + rng.normal(0.0, 8.0, n)
    spo2 = np.clip(97.5 - 1.8 * acute + rng.normal(0.0, 1.2, n), 70.0, 100.0)
    lactate = np.exp(np.log(1.2) + 0.35 * severity + rng.normal(0.0, 0.3, n))
    wbc = np.exp(np.log(8.0) + 0.3 * fever_sign * acute + rng.normal(0.0, 0.25, n))
    creatinine = np.exp(np.log(0.9) + kidney_p[owner] + 0.15 * acute + rng.normal(0.0, 0.15, n))

    features = np.stack(
        [age, heart_rate, resp_rate, temperature, systolic_bp, spo2, lactate, wbc, creatinine],
        axis=1,
    )
    risk = 1.0 / (1.0 + np.exp(-true_logit(features)))
    labels = (rng.random(n) < risk).astype(np.int64)
    ids = np.array([f"{site}-p{i:05d}" for i in range(patients)], dtype=object)[owner]
    return SiteData(
        features=features.astype(np.float32),
        labels=labels,
        patient_ids=ids,
        feature_names=list(FEATURES),
        source=f"synthetic:{site}",
    )


def site_names(count: int) -> list[str]:
    """The first `count` site names, cycling through the profiles (``rural-2`` ...)."""
    base = list(PROFILES)
    names = []
    for i in range(count):
        name = base[i % len(base)]
        names.append(name if i < len(base) else f"{name}-{i // len(base) + 1}")
    return names


def _profile_for(site: str, position: int) -> SiteProfile:
    for name, profile in PROFILES.items():
        if site == name or site.startswith(name + "-"):
            return profile
    return list(PROFILES.values())[position % len(PROFILES)]


def generate_cohort(
    sites: list[str] | int, *, seed: int, patients_per_site: int | None = None
) -> dict[str, SiteData]:
    """Synthetic data per site; deterministic by `seed`.

    Site names matching a profile (``paediatric``, ``geriatric``, ``rural``,
    ``urban_academic``, ``community``, optionally with a ``-N`` suffix) use it; other
    names take profiles in turn. `patients_per_site` overrides every profile's size.
    """
    names = site_names(sites) if isinstance(sites, int) else list(sites)
    if not names or len(set(names)) != len(names):
        raise ConfigError("sites", "need at least one site and distinct site names")
    if patients_per_site is not None and patients_per_site < 1:
        raise ConfigError("patients_per_site", "must be >= 1")
    cohort = {}
    for position, site in enumerate(names):
        profile = _profile_for(site, position)
        patients = patients_per_site if patients_per_site is not None else profile.patients
        cohort[site] = _generate_site(site, profile, patients=patients, seed=seed)
    return cohort


def write_site_csvs(directory: str | Path, cohort: dict[str, SiteData]) -> dict[str, Path]:
    """One CSV per site (``<site>.csv``: patient_id, the features, sepsis)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for site, data in cohort.items():
        path = out / f"{site}.csv"
        with path.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow([PATIENT_ID, *FEATURES, LABEL])
            ids = data.patient_ids if data.patient_ids is not None else np.arange(len(data))
            for pid, row, label in zip(ids, data.features, data.labels):
                writer.writerow([pid, *(f"{v:.6g}" for v in row), int(label)])
        paths[site] = path
    return paths
