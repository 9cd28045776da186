"""`medfed bench ddgauss`: per-site cost of the distributed discrete Gaussian mechanism.

For each dimension d, one site's encode is timed step by step, exactly as
`ddgauss_encode` runs it (clip + scale, pad + randomized Hadamard rotation, conditional
randomized rounding, discrete Gaussian noise for all padded coordinates, reduction
modulo 2^bits), then the server's decode of one aggregated vector (signed map, inverse
rotation, scale, unpad). Randomness is the production source (os.urandom keying the
ChaCha20 noise stream). The plan is the default one (rounding inflation 1%, wrap
probability <= 2^-40) unless --bits fixes the ring; the padded length, ring width and
the bytes one site puts on the wire are reported with the timings.

`--in-round` adds, per dimension, the figure a hospital-level round actually costs,
side by side with the plain 32-bit SecAgg ring in one run: the site's
`common.privacy.hospital.encode_update` as `site_agent.hospital` calls it (ring planned
by `ring_plan` from public values, the site's noise share by `site_plan`; clip + rotate +
round + noise + modular reduction + limbs) against the plain round's `quantize` (clip
per coordinate, stochastic rounding into `bits_for_sites` bits), the coordinator's
`decode_sum` against `dequantize_sum`, and the bytes each site puts on the wire (the
DDGauss ring pads to a power of two; the plain ring is 4 d bytes). Ratios are
hospital / plain.

Wall and CPU time are both printed: the development VM is shared, so wall time
inflates under load while CPU time stays near the unloaded figure.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import numpy as np

from common.crypto.quantize import bits_for_sites, dequantize_sum, quantize
from common.crypto.random import numpy_generator, system_random
from common.privacy import hospital
from common.privacy.ddgauss import (
    NoiseStream,
    clip_l2,
    conditional_round,
    ddgauss_decode,
    plan_ddgauss,
    sample_discrete_gaussian,
)
from common.privacy.rotation import rotate

STEPS = ("clip_scale", "rotate", "round", "noise", "modular", "encode_total", "decode")
_T = TypeVar("_T")


def _timed(
    times: dict[str, list[float]], cpu: dict[str, list[float]], step: str, call: Callable[[], _T]
) -> _T:
    start, start_cpu = time.perf_counter(), time.process_time()
    result = call()
    times[step].append(time.perf_counter() - start)
    cpu[step].append(time.process_time() - start_cpu)
    return result


def run_dimension(
    *, dim: int, repeats: int, sites: int, noise_sites: int, bits: int | None
) -> dict[str, Any]:
    """Time `repeats` encodes and decodes at dimension `dim`; medians per step."""
    plan = plan_ddgauss(
        clip=1.0, dim=dim, sigma=1.0, n_noise=noise_sites, max_sites=sites, bits=bits
    )
    seed = bytes(range(32))
    update = np.random.default_rng(0).normal(size=dim).astype(np.float32)
    times: dict[str, list[float]] = {step: [] for step in STEPS}
    cpu: dict[str, list[float]] = {step: [] for step in STEPS}
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        work = np.zeros(plan.padded_dim, np.float64)

        def clip_scale(work: np.ndarray = work) -> None:
            work[:dim] = update
            clip_l2(work, clip=plan.clip)
            work *= 1.0 / plan.gamma

        _timed(times, cpu, "clip_scale", clip_scale)
        _timed(times, cpu, "rotate", partial(rotate, work, seed=seed))
        stream = NoiseStream(system_random)
        rounded = _timed(
            times,
            cpu,
            "round",
            partial(conditional_round, work, bound=plan.l2_sensitivity, stream=stream),
        )
        del work
        noise = _timed(
            times,
            cpu,
            "noise",
            partial(
                sample_discrete_gaussian, plan.padded_dim, sigma=plan.site_sigma, rng=system_random
            ),
        )

        def modular(rounded: np.ndarray = rounded, noise: np.ndarray = noise) -> np.ndarray:
            rounded += noise
            rounded &= np.int64((1 << plan.bits) - 1)
            return rounded.astype(plan.dtype)

        encoded = _timed(times, cpu, "modular", modular)
        del noise, rounded
        times["encode_total"].append(time.perf_counter() - start)
        cpu["encode_total"].append(time.process_time() - start_cpu)
        _timed(
            times,
            cpu,
            "decode",
            partial(ddgauss_decode, encoded, plan=plan, rotation_seed=seed),
        )
        del encoded
    return {
        "dim": dim,
        "padded_dim": plan.padded_dim,
        "bits": plan.bits,
        "ring_dtype": str(plan.dtype),
        "wire_bytes_per_site": plan.wire_bytes,
        "gamma": plan.gamma,
        "site_sigma_grid_units": plan.site_sigma,
        "rounding_inflation": plan.rounding_inflation,
        "log2_wrap_probability": plan.log2_wrap_probability,
        "rho": plan.rho(),
        "repeats": repeats,
        "seconds": {step: statistics.median(values) for step, values in times.items()},
        "cpu_seconds": {step: statistics.median(values) for step, values in cpu.items()},
    }


IN_ROUND_STEPS = ("site_encode", "coordinator_decode")


def run_in_round(*, dim: int, repeats: int, sites: int, noise_sites: int) -> dict[str, Any]:
    """A hospital round's per-site encode and the coordinator's decode against the plain
    32-bit round's quantize / dequantize at the same d and site count (medians)."""
    ring = hospital.ring_plan(hospital.HospitalTerms(clip=1.0, noise_multiplier=1.0),
                              dim=dim, max_sites=sites)
    plan = hospital.site_plan(ring, n_noise=noise_sites)
    seed = bytes(range(32))
    update = np.random.default_rng(0).normal(size=dim).astype(np.float32)
    bits = bits_for_sites(sites)
    generator = numpy_generator(system_random)
    times: dict[str, dict[str, list[float]]] = {
        mode: {step: [] for step in IN_ROUND_STEPS} for mode in ("hospital", "plain")}
    cpu: dict[str, dict[str, list[float]]] = {
        mode: {step: [] for step in IN_ROUND_STEPS} for mode in ("hospital", "plain")}
    words = np.empty(0, np.uint32)
    plain = np.empty(dim, np.uint32)
    for _ in range(repeats):
        words = _timed(times["hospital"], cpu["hospital"], "site_encode", partial(
            hospital.encode_update, update, plan=plan, seed=seed, rng=system_random))
        # One site's words stand in for the unmasked sum: decoding costs the same.
        _timed(times["hospital"], cpu["hospital"], "coordinator_decode",
               partial(hospital.decode_sum, words, plan=plan, seed=seed))
        _timed(times["plain"], cpu["plain"], "site_encode", partial(
            quantize, update, clip=1.0, bits=bits, rng=generator, out=plain))
        _timed(times["plain"], cpu["plain"], "coordinator_decode", partial(
            dequantize_sum, plain, clip=1.0, bits=bits, count=1))
    limbs, limb_bits = hospital.limb_layout(bits=plan.bits, max_sites=plan.max_sites)
    medians = {mode: {step: statistics.median(v) for step, v in steps.items()}
               for mode, steps in times.items()}
    cpu_medians = {mode: {step: statistics.median(v) for step, v in steps.items()}
                   for mode, steps in cpu.items()}
    hospital_bytes, plain_bytes = int(words.nbytes), int(plain.nbytes)
    return {
        "dim": dim,
        "padded_dim": plan.padded_dim,
        "ring_bits": plan.bits,
        "limbs": limbs,
        "limb_bits": limb_bits,
        "plain_bits": bits,
        "log2_wrap_probability": plan.log2_wrap_probability,
        "rounding_inflation": plan.rounding_inflation,
        "wire_bytes": {"hospital": hospital_bytes, "plain": plain_bytes},
        "bytes_ratio": hospital_bytes / plain_bytes,
        "seconds": medians,
        "cpu_seconds": cpu_medians,
        "cpu_ratio": {step: cpu_medians["hospital"][step] / cpu_medians["plain"][step]
                      for step in IN_ROUND_STEPS},
        "repeats": repeats,
    }


