"""Hospital-level DP for training rounds: each site's whole model
update, clipped to L2 norm S, travels DDGauss-encoded in the SecAgg+ integer ring.

Kairouz, Liu & Steinke, "The Distributed Discrete Gaussian Mechanism for Federated
Learning with Secure Aggregation", ICML 2021 (KLS21): clip, scale by 1/gamma, rotate
(randomized Hadamard, shared seed), conditionally round, add a discrete Gaussian share,
reduce modulo 2^bits (`common.privacy.ddgauss`). The coordinator unmasks the modular sum
and undoes the modular clipping, rotation and scale (`decode_sum`).

Who plans what:

* The RING (gamma, bits) must be the same at every site and at the coordinator, so it
  follows from public values only: the study (S, noise multiplier z), the model size d
  and the round's participant count M (`ring_plan`). It is planned for the worst case of
  the noise it must hold (one noise share per site of a sum whose total is z S, i.e.
  n_noise = 1), so the stated wrap bound (<= 2^-40 per round) holds whatever noise share
  each site adds.
* Each site's NOISE share is planned from its own policy (`site_plan`): the round-size
  floor minus its colluding sites T (colluders know their own noise), so the sum is
  never under-noised. The ledger records that plan, write-ahead.

Ring width: SecAgg+ sums uint32 words. The plan first tries a 2^32 ring (the grid step
gamma then follows from the wrap bound); if that would inflate the rounding sensitivity
by more than `MAX_ROUNDING_INFLATION` it widens the ring (`plan_ddgauss` with free
bits, up to 62) and splits every ring element into `limbs` words of `limb_bits` bits,
each below 2^32 / M, so the limb sums never wrap in the 32-bit SecAgg ring and the
coordinator recombines them exactly modulo 2^bits (`to_limbs` / `from_limbs`).

Adaptive intermediaries (Jiang et al., MICCAI 2023): under
``privacy.intermediaries = "auto"`` the coordinator needs the sum of the clipped unit
update norms. Each unit's vector then gets one more coordinate, ``c * min(||delta||, S)``
(`NORM_SEGMENT_SCALE` = c), BEFORE the rotation, so the norm is rounded, noised and
masked with the update in the same DDGauss vector. A unit's combined L2 norm is at most
``S' = S sqrt(1 + c^2)``: the ring, the noise (std z S' per coordinate) and the ledger's
mechanism are planned with S' and dimension d + 1 (`HospitalTerms.sensitivity`,
`HospitalTerms.dimension`), so the epsilon per round is the one planned for z, and the
model update carries sqrt(1 + c^2) more noise (3.1 % at c = 1/4). The norm sum comes out
as the decoded last coordinate / c, with noise std z S' / c (about 4.1 z S at c = 1/4):
a small c costs the model little and the v estimate more; v = sqrt(.) halves the
relative error of that estimate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence

import numpy as np

from common.core.errors import ConfigError, ValidationError
from common.crypto.random import RandomSource
from common.privacy import layered
from common.privacy.accountant import compose_epsilon
from common.privacy.ddgauss import (
    DDGaussPlan,
    ddgauss_decode,
    ddgauss_encode,
    ddgauss_round,
    epsilon_from_rho,
    plan_ddgauss,
    sample_discrete_gaussian,
)
from common.privacy.mechanisms import DistributedDiscreteGaussian, Mechanism
from common.privacy.purpose import Purpose

SECAGG_RING_BITS = 32
MAX_ROUNDING_INFLATION = 0.01
"""Largest gamma * Delta_2 / S - 1 accepted in the 32-bit ring before the ring widens."""
LOG2_WRAP_PROBABILITY = -40.0
"""Stated bound on the probability that some coordinate of a round's sum wraps."""
ROTATION_DOMAIN = b"medfed/v1/ddgauss-rotation"
EVALUATION_RESERVE = 0.2
"""Share of the study's epsilon (after statistics and count) a planned z leaves for the
per-round DP evaluation histograms, which the sites' ledgers compose with the updates."""
NORM_SEGMENT_SCALE = 0.25
"""c: the norm coordinate is c * min(||unit delta||, S) (module docstring: the trade-off)."""
MAX_AUTO_INTERMEDIARIES = 8
"""Largest v the coordinator announces under "auto" (public; a site splits into at most
this many intermediaries, and only as many as its DP patient count allows:
`MIN_PATIENTS_PER_INTERMEDIARY`)."""
MIN_PATIENTS_PER_INTERMEDIARY = 10
"""A site under "auto" trains min(v, DP patient count // this) intermediaries (at least
one): post-processing of its released count, so the choice reveals nothing new."""
AUTO_START_INTERMEDIARIES = 1
"""v of the first hospital round under "auto" (nothing measured yet: the paper's start)."""
MIN_NOISE_MULTIPLIER = 0.3
MAX_NOISE_MULTIPLIER = 1000.0


