"""Checked, error-correcting Shamir reconstruction for the SecAgg+ Unmask phase.

Why: Bonawitz et al. 2017 (sec. 4, Unmask) interpolate each secret from any t shares.
A holder that reveals a well-formed but wrong y-value then silently changes the secret,
and the server strips the wrong mask: a completed round with a wrong sum. Here every
secret comes with a check (the owner's commitment to its self-mask seed b_u, or the
advertised public key of its mask-agreement key), and when more than t shares are
available every share is checked against the interpolated polynomial.

Shamir shares of one secret are a Reed-Solomon codeword of dimension t (McEliece and
Sarwate 1981), so wrong shares are correctable errors:

1. fast path (honest round): interpolate from the first t shares; accept when the
   secret passes its check and every other share lies on the same polynomial;
2. Berlekamp-Welch (Welch and Berlekamp, US patent 4,633,470, 1986; e.g. Gemmell and
   Sudan 1992) corrects up to floor((m - t) / 2) wrong shares of m in O(m^3) field
   operations;
3. beyond that radius, a bounded search over t-subsets (exhaustive while C(m, t) is at
   most `max_subsets`, else that many pseudo-random ones) for a subset whose secret
   passes the check.

Blame (who is named in `CheckedSecret.disagreeing`): only holders whose share
provably disagrees with the one polynomial the shares decode to. Once the secret s has
passed its check, the dealer's polynomial is a codeword of the affine code
{p : deg p < t, p(0) = s}, of minimum distance m - t + 2 (two such polynomials differ by
x r(x) with deg r < t - 1, which vanishes at no more than t - 2 nonzero x). So within
`blame_radius` = floor((m - t + 1) / 2) wrong shares the codeword is unique: we find it by
Berlekamp-Welch on (y_i - s) / x_i and name exactly the shares off it. Beyond that
radius several codewords may fit equally well (colluding holders that know s can place
their shares on another polynomial through (0, s) and some honest shares, so that
maximum agreement would name honest holders); then the secret is still used (it passed
its check, so the sum is right) but nobody is named.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from common.core.errors import CryptoError, ValidationError
from common.crypto.shamir import PRIME, SECRET_BYTES

SecretCheck = Callable[[bytes], bool]
"""True when a reconstructed 32-byte secret is the owner's (commitment / public key)."""

MAX_SUBSETS = 2000
"""Upper bound on t-subsets tried per secret after Berlekamp-Welch fails (each costs
O(m t) field operations plus one check; only a misbehaving holder makes us pay it)."""

_SEARCH_SEED = 0x6D65_6466_6564  # "medfed"

_SECRET_LIMIT = 1 << (8 * SECRET_BYTES)


@dataclass(frozen=True)
class CheckedSecret:
    """A secret that passed its check, and the x-coordinates whose shares disagree."""

    secret: bytes
    disagreeing: tuple[int, ...]


def blame_radius(count: int, threshold: int) -> int:
    """Most wrong shares among `count` for which the holders named are exactly the wrong
    ones (unique decoding of the affine code through the checked secret, see module doc);
    with threshold 1 every share must equal the secret, so every wrong one is provable."""
    if threshold == 1:
        return count
    return max(count - threshold + 1, 0) // 2


@functools.lru_cache(maxsize=4096)
def _inverse(value: int) -> int:
    """(value mod PRIME)^-1; the arguments are small differences of holder indices."""
    return pow(value % PRIME, -1, PRIME)


class _Newton:
    """The polynomial of degree < len(xs) through the given points, in Newton form.

    Divided differences cost O(t^2) multiplications with cached inverses of the (small)
    x differences; each evaluation then costs O(t).
    """

    def __init__(self, xs: Sequence[int], ys: Sequence[int]) -> None:
        coefficients = list(ys)
        for level in range(1, len(xs)):
            for i in range(len(xs) - 1, level - 1, -1):
                coefficients[i] = (
                    (coefficients[i] - coefficients[i - 1]) * _inverse(xs[i] - xs[i - level])
                ) % PRIME
        self._xs = tuple(xs)
        self._coefficients = coefficients

    def __call__(self, x: int) -> int:
        value = self._coefficients[-1]
        for i in range(len(self._coefficients) - 2, -1, -1):
            value = (value * (x - self._xs[i]) + self._coefficients[i]) % PRIME
        return value


class _Monomial:
    """A polynomial by its coefficients, lowest degree first (Horner evaluation)."""

    def __init__(self, coefficients: Sequence[int]) -> None:
        self._coefficients = tuple(coefficients)

    def __call__(self, x: int) -> int:
        value = 0
        for coefficient in reversed(self._coefficients):
            value = (value * x + coefficient) % PRIME
        return value