def _print_in_round(result: dict[str, Any]) -> None:
    wire = result["wire_bytes"]
    print(
        f"in-round d = {result['dim']:,}: DDGauss {result['ring_bits']}-bit ring, "
        f"{result['limbs']} limb(s), padded {result['padded_dim']:,}: "
        f"{wire['hospital'] / 2**20:.1f} MiB/site vs plain {result['plain_bits']}-bit "
        f"{wire['plain'] / 2**20:.1f} MiB/site (x{result['bytes_ratio']:.2f})"
    )
    for step in IN_ROUND_STEPS:
        h_wall, p_wall = result["seconds"]["hospital"][step], result["seconds"]["plain"][step]
        h_cpu, p_cpu = (result["cpu_seconds"]["hospital"][step],
                        result["cpu_seconds"]["plain"][step])
        print(
            f"  {step:<19} hospital {h_cpu:7.3f} s cpu ({h_wall:7.3f} wall)   plain "
            f"{p_cpu:7.3f} s cpu ({p_wall:7.3f} wall)   x{result['cpu_ratio'][step]:.1f} cpu"
        )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dims",
        type=int,
        nargs="+",
        default=[1_000_000, 11_000_000],
        help="update lengths d (each padded to a power of two)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed encodes per dimension")
    parser.add_argument("--sites", type=int, default=10, help="most sites in one sum")
    parser.add_argument(
        "--noise-sites",
        type=int,
        default=5,
        help="sites whose noise is counted (round floor minus colluders)",
    )
    parser.add_argument(
        "--bits",
        type=int,
        default=None,
        help="fix the ring width (e.g. 32); default: the narrowest safe ring",
    )
    parser.add_argument(
        "--in-round",
        action="store_true",
        help="also time the hospital round's site encode (limbs included) and the "
        "coordinator's decode against the plain 32-bit ring, with bytes and ratios",
    )
    parser.add_argument("--json", action="store_true", help="last line is a JSON object")