def limb_layout(*, bits: int, max_sites: int) -> tuple[int, int]:
    """(limbs, limb_bits): one 32-bit word when bits <= 32, else words of limb_bits bits
    with max_sites * (2^limb_bits - 1) < 2^32, so each limb's sum is exact."""
    if bits <= SECAGG_RING_BITS:
        return 1, bits
    width = SECAGG_RING_BITS - math.ceil(math.log2(max_sites + 1))
    if width < 8:
        raise ConfigError("max_sites", f"{max_sites} sites leave too narrow limbs")
    return math.ceil(bits / width), width


def to_limbs(values: np.ndarray, *, bits: int, max_sites: int) -> np.ndarray:
    """Ring elements in [0, 2^bits) -> uint32 words, limb-major (limb 0 of every
    coordinate first). With one limb the values themselves."""
    limbs, width = limb_layout(bits=bits, max_sites=max_sites)
    wide = np.asarray(values).astype(np.uint64, copy=False)
    if limbs == 1:
        return wide.astype(np.uint32)
    out = np.empty(limbs * wide.size, np.uint32)
    mask = np.uint64((1 << width) - 1)
    for k in range(limbs):
        out[k * wide.size : (k + 1) * wide.size] = (wide >> np.uint64(k * width)) & mask
    return out


def from_limbs(words: np.ndarray, *, bits: int, max_sites: int) -> np.ndarray:
    """The modular sum (uint64, in [0, 2^bits)) from the summed limb words."""
    limbs, width = limb_layout(bits=bits, max_sites=max_sites)
    if words.dtype != np.uint32 or words.ndim != 1 or words.size % limbs:
        raise ValidationError("limb words must be a uint32 vector of a whole number of limbs")
    if limbs == 1:
        return words.astype(np.uint64)
    size = words.size // limbs
    total = np.zeros(size, np.uint64)
    for k in range(limbs):
        # Each limb sum is exact (< 2^32); shifted beyond 64 bits it wraps, which is
        # harmless: only the residue modulo 2^bits <= 2^62 is kept.
        total += words[k * size : (k + 1) * size].astype(np.uint64) << np.uint64(k * width)
    total &= np.uint64((1 << bits) - 1)
    return total


@dataclasses.dataclass(frozen=True)
class HospitalTerms:
    """The public terms of hospital-level DP in a study: clip S and noise multiplier z
    (the summed noise has std z S per coordinate in model units)."""

    clip: float
    noise_multiplier: float
    intermediaries: int = 1  # v disjoint units per hospital, each clipped to S alone
    # "auto" intermediaries: each unit's vector carries its clipped norm (c * min(|d|, S))
    # as one more coordinate (module docstring), so the rule can be evaluated.
    norm_segment: bool = False

    @property
    def sensitivity(self) -> float:
        """L2 bound of one unit's vector: S, or S sqrt(1 + c^2) with the norm coordinate."""
        if not self.norm_segment:
            return self.clip
        return self.clip * math.sqrt(1.0 + NORM_SEGMENT_SCALE**2)

    def dimension(self, model_elements: int) -> int:
        """Length of one unit's vector before padding: d, or d + 1 with the norm."""
        return model_elements + (1 if self.norm_segment else 0)

    def for_round(self, intermediaries: int) -> HospitalTerms:
        """These terms with the round's announced v (auto mode changes it per round)."""
        return dataclasses.replace(self, intermediaries=intermediaries)