Polynomial = _Newton | _Monomial


def reconstruct_checked(
    xs: Sequence[int],
    ys: Sequence[int],
    *,
    threshold: int,
    check: SecretCheck,
    max_subsets: int = MAX_SUBSETS,
) -> CheckedSecret:
    """Recover the secret shared with `threshold` from shares (xs[i], ys[i]).

    Raises ValidationError for malformed input (fewer than `threshold` shares, repeated
    x) and CryptoError when no polynomial consistent with enough shares yields a secret
    that passes `check` (too many wrong shares, or a check the owner made false).
    """
    if len(xs) != len(ys) or len(xs) < threshold or threshold < 1:
        raise ValidationError("need at least `threshold` shares, one y per x")
    if len(set(xs)) != len(xs):
        raise ValidationError("Shamir x-coordinates must be distinct")
    count = len(xs)
    failed: list[frozenset[int]] = []  # agreement sets of polynomials that failed

    # 1. Fast path: the first t shares, every other share must agree.
    polynomial = _Newton(xs[:threshold], ys[:threshold])
    agreeing = _agreeing(polynomial, xs, ys, start=threshold)  # the first t lie on it
    secret = _passing_secret(polynomial, check)
    if secret is not None and len(agreeing) == count:
        return CheckedSecret(secret=secret, disagreeing=())
    if secret is not None and _certainly_best(len(agreeing), count, threshold):
        return _blame(xs, ys, agreeing, secret, threshold=threshold)
    if secret is None:
        if len(agreeing) == count:
            # Every t-subset interpolates this same polynomial: nothing to correct.
            raise CryptoError()
        failed.append(agreeing)
    best: tuple[frozenset[int], bytes] | None = (agreeing, secret) if secret else None

    # 2. Berlekamp-Welch within its unique-decoding radius.
    radius = (count - threshold) // 2
    if radius > 0:
        decoded = _berlekamp_welch(xs, ys, threshold=threshold, errors=radius)
        if decoded is not None:
            agreeing = _agreeing(decoded, xs, ys)
            secret = _passing_secret(decoded, check)
            if secret is None:
                failed.append(agreeing)
            elif count - len(agreeing) <= radius:
                return _blame(xs, ys, agreeing, secret, threshold=threshold)
            elif best is None or len(agreeing) > len(best[0]):
                best = (agreeing, secret)

    # 3. Bounded search over t-subsets for a secret that passes the check.
    for subset in _subsets(count, threshold, max_subsets):
        members = frozenset(subset)
        if any(members <= seen for seen in failed) or (best and members <= best[0]):
            continue  # interpolates a polynomial already tried
        candidate = _Newton([xs[i] for i in subset], [ys[i] for i in subset])
        agreeing = _agreeing(candidate, xs, ys)
        secret = _passing_secret(candidate, check)
        if secret is None:
            if len(agreeing) > threshold:  # else only this very subset gives it
                failed.append(agreeing)
        elif best is None or len(agreeing) > len(best[0]):
            best = (agreeing, secret)
        if best is not None and _certainly_best(len(best[0]), count, threshold):
            break
    if best is None:
        raise CryptoError()
    return _blame(xs, ys, best[0], best[1], threshold=threshold)


def _subsets(count: int, threshold: int, limit: int) -> Iterator[tuple[int, ...]]:
    """All t-subsets of range(count) when there are at most `limit`, else `limit`
    pseudo-random ones (fixed seed: reproducible; not a secret, since the wrong shares
    are wherever their senders are, whatever order we try).

    With e wrong shares a random t-subset is all honest with probability
    C(m - e, t) / C(m, t), e.g. 0.46 % for m = 23, t = 12, e = 6: found in ~220 tries.
    """
    if math.comb(count, threshold) <= limit:
        yield from itertools.combinations(range(count), threshold)
        return
    generator = random.Random(_SEARCH_SEED)  # noqa: S311 - an order, not a secret
    for _ in range(limit):
        yield tuple(sorted(generator.sample(range(count), threshold)))


def _certainly_best(agreeing: int, count: int, threshold: int) -> bool:
    """No other polynomial of degree < t can agree with as many of the `count` shares:
    two such polynomials share at most t - 1 points, so another one agrees with at
    most (count - agreeing) + t - 1 shares."""
    return 2 * agreeing > count + threshold - 1


