"""`medfed bench secagg`: one whole SecAgg+ round in-process, timed per phase.

Every phase runs with real crypto (X25519, HKDF, ChaCha20-Poly1305, Shamir, Ed25519 or
ECDSA signatures, the ChaCha20 mask PRG) and no network. Sites are processed one at a
time and each input vector is generated, added to the plaintext reference sum, masked
in place and handed to the server before the next site's is made, so peak memory is
O(d): the server keeps one accumulator, never n vectors.

Dropouts: by default the K dropping sites vanish *after sending their masked input*
(they neither sign the survivor list nor send unmask shares; their input is in the
sum and the server reconstructs their self-mask seeds from the others' shares).
``--drop-after shares`` instead drops them after ShareKeys, before MaskedInput, which
is the costlier case for the server (it rebuilds their mask keys and re-derives every
pairwise mask they had with surviving neighbours).

The result is checked against the plaintext ring sum of the survivors' inputs computed
in the same run (``exact``).

``--scaling 50,100,200`` runs the round at each n (``--repeat`` times, medians) and
prints per-client time and signature checks against n, with the ratio to the first n:
a client's work must grow with its neighbourhood (log n), not with n.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any, Literal, TypeVar

import numpy as np

from common.core.errors import CertificateRejected, ConfigError
from common.crypto.random import DeterministicRandom
from common.crypto.signing import SigningKey, VerifyingKey
from common.protocol.secagg.client import SecAggClient
from common.protocol.secagg.params import SecAggParams, ThreatModel, choose_parameters
from common.protocol.secagg.server import SecAggServer

CLIENT_PHASES = ("advertise_keys", "share_keys", "masked_input", "consistency_check", "unmask")
SERVER_PHASES = (*CLIENT_PHASES,)
DROP_AFTER = ("masked_input", "shares")

_T = TypeVar("_T")


class _Stopwatch:
    """Accumulates wall time per (party, phase), plus CPU time per party.

    CPU time is reported too because the 2-core test machine is shared: when other
    jobs run, wall time inflates while CPU time stays close to the unloaded figure.
    """

    def __init__(self) -> None:
        self.client: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.server: dict[str, float] = defaultdict(float)
        self.client_cpu: dict[str, float] = defaultdict(float)
        self.server_cpu = 0.0

    def on_client(self, site: str, phase: str, call: Callable[[], _T]) -> _T:
        start, start_cpu = time.perf_counter(), time.process_time()
        result = call()
        self.client[site][phase] += time.perf_counter() - start
        self.client_cpu[site] += time.process_time() - start_cpu
        return result

    def on_server(self, phase: str, call: Callable[[], _T]) -> _T:
        start, start_cpu = time.perf_counter(), time.process_time()
        result = call()
        self.server[phase] += time.perf_counter() - start
        self.server_cpu += time.process_time() - start_cpu
        return result


def _identity_for(keys: dict[str, VerifyingKey]) -> Callable[[str, bytes], VerifyingKey]:
    """Bench stand-in for the PKI: the 'certificate' is the registered SPKI DER."""
    spki = {site: key.spki_der() for site, key in keys.items()}

    def identity(site: str, certificate_der: bytes) -> VerifyingKey:
        if spki.get(site) != certificate_der:
            raise CertificateRejected(f"certificate does not belong to {site}")
        return keys[site]

    return identity


def run(
    *,
    sites: int,
    dim: int,
    dropouts: int,
    neighbours: Literal["auto"] | int = "auto",
    colluding: int = 0,
    drop_after: str = "masked_input",
    signature: str = "ed25519",
    seed: int = 0,
) -> dict[str, Any]:
    """Run one round and return the measurements (see module docstring)."""
    if drop_after not in DROP_AFTER:
        raise ConfigError("drop_after", f"must be one of {DROP_AFTER}")
    if not 0 <= dropouts < sites:
        raise ConfigError("dropouts", "must be in [0, sites)")
    rss_before = _peak_rss_mib()
    threat = ThreatModel(max_colluding_sites=colluding, max_dropouts=dropouts)
    threshold, k = choose_parameters(sites, threat, neighbours)
    site_ids = tuple(f"site-{i:04d}" for i in range(sites))
    params = SecAggParams(
        round_number=1,
        round_nonce=DeterministicRandom(b"bench-nonce" + seed.to_bytes(8, "big"))(16),
        participants=site_ids,
        threshold=threshold,
        neighbours=k,
        vector_length=dim,
    )
    signing = {site: SigningKey.generate(signature) for site in site_ids}
    identity = _identity_for({site: key.verifying_key for site, key in signing.items()})
    certificates = {site: key.verifying_key.spki_der() for site, key in signing.items()}
    clients = {
        site: SecAggClient(
            params,
            site_id=site,
            signing_key=signing[site],
            identity=identity,
            rng=DeterministicRandom(f"bench-{seed}-{site}".encode()),
        )
        for site in site_ids
    }
    server = SecAggServer(params, identity=identity)
    dropping = set(site_ids[-dropouts:]) if dropouts else set()
    watch = _Stopwatch()

    for site in site_ids:
        advert = watch.on_client(site, "advertise_keys", clients[site].advertise_keys)
        watch.on_server(
            "advertise_keys",
            partial(server.receive_advertisement, site, advert, certificate_der=certificates[site]),
        )
    roster = watch.on_server("advertise_keys", server.close_advertise)

    for site in site_ids:
        out = watch.on_client(site, "share_keys", partial(clients[site].receive_roster, roster))
        watch.on_server("share_keys", partial(server.receive_shares, site, out))
    inboxes = watch.on_server("share_keys", server.close_shares)

    plaintext = np.zeros(dim, dtype=np.uint32)
    for index, site in enumerate(site_ids):
        if drop_after == "shares" and site in dropping:
            continue
        generator = np.random.default_rng([seed, index])
        vector = generator.integers(0, 2**32, size=dim, dtype=np.uint32)
        np.add(plaintext, vector, out=plaintext)
        masked = watch.on_client(
            site, "masked_input", partial(clients[site].receive_shares, inboxes[site], vector)
        )
        watch.on_server("masked_input", partial(server.receive_masked_input, site, masked))
        del vector, masked  # one input alive at a time
    survivor_list = watch.on_server("masked_input", server.close_masked_input)

    active = [site for site in survivor_list.survivors if site not in dropping]
    for site in active:
        signed = watch.on_client(
            site, "consistency_check", partial(clients[site].receive_survivors, survivor_list)
        )
        watch.on_server("consistency_check", partial(server.receive_consistency, site, signed))
    signatures = watch.on_server("consistency_check", server.close_consistency)

    for site in active:
        reveal = watch.on_client(
            site, "unmask", partial(clients[site].receive_consistency, signatures)
        )
        watch.on_server("unmask", partial(server.receive_unmask, site, reveal))
    total = watch.on_server("unmask", server.close_unmask)

    exact = bool(np.array_equal(total, plaintext))
    checks = [client.signatures_verified for client in clients.values()]
    per_site = [sum(phases.values()) for phases in watch.client.values()]
    client_phases = {}
    for phase in CLIENT_PHASES:
        values = [phases[phase] for phases in watch.client.values() if phase in phases]
        client_phases[phase] = {
            "mean": statistics.fmean(values) if values else 0.0,
            "max": max(values) if values else 0.0,
        }
    return {
        "exact": exact,
        "sites": sites,
        "dim": dim,
        "dropouts": dropouts,
        "drop_after": drop_after,
        "threshold": threshold,
        "neighbours": k,
        "neighbourhood_size": params.neighbourhood_size,
        "survivors": len(survivor_list.survivors),
        "signature": signature,
        "client_seconds": {"mean": statistics.fmean(per_site), "max": max(per_site)},
        "server_seconds": sum(watch.server.values()),
        "client_cpu_seconds": {
            "mean": statistics.fmean(watch.client_cpu.values()),
            "max": max(watch.client_cpu.values()),
        },
        "server_cpu_seconds": watch.server_cpu,
        "client_signature_checks": {"mean": statistics.fmean(checks), "max": max(checks)},
        "phases": {
            "client": client_phases,
            "server": {phase: watch.server.get(phase, 0.0) for phase in SERVER_PHASES},
        },
        # Whole process (all n simulated clients included): stays O(d) because only
        # one input vector exists at a time and the server keeps one accumulator.
        "peak_rss_mib": _peak_rss_mib(),
        # Growth of the peak during the round, i.e. without the interpreter and imports
        # (torch, when run through `medfed`): compare with dim * 4 bytes per vector.
        "round_rss_growth_mib": _peak_rss_mib() - rss_before,
    }


def scaling(
    site_counts: list[int],
    *,
    dim: int,
    dropouts: int,
    repeat: int,
    signature: str = "ed25519",
) -> list[dict[str, Any]]:
    """Per-client cost against n: medians over `repeat` rounds at each n."""
    rows = []
    for n in site_counts:
        results = [
            run(sites=n, dim=dim, dropouts=dropouts, signature=signature, seed=seed)
            for seed in range(repeat)
        ]
        rows.append(
            {
                "sites": n,
                "dim": dim,
                "neighbours": results[0]["neighbours"],
                "threshold": results[0]["threshold"],
                "exact": all(result["exact"] for result in results),
                "client_ms": 1e3 * statistics.median(r["client_seconds"]["mean"] for r in results),
                "client_cpu_ms": 1e3
                * statistics.median(r["client_cpu_seconds"]["mean"] for r in results),
                "signature_checks": statistics.median(
                    r["client_signature_checks"]["mean"] for r in results
                ),
            }
        )
    return rows


def _print_scaling(rows: list[dict[str, Any]], *, repeat: int, dropouts: int) -> None:
    first = rows[0]
    print(
        f"SecAgg+ per-client cost against n: d={first['dim']:,}, {dropouts} dropouts, "
        f"medians of {repeat} rounds"
    )
    print(
        f"  {'n':>5} {'k':>4} {'t':>4} {'client ms':>10} {'cpu ms':>8} "
        f"{'cpu / first':>11} {'sig checks':>10}"
    )
    for row in rows:
        print(
            f"  {row['sites']:>5} {row['neighbours'] or 'all':>4} {row['threshold']:>4} "
            f"{row['client_ms']:10.1f} {row['client_cpu_ms']:8.1f} "
            f"{row['client_cpu_ms'] / first['client_cpu_ms']:11.2f} "
            f"{row['signature_checks']:10.1f}"
        )
    print(f"  exact: {all(row['exact'] for row in rows)}")


def _site_counts(value: str) -> list[int]:
    try:
        counts = [int(part) for part in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated site counts") from None
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError("every site count must be >= 2")
    return counts


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _print_table(result: dict[str, Any]) -> None:
    print(
        f"SecAgg+ round: {result['sites']} sites, d={result['dim']:,}, "
        f"{result['dropouts']} dropouts (after {result['drop_after']}), "
        f"t={result['threshold']}, k={result['neighbours'] or 'complete'}, "
        f"signatures {result['signature']}"
    )
    print(f"  {'phase':<18} {'client mean ms':>15} {'client max ms':>14} {'server ms':>10}")
    for phase in CLIENT_PHASES:
        client = result["phases"]["client"][phase]
        server = result["phases"]["server"][phase]
        print(
            f"  {phase:<18} {client['mean'] * 1e3:15.2f} {client['max'] * 1e3:14.2f} "
            f"{server * 1e3:10.2f}"
        )
    print(
        f"  {'total':<18} {result['client_seconds']['mean'] * 1e3:15.2f} "
        f"{result['client_seconds']['max'] * 1e3:14.2f} {result['server_seconds'] * 1e3:10.2f}"
    )
    print(
        f"  {'cpu total':<18} {result['client_cpu_seconds']['mean'] * 1e3:15.2f} "
        f"{result['client_cpu_seconds']['max'] * 1e3:14.2f} "
        f"{result['server_cpu_seconds'] * 1e3:10.2f}"
    )
    print(
        f"  exact: {result['exact']}   survivors: {result['survivors']}   "
        f"peak RSS: {result['peak_rss_mib']:.0f} MiB "
        f"(+{result['round_rss_growth_mib']:.0f} MiB during the round; one vector is "
        f"{result['dim'] * 4 / 2**20:.1f} MiB)"
    )


def _neighbours_arg(value: str) -> Literal["auto"] | int:
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("expected 'auto' or an integer") from None


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sites", type=int, default=10, help="number of sites n")
    parser.add_argument("--dim", type=int, default=1_000_000, help="vector length d")
    parser.add_argument("--dropouts", type=int, default=2, help="sites that drop out (K)")
    parser.add_argument(
        "--neighbors",
        "--neighbours",
        dest="neighbours",
        type=_neighbours_arg,
        default="auto",
        help="SecAgg+ degree k: 'auto' (complete graph up to 20 sites) or an even integer "
        "(0 = complete graph)",
    )
    parser.add_argument(
        "--colluding", type=int, default=0, help="threat model: colluding sites T (sets t)"
    )
    parser.add_argument(
        "--drop-after",
        choices=DROP_AFTER,
        default="masked_input",
        help="when the K sites drop: after sending their masked input (default) or after ShareKeys",
    )
    parser.add_argument("--signature", choices=("ed25519", "ecdsa-p256-sha256"), default="ed25519")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument(
        "--scaling",
        type=_site_counts,
        default=None,
        metavar="N1,N2,...",
        help="per-client cost against n: one round per n and repeat (overrides --sites)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="rounds per n in --scaling (medians)")


def main_from_args(args: argparse.Namespace) -> int:
    if args.scaling:
        if args.repeat < 1:
            raise ConfigError("repeat", "must be >= 1")
        rows = scaling(
            args.scaling,
            dim=args.dim,
            dropouts=args.dropouts,
            repeat=args.repeat,
            signature=args.signature,
        )
        _print_scaling(rows, repeat=args.repeat, dropouts=args.dropouts)
        if args.json:
            print(json.dumps(rows, sort_keys=True))
        return 0 if all(row["exact"] for row in rows) else 1
    result = run(
        sites=args.sites,
        dim=args.dim,
        dropouts=args.dropouts,
        neighbours=args.neighbours,
        colluding=args.colluding,
        drop_after=args.drop_after,
        signature=args.signature,
        seed=args.seed,
    )
    _print_table(result)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0 if result["exact"] else 1


def register(bench_subparsers: Any) -> None:
    """Add ``secagg`` to ``medfed bench``."""
    parser = bench_subparsers.add_parser(
        "secagg", help="one in-process SecAgg+ round, timed per phase"
    )
    _add_arguments(parser)
    parser.set_defaults(func=main_from_args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="medfed bench secagg", description=__doc__)
    _add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