PER_PATIENT_SENSITIVITY = 2.0
"""A patient added or removed inside a unit that stays in the round moves its clipped
update by up to 2S (the replace relation, `common.privacy.layered.replaced`): the
sensitivity, in units of S, that a hospital-mode study without DP-SGD beneath plans z
for, because its sites' ledgers charge that per-patient figure."""


def plan_noise_multiplier(
    *, epsilon: float, delta: float, rounds: int, sensitivity: float = 1.0,
) -> float:
    """Smallest z (to 1e-4 relative) with `rounds` rounds of a Gaussian of sensitivity
    `sensitivity` x S and std z S, composed in zCDP (rho = rounds sensitivity^2 / 2 z^2,
    inflated by the allowed rounding inflation; Bun & Steinke 2016, Prop. 1.6 and Lemma
    2.3), at most `epsilon` at `delta`. The site's ledger recomposes the exact KLS21
    bound; this only makes z public and deterministic. At `sensitivity` 2 (the
    per-patient relation, `PER_PATIENT_SENSITIVITY`) z is twice the one at 1."""
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ConfigError("privacy.epsilon", "must be positive to plan hospital-level noise")
    if not (sensitivity > 0 and math.isfinite(sensitivity)):
        raise ConfigError("sensitivity", f"must be positive, got {sensitivity!r}")
    rounds = max(int(rounds), 1)
    factor = (1 + MAX_ROUNDING_INFLATION) ** 2 * sensitivity**2

    def eps(z: float) -> float:
        return epsilon_from_rho(rounds * factor / (2 * z * z), delta)

    low, high = MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER
    if eps(high) > epsilon:
        raise ConfigError("privacy.epsilon", f"{epsilon:g} is too small for {rounds} rounds")
    if eps(low) <= epsilon:
        return low
    while high / low > 1 + 1e-4:
        middle = math.sqrt(low * high)
        if eps(middle) <= epsilon:
            high = middle
        else:
            low = middle
    return high


def ring_plan(
    terms: HospitalTerms, *, dim: int, max_sites: int,
    max_inflation: float = MAX_ROUNDING_INFLATION,
) -> DDGaussPlan:
    """The round's ring (gamma, bits), from public values only (module docstring): the
    32-bit SecAgg ring unless its rounding inflation exceeds `max_inflation`, then the
    narrowest wider ring at that inflation."""
    # With the norm coordinate the unit vector is d + 1 long and bounded by S' (module
    # docstring): the noise, the grid and the recorded sensitivity all follow S'.
    clip = terms.sensitivity
    dim = terms.dimension(dim)
    sigma = terms.noise_multiplier * clip
    # v units per site, each a clipped rounded vector: the ring holds M v of them.
    sites = max(max_sites, 1) * max(terms.intermediaries, 1)
    plan = plan_ddgauss(clip=clip, dim=dim, sigma=sigma, n_noise=1, max_sites=sites,
                        bits=SECAGG_RING_BITS, log2_wrap_probability=LOG2_WRAP_PROBABILITY)
    if plan.rounding_inflation <= max_inflation:
        return plan
    return plan_ddgauss(clip=clip, dim=dim, sigma=sigma, n_noise=1, max_sites=sites,
                        rounding_inflation=max_inflation,
                        log2_wrap_probability=LOG2_WRAP_PROBABILITY)


def site_plan(ring: DDGaussPlan, *, n_noise: int) -> DDGaussPlan:
    """The ring with this site's noise share: N_Z(0, (z S / gamma)^2 / n_noise) per
    coordinate, n_noise = round-size floor minus colluders (planned worst case)."""
    if isinstance(n_noise, bool) or not isinstance(n_noise, int) or n_noise < 1:
        raise ConfigError("n_noise", "at least one honest site must add noise")
    if n_noise > ring.max_sites:
        raise ConfigError("n_noise", "cannot exceed the sites of the round")
    plan = dataclasses.replace(ring, n_noise=n_noise)
    if plan.site_sigma < 0.5:
        # KLS21 Proposition 14 needs each share's parameter >= 1/2.
        raise ConfigError("noise_multiplier", "too little noise per site for this grid")
    return plan


def mechanism(plan: DDGaussPlan, *, units: int = 1) -> DistributedDiscreteGaussian:
    """The ledger record of one round (KLS21 Prop. 14): add/remove one unit, i.e. one
    hospital, or one of its `units` intermediaries (then the hospital is v-fold)."""
    return DistributedDiscreteGaussian.from_plan(plan, units=units)