def _blame(
    xs: Sequence[int],
    ys: Sequence[int],
    agreeing: frozenset[int],
    secret: bytes,
    *,
    threshold: int,
) -> CheckedSecret:
    """`secret` (checked) with the holders provably off the unique polynomial through it.

    `agreeing` are the shares on the candidate that yielded `secret`. If that candidate
    is within `blame_radius` it is the unique codeword; otherwise Berlekamp-Welch on the
    affine code looks for one; if none is that close, nobody is named.
    """
    count = len(xs)
    radius = blame_radius(count, threshold)
    if count - len(agreeing) <= radius:
        return _result(xs, agreeing, secret)
    if threshold >= 2 and all(x % PRIME for x in xs):
        s = int.from_bytes(secret, "big")
        # p(x) = s + x r(x) with deg r < t - 1: decode r from (y_i - s) / x_i.
        shifted = [((y - s) * _inverse(x)) % PRIME for x, y in zip(xs, ys)]
        decoded = _berlekamp_welch(xs, shifted, threshold=threshold - 1, errors=radius)
        if decoded is not None:
            on = _agreeing(decoded, xs, shifted)
            if count - len(on) <= radius:
                return _result(xs, on, secret)
    return CheckedSecret(secret=secret, disagreeing=())


def _result(xs: Sequence[int], agreeing: frozenset[int], secret: bytes) -> CheckedSecret:
    return CheckedSecret(
        secret=secret,
        disagreeing=tuple(xs[i] for i in range(len(xs)) if i not in agreeing),
    )


def _agreeing(
    polynomial: Polynomial, xs: Sequence[int], ys: Sequence[int], *, start: int = 0
) -> frozenset[int]:
    """Indices of the shares on `polynomial`; those before `start` are taken as on it."""
    return frozenset(range(start)) | frozenset(
        i for i in range(start, len(xs)) if polynomial(xs[i]) == ys[i] % PRIME
    )


def _passing_secret(polynomial: Polynomial, check: SecretCheck) -> bytes | None:
    value = polynomial(0)
    if value >= _SECRET_LIMIT:
        return None
    secret = value.to_bytes(SECRET_BYTES, "big")
    return secret if check(secret) else None


def _berlekamp_welch(
    xs: Sequence[int], ys: Sequence[int], *, threshold: int, errors: int
) -> _Monomial | None:
    """Decode assuming at most `errors` wrong shares; None when that is not the case.

    Unknowns: the error locator E(x) = x^e + a_{e-1} x^{e-1} + ... + a_0 and
    Q(x) = E(x) P(x) of degree < e + t, from Q(x_i) = y_i E(x_i) for every share.
    """
    columns = errors + errors + threshold
    rows = []
    for x, y in zip(xs, ys):
        powers = [pow(x, j, PRIME) for j in range(errors + threshold)]
        # sum_j b_j x^j - y * sum_{j<e} a_j x^j = y * x^e
        row = [(-y * powers[j]) % PRIME for j in range(errors)] + powers
        rows.append([*row, (y * pow(x, errors, PRIME)) % PRIME])
    solution = _solve(rows, columns)
    if solution is None:
        return None
    locator = [*solution[:errors], 1]
    product = solution[errors:]
    quotient, remainder = _divide(product, locator)
    if any(remainder) or len(quotient) > threshold:
        return None
    return _Monomial(quotient)


def _solve(rows: list[list[int]], columns: int) -> list[int] | None:
    """One solution of an augmented linear system mod PRIME (free variables = 0)."""
    pivots: list[int] = []
    rank = 0
    for column in range(columns):
        pivot = next((r for r in range(rank, len(rows)) if rows[r][column]), None)
        if pivot is None:
            continue
        rows[rank], rows[pivot] = rows[pivot], rows[rank]
        scale = pow(rows[rank][column], -1, PRIME)
        rows[rank] = [(value * scale) % PRIME for value in rows[rank]]
        for r in range(len(rows)):
            factor = rows[r][column]
            if r != rank and factor:
                rows[r] = [
                    (value - factor * lead) % PRIME for value, lead in zip(rows[r], rows[rank])
                ]
        pivots.append(column)
        rank += 1
    if any(row[-1] for row in rows[rank:]):
        return None  # inconsistent: more errors than assumed
    solution = [0] * columns
    for r, column in enumerate(pivots):
        solution[column] = rows[r][-1]
    return solution


def _divide(numerator: Sequence[int], divisor: Sequence[int]) -> tuple[list[int], list[int]]:
    """Polynomial long division mod PRIME (coefficients lowest degree first; the
    divisor is monic)."""
    remainder = list(numerator)
    degree = len(divisor) - 1
    quotient = [0] * max(len(remainder) - degree, 0)
    for shift in range(len(remainder) - 1 - degree, -1, -1):
        factor = remainder[shift + degree]
        quotient[shift] = factor
        if factor:
            for j, coefficient in enumerate(divisor):
                remainder[shift + j] = (remainder[shift + j] - factor * coefficient) % PRIME
    while quotient and quotient[-1] == 0:
        quotient.pop()
    return quotient, remainder[:degree]