def main_from_args(args: argparse.Namespace) -> int:
    results = [
        run_dimension(
            dim=dim,
            repeats=args.repeats,
            sites=args.sites,
            noise_sites=args.noise_sites,
            bits=args.bits,
        )
        for dim in args.dims
    ]
    in_round = [
        run_in_round(dim=dim, repeats=args.repeats, sites=args.sites,
                     noise_sites=args.noise_sites)
        for dim in args.dims
    ] if args.in_round else []
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"DDGauss per site, clip 1, sigma 1 (sum), {args.noise_sites} noise sites, "
        f"ring sized for {args.sites} sites, median of {args.repeats}"
    )
    for result in results:
        print(
            f"d = {result['dim']:,} -> padded {result['padded_dim']:,}, "
            f"{result['bits']}-bit ring ({result['ring_dtype']}), "
            f"{result['wire_bytes_per_site'] / 2**20:.0f} MiB/site, "
            f"P(wrap) <= 2^{result['log2_wrap_probability']:.0f}, "
            f"rounding inflation {result['rounding_inflation']:.4f}"
        )
        for step in STEPS:
            print(
                f"  {step:<13} {result['seconds'][step]:8.3f} s wall "
                f"{result['cpu_seconds'][step]:8.3f} s cpu"
            )
    for row in in_round:
        _print_in_round(row)
    print(f"peak RSS {peak_mib:.0f} MiB")
    if args.json:
        report: dict[str, Any] = {"results": results, "peak_rss_mib": peak_mib}
        if in_round:
            report["in_round"] = in_round
        print(json.dumps(report))
    return 0


def register(bench_subparsers: Any) -> None:
    """Add ``ddgauss`` to ``medfed bench``."""
    parser = bench_subparsers.add_parser("ddgauss", help="distributed discrete Gaussian cost")
    _add_arguments(parser)
    parser.set_defaults(func=main_from_args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="medfed bench ddgauss", description=__doc__)
    _add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