def rotation_seed(*, round_nonce: bytes, study_sha256: bytes, round_number: int) -> bytes:
    """The shared rotation seed: fixed by the announcement, before any update exists
    (KLS21 need it independent of the updates for the wrap bound; it is not secret)."""
    return hashlib.sha256(
        ROTATION_DOMAIN + round_number.to_bytes(8, "big") + round_nonce + study_sha256
    ).digest()


def unit_vector(delta: np.ndarray, *, clip: float, norm_segment: bool) -> np.ndarray:
    """One unit's float64 vector before the DDGauss encoding: the delta itself, or (with
    the norm coordinate) the delta clipped to S followed by c * min(||delta||, S), whose
    L2 norm is then at most S sqrt(1 + c^2) (module docstring). A delta holding NaN or
    infinity is a zero vector (norm coordinate 0 too): zero is in the clipping ball, so
    the unit still contributes, and the site still uploads (`ddgauss.clip_l2`)."""
    flat = np.asarray(delta).reshape(-1)
    if not norm_segment:
        return np.asarray(flat, dtype=np.float64)  # ddgauss_round copies it anyway
    out = np.empty(flat.size + 1, np.float64)
    out[:-1] = flat
    if not np.all(np.isfinite(out[:-1])):
        out[:] = 0.0
        return out
    norm = float(np.linalg.norm(out[:-1]))
    if norm > clip:
        out[:-1] *= clip / norm
    out[-1] = NORM_SEGMENT_SCALE * min(norm, clip)
    return out


def encode_update(
    delta: np.ndarray, *, plan: DDGaussPlan, seed: bytes, rng: RandomSource,
    terms: HospitalTerms | None = None,
) -> np.ndarray:
    """One site's ring words: KLS21 Algorithm 1 (clip to S, scale, rotate, round, noise,
    mod 2^bits), split into limbs for the 32-bit SecAgg ring. `terms` with a norm
    segment: the unit's clipped norm rides as the last coordinate (`unit_vector`)."""
    vector = unit_vector(delta, clip=terms.clip if terms else plan.clip,
                         norm_segment=terms is not None and terms.norm_segment)
    encoded = ddgauss_encode(vector, plan=plan, rotation_seed=seed, rng=rng)
    return to_limbs(encoded, bits=plan.bits, max_sites=plan.max_sites)


def encode_units(
    units: Sequence[np.ndarray], *, plan: DDGaussPlan, seed: bytes, rng: RandomSource,
    terms: HospitalTerms | None = None,
) -> np.ndarray:
    """A site with v intermediaries (Jiang et al. 2023): each unit's
    update clipped, scaled, rotated and conditionally rounded ALONE (so adding or
    removing one unit moves the sum by at most Delta_2), the integer vectors summed, then
    ONE noise share for the site, mod 2^bits, limbs."""
    if not units:
        raise ValidationError("no intermediary updates")
    total = np.zeros(plan.padded_dim, np.int64)
    for unit in units:
        vector = unit_vector(unit, clip=terms.clip if terms else plan.clip,
                             norm_segment=terms is not None and terms.norm_segment)
        total += ddgauss_round(vector, plan=plan, rotation_seed=seed, rng=rng)
    total += sample_discrete_gaussian(plan.padded_dim, sigma=plan.site_sigma, rng=rng)
    total &= np.int64((1 << plan.bits) - 1)
    return to_limbs(total.astype(np.uint64), bits=plan.bits, max_sites=plan.max_sites)


def decode_sum(words: np.ndarray, *, plan: DDGaussPlan, seed: bytes) -> np.ndarray:
    """KLS21 Algorithm 2 on the unmasked limb sums: the float64 noisy sum of the clipped
    updates (length d; d + 1 with the norm coordinate last: `split_norm_sum`)."""
    total = from_limbs(words, bits=plan.bits, max_sites=plan.max_sites)
    return ddgauss_decode(total, plan=plan, rotation_seed=seed)


