"""Runs n SecAgg+ clients and one server in-process with real crypto.

Dropouts are given as {site: phase}: the site sends nothing from that phase on
(ADVERTISE_KEYS = never advertises, ..., UNMASK = signs the survivor list but never
sends its unmask shares).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from common.core.errors import CertificateRejected, CryptoError, ValidationError
from common.crypto.random import DeterministicRandom
from common.crypto.signing import SigningKey, VerifyingKey
from common.protocol.secagg.client import SecAggClient
from common.protocol.secagg.identity import IdentityVerifier
from common.protocol.secagg.params import NO_ANNOUNCEMENT_DIGEST, SecAggParams
from common.protocol.secagg.phases import Phase
from common.protocol.secagg.server import SecAggServer

ALGORITHMS = ("ed25519", "ecdsa-p256-sha256")


@functools.cache
def signing_key(site: str, algorithm: str) -> SigningKey:
    """Long-term site keys (cached: generating ECDSA keys per example is wasteful)."""
    return SigningKey.generate(algorithm)


def site_ids(n: int) -> tuple[str, ...]:
    return tuple(f"site-{i:03d}" for i in range(n))


def make_identity(keys: Mapping[str, VerifyingKey]) -> IdentityVerifier:
    """Stand-in for the PKI check: the 'certificate' is the site's SPKI DER, and it
    must be the one registered for that site id (a real key comparison, no mock)."""

    def identity(site: str, certificate_der: bytes) -> VerifyingKey:
        expected = keys.get(site)
        if expected is None or expected.spki_der() != certificate_der:
            raise CertificateRejected(f"certificate does not belong to {site}")
        return expected

    return identity


@dataclass
class Federation:
    params: SecAggParams
    signing_keys: dict[str, SigningKey]
    identity: IdentityVerifier
    clients: dict[str, SecAggClient] = field(default_factory=dict)
    server: SecAggServer | None = None

    def certificate(self, site: str) -> bytes:
        return self.signing_keys[site].verifying_key.spki_der()


def make_federation(
    n: int,
    *,
    threshold: int,
    neighbours: int = 0,
    vector_length: int = 16,
    round_number: int = 7,
    seed: bytes = b"seed",
    algorithm: str | None = None,
    min_round_sites: int = 2,
    max_colluding_sites: int = 0,
    announcement_digest: bytes = NO_ANNOUNCEMENT_DIGEST,
) -> Federation:
    """n clients and a server with real keys.

    The survivor floor defaults to its minimum (2) so that dropout properties can be
    checked down to two survivors; the attack tests use the shipped site policy."""
    sites = site_ids(n)
    params = SecAggParams(
        round_number=round_number,
        round_nonce=DeterministicRandom(b"nonce" + seed + bytes([round_number % 256]))(16),
        participants=sites,
        threshold=threshold,
        neighbours=neighbours,
        vector_length=vector_length,
        announcement_digest=announcement_digest,
    )
    keys = {
        site: signing_key(site, algorithm or ALGORITHMS[index % 2])
        for index, site in enumerate(sites)
    }
    identity = make_identity({site: key.verifying_key for site, key in keys.items()})
    federation = Federation(params=params, signing_keys=keys, identity=identity)
    federation.clients = {
        site: SecAggClient(
            params,
            site_id=site,
            signing_key=keys[site],
            identity=identity,
            rng=DeterministicRandom(seed + site.encode()),
            min_round_sites=min_round_sites,
            max_colluding_sites=max_colluding_sites,
        )
        for site in sites
    }
    federation.server = SecAggServer(params, identity=identity)
    return federation


def random_inputs(params: SecAggParams, seed: int) -> dict[str, np.ndarray]:
    generator = np.random.default_rng(seed)
    return {
        site: generator.integers(0, 2**32, size=params.vector_length, dtype=np.uint32)
        for site in params.participants
    }


Tamper = Callable[[str, object], object]
"""(recipient site, coordinator message) -> message actually delivered."""


def run_round(
    federation: Federation,
    inputs: Mapping[str, np.ndarray],
    *,
    dropouts: Mapping[str, Phase] | None = None,
    tamper: Tamper | None = None,
    rejected: list[str] | None = None,
    outgoing: Tamper | None = None,
    prepared: Collection[str] = (),
    masked_inputs: dict[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, tuple[str, ...]]:
    """One honest-coordinator round; returns (unmasked sum, survivors).

    `tamper` lets attack tests rewrite what the coordinator delivers to a site.
    ProtocolAbort from a client or from closing a server phase propagates. When
    `rejected` is a list, a site message the server refuses (ValidationError or
    CryptoError, as the networked layer would) is recorded there and the round goes on.
    `outgoing` (sending site, its ShareKeysOut or UnmaskShares) -> what the server gets:
    a misbehaving site. Sites in `prepared` expand their masks (`prepare_masks`) right
    after sending their shares; `masked_inputs`, when a dict, receives a copy of every
    masked vector sent.
    """
    dropouts = dict(dropouts or {})
    server = federation.server
    assert server is not None
    clients = federation.clients

    def deliver(site: str, message: object) -> object:
        return tamper(site, message) if tamper else message

    def send(site: str, message: object) -> object:
        return outgoing(site, message) if outgoing else message

    def to_server(receive: Callable[..., None], site: str, *args: object, **kw: object) -> None:
        if rejected is None:
            receive(site, *args, **kw)
            return
        try:
            receive(site, *args, **kw)
        except (ValidationError, CryptoError):
            rejected.append(site)

    def active(site: str, phase: Phase) -> bool:
        drop = dropouts.get(site)
        return drop is None or _order(phase) < _order(drop)

    for site, client in clients.items():
        if active(site, Phase.ADVERTISE_KEYS):
            to_server(
                server.receive_advertisement,
                site,
                client.advertise_keys(),
                certificate_der=federation.certificate(site),
            )
        else:
            client.advertise_keys()  # keys made, but the message is lost
    roster = server.close_advertise()
    for site in [s for s in roster_sites(roster) if active(s, Phase.SHARE_KEYS)]:
        out = clients[site].receive_roster(deliver(site, roster))
        to_server(server.receive_shares, site, send(site, out))
        if site in prepared:
            clients[site].prepare_masks()
    inboxes = server.close_shares()
    for site, inbox in inboxes.items():
        if active(site, Phase.MASKED_INPUT):
            vector = inputs[site].copy()
            masked = clients[site].receive_shares(deliver(site, inbox), vector)
            if masked_inputs is not None:
                masked_inputs[site] = masked.vector.copy()
            to_server(server.receive_masked_input, site, masked)
    survivor_list = server.close_masked_input()
    signed = []
    for site in survivor_list.survivors:
        if active(site, Phase.CONSISTENCY_CHECK):
            signature = clients[site].receive_survivors(deliver(site, survivor_list))
            signed.append(site)
            to_server(server.receive_consistency, site, signature)
    signatures = server.close_consistency()
    for site in signed:
        if active(site, Phase.UNMASK):
            shares = clients[site].receive_consistency(deliver(site, signatures))
            to_server(server.receive_unmask, site, send(site, shares))
    total = server.close_unmask()
    return total, survivor_list.survivors


def roster_sites(roster: object) -> list[str]:
    return [entry.site_id for entry in roster.entries]  # type: ignore[attr-defined]


_PHASE_ORDER = [
    Phase.ADVERTISE_KEYS,
    Phase.SHARE_KEYS,
    Phase.MASKED_INPUT,
    Phase.CONSISTENCY_CHECK,
    Phase.UNMASK,
]


def _order(phase: Phase) -> int:
    return _PHASE_ORDER.index(phase)


def plaintext_sum(inputs: Mapping[str, np.ndarray], sites: tuple[str, ...]) -> np.ndarray:
    total = np.zeros_like(next(iter(inputs.values())))
    for site in sites:
        np.add(total, inputs[site], out=total)
    return total
