"""The distributed discrete Gaussian mechanism (DDGauss) and its exact noise sampler.

Papers implemented here (cited again next to each piece):

* CKS20 - Canonne, Kamath, Steinke, "The Discrete Gaussian for Differential Privacy",
  NeurIPS 2020: Algorithm 1 (Bernoulli(exp(-gamma))), Algorithm 2 (discrete Laplace),
  Algorithm 3 (discrete Gaussian), the zCDP -> (eps, delta) conversion (Corollary 13).
* KLS21 - Kairouz, Liu, Steinke, "The Distributed Discrete Gaussian Mechanism for
  Federated Learning with Secure Aggregation", ICML 2021 (arXiv 2102.06387): client
  procedure (clip, scale by 1/gamma, random rotation, conditional randomized rounding,
  discrete Gaussian noise, modular clipping), the post-rounding norm bound (Theorem 1,
  Proposition 22) and the privacy of a sum of discrete Gaussians (Proposition 14).

Randomness: every random draw comes from a ChaCha20 keystream keyed by 32 bytes taken
from the caller's `RandomSource` (production: the OS CSPRNG). The rotation signs come
from a *shared* seed (every site and the server expand the same one) through the
SecAgg mask PRG.

Deviation from exact rational arithmetic (CKS20 sample with rationals): acceptance
probabilities are float64 and each Bernoulli(p) is `u < p` with u a 53-bit uniform.
The sampler keeps CKS20's factorisation exp(-g) = exp(-1)^floor(g) * exp(-frac(g)) and
Algorithm 1's Bernoulli(frac/K) chain, so every elementary probability is realised to
within ~2^-52 *relative* error and no tail is truncated: the sampled pmf is within a
factor 1 +- (g(y) + 4) * 2^-50 of the exact one at every y (g(y) ~ y^2 / 2 sigma^2), which
changes the Renyi divergences by O(2^-45) at the orders an accountant uses. The outputs
are integers, so the float attack on the Laplace mechanism (Mironov 2012: low-order bits
of a float output) has nothing to read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from common.core.errors import ConfigError, PrivacyError, ValidationError
from common.crypto.random import RandomSource
from common.privacy.rotation import padded_length, rotate, unrotate

SAMPLE_CHUNK = 1 << 20
"""Noise values drawn per vectorised batch (bounds the sampler's scratch memory)."""

DEFAULT_BETA = math.exp(-0.5)
"""KLS21's default conditional-rounding parameter beta (their experiments' choice)."""

MAX_BITS = 62
"""Widest ring: values and sums stay exact in int64 arithmetic below 2**62."""

MAX_ROUNDING_TRIES = 1000
"""Conditional rounding succeeds with probability >= 1 - beta per try (KLS21 Thm 1)."""

_EXP_MINUS_ONE = math.exp(-1.0)
_FINEST_GRID = 2.0**-30
_KEY_BYTES = 32
_ZERO_NONCE = bytes(16)
_WORD = np.dtype("<u8")


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(name, "must be a positive finite number")
    return value


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ConfigError(name, "must be a positive integer")
    return int(value)


# ---------------------------------------------------------------------------------------
# Random words


class NoiseStream:
    """Uniform words from a ChaCha20 keystream keyed by 32 bytes of a `RandomSource`.

    ChaCha20 is a cryptographic PRG, so the stream is as unpredictable as its key, and
    it is fast enough (GB/s) for the ~100 bytes per coordinate the samplers consume.
    """

    def __init__(self, rng: RandomSource) -> None:
        key = rng(_KEY_BYTES)
        if not isinstance(key, bytes | bytearray) or len(key) != _KEY_BYTES:
            raise ValidationError("the random source returned the wrong number of bytes")
        self._cipher = Cipher(algorithms.ChaCha20(bytes(key), _ZERO_NONCE), mode=None)
        self._context = self._cipher.encryptor()

    def _bytes(self, count: int) -> bytes:
        return self._context.update(bytes(count))

    def words(self, count: int) -> np.ndarray:
        """`count` uniform uint64 words."""
        return np.frombuffer(self._bytes(8 * count), dtype=_WORD).astype(np.uint64)

    def uniform(self, count: int) -> np.ndarray:
        """`count` uniforms on the grid {k / 2**53}: float64 in [0, 1), exact."""
        words = self.words(count)
        words >>= np.uint64(11)
        return words.astype(np.float64) * (1.0 / (1 << 53))

    def bits(self, count: int) -> np.ndarray:
        """`count` fair coin flips as a bool array."""
        raw = np.frombuffer(self._bytes((count + 7) // 8), dtype=np.uint8)
        return np.unpackbits(raw, count=count).astype(bool)

    def below(self, count: int, bound: int) -> np.ndarray:
        """`count` uniform integers in [0, bound) (int64), by exact rejection sampling."""
        if bound == 1:
            return np.zeros(count, np.int64)
        remainder = (1 << 64) % bound  # words >= 2^64 - remainder would bias the modulus
        limit = np.uint64((1 << 64) - remainder) if remainder else None
        out = np.empty(count, np.int64)
        pending = np.arange(count)
        while pending.size:
            words = self.words(pending.size)
            good = np.ones(words.size, bool) if limit is None else words < limit
            out[pending[good]] = (words[good] % np.uint64(bound)).astype(np.int64)
            pending = pending[~good]
        return out


# ---------------------------------------------------------------------------------------
# CKS20 samplers, vectorised: each rejection loop runs over the still-pending entries.


def bernoulli_exp(gamma: np.ndarray, stream: NoiseStream) -> np.ndarray:
    """Bool array with P(True) = exp(-gamma) elementwise (CKS20 Algorithm 1), gamma >= 0.

    exp(-gamma) = exp(-1)^floor(gamma) * exp(-frac(gamma)); the fractional factor is
    Algorithm 1's chain: K <- 1; while Bernoulli(frac / K): K <- K + 1; True iff K odd.
    """
    gamma = np.asarray(gamma, np.float64)
    if gamma.size and not (float(gamma.min()) >= 0 and math.isfinite(float(gamma.max()))):
        raise ValidationError("bernoulli_exp needs finite gamma >= 0")
    result = np.ones(gamma.size, bool)
    whole = np.floor(gamma)
    fraction = gamma - whole
    active = np.flatnonzero(whole > 0)
    done = 0
    while active.size:
        failed = stream.uniform(active.size) >= _EXP_MINUS_ONE
        result[active[failed]] = False
        done += 1
        active = active[~failed & (whole[active] > done)]
    active = np.flatnonzero(result)
    k = 1
    while active.size:
        again = stream.uniform(active.size) < fraction[active] / k
        stopped = active[~again]
        if k % 2 == 0:
            result[stopped] = False
        active = active[again]
        k += 1
    return result


def _geometric_exp_minus_one(count: int, stream: NoiseStream) -> np.ndarray:
    """Number of Bernoulli(exp(-1)) successes before the first failure (int64)."""
    out = np.zeros(count, np.int64)
    active = np.arange(count)
    while active.size:
        success = stream.uniform(active.size) < _EXP_MINUS_ONE
        active = active[success]
        out[active] += 1
    return out


def _fill_discrete_gaussian(out: np.ndarray, *, sigma2: float, t: int, stream: NoiseStream) -> None:
    """CKS20 Algorithm 3 (with Algorithm 2 for the discrete Laplace proposal), batched."""
    pending = np.arange(out.size)
    while pending.size:
        m = pending.size
        # Algorithm 2: U uniform in [0, t), keep with prob exp(-U/t); V ~ Geometric(1 - 1/e).
        u = stream.below(m, t)
        kept = np.flatnonzero(bernoulli_exp(u / t, stream))
        x = u[kept] + t * _geometric_exp_minus_one(kept.size, stream)
        negative = stream.bits(kept.size)
        valid = ~(negative & (x == 0))
        kept, x, negative = kept[valid], x[valid], negative[valid]
        # Algorithm 3: accept Y = +-X with prob exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2)).
        gap = (x * float(t) - sigma2) / float(t)
        accept = bernoulli_exp(gap * gap / (2.0 * sigma2), stream)
        chosen = kept[accept]
        values = x[accept]
        out[pending[chosen]] = np.where(negative[accept], -values, values)
        left = np.ones(m, bool)
        left[chosen] = False
        pending = pending[left]


def sample_discrete_gaussian(
    size: int, *, sigma: float, rng: RandomSource, out: np.ndarray | None = None
) -> np.ndarray:
    """`size` iid draws of N_Z(0, sigma^2) (P(y) ~ exp(-y^2 / 2 sigma^2) on the integers).

    Exact up to float64 acceptance probabilities (module docstring). Returns int64 `out`.
    """
    sigma = _positive("sigma", sigma)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValidationError("size must be a non-negative integer")
    if out is None:
        out = np.empty(size, np.int64)
    elif out.dtype != np.int64 or out.shape != (size,):
        raise ValidationError("out must be a 1-D int64 array of the requested size")
    stream = NoiseStream(rng)
    t = math.floor(sigma) + 1
    for start in range(0, size, SAMPLE_CHUNK):
        stop = min(size, start + SAMPLE_CHUNK)
        _fill_discrete_gaussian(out[start:stop], sigma2=sigma * sigma, t=t, stream=stream)
    return out


# ---------------------------------------------------------------------------------------
# KLS21 client and server steps


def clip_l2(x: np.ndarray, *, clip: float) -> float:
    """In place: scale x down to L2 norm <= clip (no-op when already inside). Returns the
    factor applied, so a caller can report how often clipping bites.

    A vector holding NaN or infinity becomes zero (factor 0): the mechanism needs only
    that every site's (or unit's) clipped vector has norm <= clip and is computed from
    its own data (KLS21, Thm. 1 takes any vector in the ball), and zero is in it. So a
    model update that overflowed is still sent, as zero plus the site's noise share,
    and never turns into a dropout the coordinator could read.

    >>> x = np.array([3.0, 4.0])  # norm 5
    >>> clip_l2(x, clip=2.5), x.tolist()
    (0.5, [1.5, 2.0])
    >>> clip_l2(x, clip=2.5)  # already inside: untouched
    1.0
    >>> y = np.array([np.inf, 1.0])
    >>> clip_l2(y, clip=2.5), y.tolist()
    (0.0, [0.0, 0.0])
    """
    clip = _positive("clip", clip)
    with np.errstate(over="ignore", invalid="ignore"):
        norm = float(np.sqrt(np.dot(x, x)))
    if not math.isfinite(norm):
        x[...] = 0.0
        return 0.0
    factor = min(1.0, clip / norm) if norm > 0 else 1.0
    if factor < 1.0:
        x *= factor
    return factor


def rounded_l2_bound(norm: float, *, beta: float, dim: int) -> float:
    """KLS21 Theorem 1 / Proposition 22: the L2 bound enforced after conditional rounding
    of a vector of norm <= `norm` in `dim` coordinates (in the integer grid's units):
    min(norm + sqrt(d), sqrt(norm^2 + d/4 + sqrt(2 ln(1/beta)) (norm + sqrt(d)/2))).
    beta = 0 disables the second (conditional) bound.

    >>> rounded_l2_bound(3.0, beta=0, dim=16)  # 3 + sqrt(16)
    7.0
    >>> bound = rounded_l2_bound(3.0, beta=0.5, dim=16)  # the conditional bound is tighter
    >>> bound == math.sqrt(9 + 4 + math.sqrt(2 * math.log(2)) * (3 + 2)) and bound < 7.0
    True
    """
    if not 0 <= beta < 1:
        raise ConfigError("beta", "must be in [0, 1)")
    root_d = math.sqrt(dim)
    plain = norm + root_d
    if beta == 0:
        return plain
    squared = norm * norm + dim / 4 + math.sqrt(2 * math.log(1 / beta)) * (norm + root_d / 2)
    return min(plain, math.sqrt(squared))


def conditional_round(
    z: np.ndarray, *, bound: float, stream: NoiseStream, max_tries: int = MAX_ROUNDING_TRIES
) -> np.ndarray:
    """KLS21 conditional randomized rounding: round each z_i up with probability frac(z_i)
    (unbiased), retrying the whole vector until its integer L2 norm is <= bound.

    The norm is checked in exact int64 arithmetic, so the sensitivity bound holds for the
    integers that leave the site whatever float error the rotation made."""
    floor = np.floor(z)
    fraction = z - floor
    limit = math.floor(bound * bound)
    base = floor.astype(np.int64)
    del floor
    rounded: np.ndarray = np.empty_like(base)
    for _ in range(max_tries):
        up = stream.uniform(z.size) < fraction
        np.add(base, up, out=rounded)
        if int(np.dot(rounded, rounded)) <= limit:
            return rounded
    raise PrivacyError(
        f"conditional rounding failed {max_tries} times: the input norm exceeds the clip"
    )


def _modular_wrap_log2(
    *,
    gamma: float,
    bits: int,
    clip: float,
    padded_dim: int,
    max_sites: int,
    sigma: float,
    n_noise: int,
) -> float:
    """log2 of an upper bound on P(some coordinate of the integer sum leaves the ring).

    Coordinate j of the integer sum over M <= max_sites sites is A_j + N_j + R_j:
    A_j = (U sum x_i)_j / gamma is a Rademacher sum (signs D from the seed, fixed
    inputs), sub-Gaussian with variance proxy ||sum x_i||^2 / (gamma^2 D) <= (M c)^2 /
    (gamma^2 D); N_j, the sum of M site noises N_Z(0, s^2) (each s^2-sub-Gaussian, CKS20),
    has proxy M s^2; the rounding errors R_j satisfy |R_j| < M deterministically (so the
    conditional retries do not disturb the bound). Hence with t = 2^(b-1) - 1 - M,
    P(wrap) <= sum_j P(|A_j + N_j| > t) <= 2 D exp(-t^2 / (2 V)),
    V = ((M c)^2 / D + M sigma^2 / n_noise) / gamma^2.
    """
    t = 2.0 ** (bits - 1) - 1 - max_sites
    if t <= 0:
        return 0.0
    variance = ((max_sites * clip) ** 2 / padded_dim + max_sites * sigma**2 / n_noise) / gamma**2
    log_p = math.log(2 * padded_dim) - t * t / (2 * variance)
    return min(0.0, log_p / math.log(2))


@dataclass(frozen=True)
class DDGaussPlan:
    """One round's parameters of the distributed discrete Gaussian (KLS21 Algorithm 1/2).

    Model units: clip, sigma, gamma. Integer-grid units (after scaling by 1/gamma):
    site_sigma, l2_sensitivity. The mechanism's privacy is `rho` (zCDP, KLS21 Prop. 14)
    for the zero-out neighbour relation (one site's update replaced by zero; its noise
    share stays): the ledger records rho and these parameters.
    """

    clip: float
    dim: int
    padded_dim: int
    sigma: float
    n_noise: int
    max_sites: int
    gamma: float
    beta: float
    bits: int
    log2_wrap_probability: float

    @property
    def site_sigma(self) -> float:
        """Each site's discrete Gaussian parameter, in grid units: sigma / (gamma sqrt(n))."""
        return self.sigma / (self.gamma * math.sqrt(self.n_noise))

    @property
    def l2_sensitivity(self) -> float:
        """The conditional-rounding norm bound Delta_2, in grid units (KLS21 Theorem 1)."""
        return rounded_l2_bound(self.clip / self.gamma, beta=self.beta, dim=self.padded_dim)

    @property
    def l1_sensitivity(self) -> float:
        """Delta_1 <= min(Delta_2^2, sqrt(D) Delta_2) for an integer vector."""
        d2 = self.l2_sensitivity
        return min(d2 * d2, math.sqrt(self.padded_dim) * d2)

    @property
    def rounding_inflation(self) -> float:
        """gamma * Delta_2 / clip - 1: how much rounding inflates the sensitivity."""
        return self.gamma * self.l2_sensitivity / self.clip - 1.0

    @property
    def dtype(self) -> np.dtype[np.unsignedinteger]:
        """The ring's word: uint32 up to 32 bits (today's SecAgg ring), else uint64."""
        return np.dtype(np.uint32) if self.bits <= 32 else np.dtype(np.uint64)

    @property
    def wire_bytes(self) -> int:
        """Bytes of one site's encoded vector (before SecAgg framing)."""
        return self.padded_dim * self.dtype.itemsize

    def rho(self, *, replacement: bool = False) -> float:
        """zCDP of one round for one site (KLS21 Prop. 14, see `ddgauss_rho`)."""
        factor = 2.0 if replacement else 1.0
        return ddgauss_rho(
            l2_sensitivity=factor * self.l2_sensitivity,
            l1_sensitivity=factor * self.l1_sensitivity,
            site_sigma=self.site_sigma,
            n_noise=self.n_noise,
            dim=self.padded_dim,
        )

    def rdp(self, orders: Sequence[float], *, replacement: bool = False) -> np.ndarray:
        """Renyi DP at `orders` (KLS21 Prop. 14, tighter than rho * alpha for RDP use)."""
        factor = 2.0 if replacement else 1.0
        return ddgauss_rdp(
            orders,
            l2_sensitivity=factor * self.l2_sensitivity,
            l1_sensitivity=factor * self.l1_sensitivity,
            site_sigma=self.site_sigma,
            n_noise=self.n_noise,
            dim=self.padded_dim,
        )


def plan_ddgauss(
    *,
    clip: float,
    dim: int,
    sigma: float,
    n_noise: int,
    max_sites: int | None = None,
    bits: int | None = None,
    beta: float = DEFAULT_BETA,
    rounding_inflation: float = 0.01,
    log2_wrap_probability: float = -40.0,
) -> DDGaussPlan:
    """Choose gamma and the ring width for one round.

    clip: L2 bound c of each site's update; dim: its length d; sigma: target standard
    deviation of the *summed* noise in model units (e.g. noise_multiplier * clip);
    n_noise: the sites whose noise is counted (round-size floor minus colluders T),
    each site adds N_Z(0, (sigma / gamma)^2 / n_noise); max_sites: most sites in one
    sum (default n_noise), which sizes the ring.

    bits None: gamma is the largest grid step with gamma * Delta_2 <= (1 +
    rounding_inflation) * c, then bits is the smallest width with P(wrap) <=
    2^log2_wrap_probability (bound in `_modular_wrap_log2`). bits given (e.g. 32, the
    SecAgg ring): gamma is the smallest (finest) step for which that ring keeps the
    wrap bound, but never below 2^-30 * clip.
    """
    clip = _positive("clip", clip)
    sigma = _positive("sigma", sigma)
    dim = _positive_int("dim", dim)
    n_noise = _positive_int("n_noise", n_noise)
    max_sites = n_noise if max_sites is None else _positive_int("max_sites", max_sites)
    if max_sites < n_noise:
        raise ConfigError("max_sites", "must be at least n_noise")
    if not 0 <= beta < 1:
        raise ConfigError("beta", "must be in [0, 1)")
    if not log2_wrap_probability < 0:
        raise ConfigError("log2_wrap_probability", "must be negative")
    padded = padded_length(dim)
    # Wrap-free iff 2^(b-1) - 1 - M >= gamma_0 / gamma (see _modular_wrap_log2).
    k_sq = 2 * (math.log(2 * padded) - log2_wrap_probability * math.log(2))
    spread = math.sqrt(k_sq * ((max_sites * clip) ** 2 / padded + max_sites * sigma**2 / n_noise))
    if bits is None:
        inflation = _positive("rounding_inflation", rounding_inflation)
        target = (1 + inflation) * clip

        def excess(gamma: float) -> float:
            return gamma * rounded_l2_bound(clip / gamma, beta=beta, dim=padded) - target

        # excess() increases with gamma; bisect in log space, keeping the feasible end.
        low, high = clip * 1e-15, clip
        for _ in range(200):
            middle = math.sqrt(low * high)
            if excess(middle) <= 0:
                low = middle
            else:
                high = middle
        gamma = low
        headroom = spread / gamma + 1 + max_sites
        bits = max(2, math.ceil(math.log2(headroom)) + 1)
        if bits > MAX_BITS:
            raise ConfigError("bits", f"would need {bits} > {MAX_BITS}: allow more inflation")
    else:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= MAX_BITS:
            raise ConfigError("bits", f"must be an integer in [2, {MAX_BITS}]")
        room = 2.0 ** (bits - 1) - 1 - max_sites
        if room <= 0:
            raise ConfigError("bits", f"a {bits}-bit ring cannot hold {max_sites} sites")
        # Never finer than 2^-30 of the clip (int64 norms stay exact; the wrap bound only
        # improves with a coarser grid).
        gamma = max(spread / room * (1 + 1e-9), clip * _FINEST_GRID)
    if clip / gamma > 1 / _FINEST_GRID * (1 + 1e-6):
        raise ConfigError("bits", "grid finer than 2^-30 of the clip: int64 norms could overflow")
    log2_wrap = _modular_wrap_log2(
        gamma=gamma,
        bits=bits,
        clip=clip,
        padded_dim=padded,
        max_sites=max_sites,
        sigma=sigma,
        n_noise=n_noise,
    )
    return DDGaussPlan(
        clip=clip,
        dim=dim,
        padded_dim=padded,
        sigma=sigma,
        n_noise=n_noise,
        max_sites=max_sites,
        gamma=gamma,
        beta=beta,
        bits=bits,
        log2_wrap_probability=log2_wrap,
    )


def ddgauss_round(
    update: np.ndarray, *, plan: DDGaussPlan, rotation_seed: bytes, rng: RandomSource
) -> np.ndarray:
    """The noiseless part of a site's contribution (KLS21 Algorithm 1, steps 1-4): clip to
    L2 <= c, scale by 1/gamma, pad to D and rotate with the shared seed, round
    conditionally so that the int64 result has L2 norm <= plan.l2_sensitivity."""
    if not isinstance(update, np.ndarray) or update.size != plan.dim:
        raise ValidationError(f"update must be a numpy array of {plan.dim} values")
    work = np.zeros(plan.padded_dim, np.float64)
    work[: plan.dim] = update.reshape(-1)
    clip_l2(work, clip=plan.clip)
    work *= 1.0 / plan.gamma
    rotate(work, seed=rotation_seed)
    return conditional_round(work, bound=plan.l2_sensitivity, stream=NoiseStream(rng))


def ddgauss_encode(
    update: np.ndarray, *, plan: DDGaussPlan, rotation_seed: bytes, rng: RandomSource
) -> np.ndarray:
    """One site's contribution (KLS21 Algorithm 1): `ddgauss_round`, plus N_Z(0,
    site_sigma^2) per coordinate, reduced modulo 2^bits. Returns plan.dtype, length D.

    The rotation seed must be fixed after the sites' updates (or be independent of
    them) for the stated wrap bound; it is not secret."""
    rounded = ddgauss_round(update, plan=plan, rotation_seed=rotation_seed, rng=rng)
    noise = sample_discrete_gaussian(plan.padded_dim, sigma=plan.site_sigma, rng=rng)
    rounded += noise
    del noise
    rounded &= np.int64((1 << plan.bits) - 1)
    return rounded.astype(plan.dtype)


def ddgauss_decode(total: np.ndarray, *, plan: DDGaussPlan, rotation_seed: bytes) -> np.ndarray:
    """The server's step (KLS21 Algorithm 2): the modular sum of the sites' vectors (in
    any ring 2^B with B >= bits) -> signed integers -> unrotate -> times gamma -> unpad.
    Returns the float64 noisy sum of the clipped updates (length dim)."""
    if not isinstance(total, np.ndarray) or total.dtype.kind != "u" or total.ndim != 1:
        raise ValidationError("the aggregated vector must be a 1-D unsigned numpy array")
    if total.size != plan.padded_dim:
        raise ValidationError(f"the aggregated vector must have {plan.padded_dim} values")
    values = total.astype(np.int64) if total.dtype.itemsize < 8 else total.view(np.int64)
    values = values & np.int64((1 << plan.bits) - 1)
    half = np.int64(1 << (plan.bits - 1))
    values[values >= half] -= np.int64(1 << plan.bits)
    signed = values.astype(np.float64)
    del values
    unrotate(signed, seed=rotation_seed)
    signed *= plan.gamma
    return signed[: plan.dim].copy()


# ---------------------------------------------------------------------------------------
# Accounting


def noise_tau(*, site_sigma: float, n_noise: int) -> float:
    """KLS21 Theorem 1's tau = 10 * sum_{k=1}^{n-1} exp(-2 pi^2 s^2 k / (k+1)), s the
    per-site discrete Gaussian parameter (grid units): how far a sum of n discrete
    Gaussians is from one discrete Gaussian of parameter sqrt(n) s.

    >>> noise_tau(site_sigma=1.0, n_noise=1)  # one site: its own noise, no gap
    0.0
    >>> noise_tau(site_sigma=1.0, n_noise=2) == 10 * math.exp(-math.pi**2)
    True
    """
    site_sigma = _positive("site_sigma", site_sigma)
    n_noise = _positive_int("n_noise", n_noise)
    total = 0.0
    for k in range(1, n_noise):
        total += math.exp(-2 * math.pi**2 * site_sigma**2 * k / (k + 1))
    return 10.0 * total


def ddgauss_rdp(
    orders: Sequence[float],
    *,
    l2_sensitivity: float,
    l1_sensitivity: float,
    site_sigma: float,
    n_noise: int,
    dim: int,
) -> np.ndarray:
    """KLS21 Proposition 14: the sum of n independent N_Z(0, s^2) on Z^d, sensitivities
    Delta_2, Delta_1 (grid units), is (alpha, eps(alpha))-RDP with eps(alpha) = min of
      alpha/2 Delta_2^2/(n s^2) + tau d,
      alpha/2 (Delta_2^2/(n s^2) + 2 tau Delta_1/(sqrt(n) s) + tau^2 d),
      alpha/2 (Delta_2/(sqrt(n) s) + tau sqrt(d))^2."""
    tau = noise_tau(site_sigma=site_sigma, n_noise=n_noise)
    scale = math.sqrt(n_noise) * site_sigma
    l2 = l2_sensitivity / scale
    l1 = l1_sensitivity / scale
    alphas = np.asarray(orders, np.float64)
    if alphas.size and float(alphas.min()) <= 1:
        raise ConfigError("orders", "RDP orders must be > 1")
    first = alphas / 2 * l2 * l2 + tau * dim
    second = alphas / 2 * (l2 * l2 + 2 * tau * l1 + tau * tau * dim)
    third = alphas / 2 * (l2 + tau * math.sqrt(dim)) ** 2
    result: np.ndarray = np.minimum(np.minimum(first, second), third)
    return result


def ddgauss_rho(
    *,
    l2_sensitivity: float,
    l1_sensitivity: float,
    site_sigma: float,
    n_noise: int,
    dim: int,
) -> float:
    """rho such that the round is rho-zCDP (D_alpha <= rho * alpha for every alpha > 1).

    From KLS21 Prop. 14 (`ddgauss_rdp`): each of the three terms is <= rho_i * alpha for
    alpha > 1 with rho_1 = l2^2/2 + tau d (the constant tau d is at most tau d * alpha),
    rho_2 = (l2^2 + 2 tau l1 + tau^2 d)/2, rho_3 = (l2 + tau sqrt(d))^2 / 2, so rho =
    min(rho_i), i.e. 1/2 eps^2-CDP with eps = min(sqrt(l2^2 + 2 tau d), ...). (KLS21
    Theorem 1 prints the first term as sqrt(l2^2 + tau d / 2); we use 2 tau d, which is
    never smaller. At planned parameters tau < 1e-30, so the choice is immaterial.)
    """
    tau = noise_tau(site_sigma=site_sigma, n_noise=n_noise)
    scale = math.sqrt(n_noise) * site_sigma
    l2 = l2_sensitivity / scale
    l1 = l1_sensitivity / scale
    return min(
        l2 * l2 / 2 + tau * dim,
        (l2 * l2 + 2 * tau * l1 + tau * tau * dim) / 2,
        (l2 + tau * math.sqrt(dim)) ** 2 / 2,
    )


def epsilon_from_rho(rho: float, delta: float) -> float:
    """(eps, delta)-DP implied by rho-zCDP: the smaller of Bun & Steinke (2016, Prop. 1.3)
    eps = rho + 2 sqrt(rho ln(1/delta)) and CKS20 Corollary 13,
    eps = inf_{alpha>1} alpha rho + (ln(1/delta) + (alpha-1) ln(1-1/alpha) - ln alpha)/(alpha-1).
    The latter holds at every alpha, so minimising over a grid can only over-report.

    >>> epsilon_from_rho(0.0, 1e-5)
    0.0
    >>> rho, delta = 0.5, 1e-5  # never worse than Bun & Steinke's closed form
    >>> epsilon_from_rho(rho, delta) <= rho + 2 * math.sqrt(rho * math.log(1 / delta))
    True
    """
    if not (math.isfinite(rho) and rho >= 0):
        raise ConfigError("rho", "must be a finite number >= 0")
    if not 0 < delta < 1:
        raise ConfigError("delta", "must be in (0, 1)")
    if rho == 0:
        return 0.0
    log_inv_delta = math.log(1 / delta)
    classic = rho + 2 * math.sqrt(rho * log_inv_delta)

    # CKS20 Cor. 13 on a log grid of alpha - 1, refined once around the best point.
    exponents = np.linspace(-20.0, 20.0, 4001)
    for _ in range(2):
        alpha_minus_one = np.exp(exponents)
        alpha = 1 + alpha_minus_one
        values = (
            alpha * rho
            + (log_inv_delta + alpha_minus_one * np.log1p(-1 / alpha) - np.log(alpha))
            / alpha_minus_one
        )
        best = int(np.nanargmin(values))
        exponents = np.linspace(
            exponents[max(best - 1, 0)], exponents[min(best + 1, exponents.size - 1)], 201
        )
    return max(0.0, min(classic, float(np.nanmin(values))))


# ---------------------------------------------------------------------------------------
# Integer counts (histograms, statistics): no rotation, no rounding.


def count_site_sigma(*, sigma: float, n_noise: int) -> float:
    """Each site's N_Z parameter so that n_noise sites sum to variance ~ sigma^2."""
    return _positive("sigma", sigma) / math.sqrt(_positive_int("n_noise", n_noise))


def count_noise(length: int, *, sigma: float, n_noise: int, rng: RandomSource) -> np.ndarray:
    """The int64 noise one site adds to an integer vector (counts, histogram, clipped
    integer sums) before masking: N_Z(0, sigma^2 / n_noise) per entry, so the secure sum
    of n_noise honest sites carries noise of variance ~ sigma^2 per entry."""
    return sample_discrete_gaussian(
        length, sigma=count_site_sigma(sigma=sigma, n_noise=n_noise), rng=rng
    )


def count_rho(
    *,
    sigma: float,
    n_noise: int,
    l2_sensitivity: float,
    length: int,
    l1_sensitivity: float | None = None,
) -> float:
    """zCDP of one release of `count_noise`-noised integer vectors summed over sites.

    l2_sensitivity (and l1, default min(Delta_2^2, sqrt(length) Delta_2) for integer
    vectors) in count units, for whichever neighbour relation the caller accounts
    (e.g. one patient's counts, or a whole site's under hospital-level privacy)."""
    l2 = _positive("l2_sensitivity", l2_sensitivity)
    length = _positive_int("length", length)
    l1 = min(l2 * l2, math.sqrt(length) * l2) if l1_sensitivity is None else l1_sensitivity
    return ddgauss_rho(
        l2_sensitivity=l2,
        l1_sensitivity=_positive("l1_sensitivity", l1),
        site_sigma=count_site_sigma(sigma=sigma, n_noise=n_noise),
        n_noise=n_noise,
        dim=length,
    )