def split_norm_sum(total: np.ndarray, *, terms: HospitalTerms) -> tuple[np.ndarray, float | None]:
    """(model-sized noisy sum, noisy sum of the clipped unit norms or None): the last
    coordinate / c when the round carried the norm segment."""
    if not terms.norm_segment:
        return total, None
    return total[:-1], float(total[-1]) / NORM_SEGMENT_SCALE


def vector_words(plan: DDGaussPlan) -> int:
    """Length of the update segment in uint32 words."""
    limbs, _ = limb_layout(bits=plan.bits, max_sites=plan.max_sites)
    return limbs * plan.padded_dim


def hospital_level_mechanisms(
    entries: Sequence[tuple[str, Sequence[Mechanism]]],
) -> list[Mechanism]:
    """The model-update mechanisms of (purpose, mechanisms) ledger entries: the DDGauss
    rounds of purpose "training", the releases the hospital-level claim covers."""
    return [
        m.per_hospital() for purpose, mechanisms in entries if purpose == Purpose.TRAINING
        for m in mechanisms if isinstance(m, DistributedDiscreteGaussian)
    ]


def largest_intermediaries(entries: Sequence[tuple[str, Sequence[Mechanism]]]) -> int:
    """The largest v any training round of the history split its hospital into (1 when
    none did): the hospital-level figure is at most v-fold group privacy at this v (each
    round is charged at its own v, `per_hospital`, which is tighter)."""
    return max((m.units for purpose, mechanisms in entries if purpose == Purpose.TRAINING
                for m in mechanisms if isinstance(m, DistributedDiscreteGaussian)), default=1)


def hospital_level_epsilon(
    entries: Sequence[tuple[str, Sequence[Mechanism]]], *, delta: float, accountant: str,
) -> float:
    """Epsilon of the model updates alone (add/remove one hospital), composed in RDP."""
    chosen = hospital_level_mechanisms(entries)
    return compose_epsilon(chosen, delta=delta, accountant=accountant) if chosen else 0.0


def update_mechanisms(
    entries: Sequence[tuple[str, Sequence[Mechanism]]],
) -> list[DistributedDiscreteGaussian]:
    """The DDGauss model-update rounds of a history, at their per-unit sensitivity S."""
    return [m for purpose, mechanisms in entries if purpose == Purpose.TRAINING
            for m in mechanisms if isinstance(m, DistributedDiscreteGaussian)]


@dataclasses.dataclass(frozen=True)
class Guarantees:
    """The three figures a hospital-mode ledger is reported with, named plainly
    (docs/privacy.md, section 7, "Which epsilon to quote"):

    * `hospital`: add/remove one whole hospital, model updates only; each round at its own
      v (`per_hospital`), i.e. v-fold group privacy when the hospital was split;
    * `intermediary`: add/remove one intermediary (the unit each site clips to S), model
      updates only; equal to `hospital` when no round split (v = 1);
    * `per_patient`: one patient (all their records) added or removed inside a
      hospital/intermediary that stays in the round, every release composed: the DDGauss
      rounds at 2S (replace relation), or with DP-SGD beneath the better of that and the
      DP-SGD path (`common.privacy.layered.record_level`, the one shared function).
      Per record instead when the study's record_level is "record".
    """

    hospital: float
    intermediary: float
    per_patient: float
    largest_v: int
    layered: bool
    dpsgd_path: float
    hospital_path: float


def guarantees(
    entries: Sequence[tuple[str, Sequence[Mechanism]]], *, delta: float, accountant: str,
) -> Guarantees:
    """Hospital-level, intermediary-level and per-patient epsilon of a (purpose,
    mechanisms) history (`Guarantees`), for the ledger, the model card and the demo."""
    updates = update_mechanisms(entries)
    whole = hospital_level_epsilon(entries, delta=delta, accountant=accountant)
    split = any(m.units > 1 for m in updates)
    unit = (compose_epsilon(updates, delta=delta, accountant=accountant)
            if split else whole)
    patient = layered.record_level(entries, delta=delta, accountant=accountant)
    return Guarantees(
        hospital=whole, intermediary=unit, per_patient=patient.epsilon,
        largest_v=largest_intermediaries(entries), layered=layered.is_layered(entries),
        dpsgd_path=patient.dpsgd_path, hospital_path=patient.hospital_path,
    )

