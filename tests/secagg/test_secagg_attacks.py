"""One test per attack by a deviating coordinator, each asserting the abort reason.

The coordinator's deviations are injected with the harness's `tamper` hook (what it
delivers to one site is rewritten) or by driving the phases by hand.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from secagg_harness import Federation, make_federation, random_inputs, run_round

from common.core.errors import AbortReason, CryptoError, ProtocolAbort
from common.crypto.keyagreement import generate_keypair
from common.crypto.random import DeterministicRandom
from common.crypto.signing import VerifyingKey
from common.protocol.secagg.client import SecAggClient
from common.protocol.secagg.client_reveal import RevealGuard
from common.protocol.secagg.graph import neighbourhoods
from common.protocol.secagg.messages import (
    ConsistencySignatures,
    EncryptedShare,
    Roster,
    RosterEntry,
    ShareKeysOut,
    ShareKind,
    SharesForRecipient,
    SurvivorList,
    advertise_message,
)
from common.protocol.secagg.params import DEFAULT_MAX_COLLUDING_SITES, DEFAULT_MIN_ROUND_SITES
from common.protocol.secagg.phases import Phase

VICTIM = "site-000"


def attack(
    tamper_type: type,
    rewrite: object,
    *,
    n: int = 6,
    threshold: int = 4,
    neighbours: int = 0,
    rejected: list[str] | None = None,
) -> tuple[ProtocolAbort, Federation]:
    """Run a round in which the coordinator rewrites messages of `tamper_type` to VICTIM.

    Clients apply the shipped site policy's floor (min_round_sites 3, T = 1)."""
    federation = make_federation(
        n,
        threshold=threshold,
        neighbours=neighbours,
        min_round_sites=DEFAULT_MIN_ROUND_SITES,
        max_colluding_sites=DEFAULT_MAX_COLLUDING_SITES,
    )

    def tamper(site: str, message: object) -> object:
        if site == VICTIM and isinstance(message, tamper_type):
            return rewrite(message)  # type: ignore[operator]
        return message

    with pytest.raises(ProtocolAbort) as caught:
        run_round(federation, random_inputs(federation.params, 1), tamper=tamper, rejected=rejected)
    # The victim is now terminally aborted: it will answer nothing else.
    assert federation.clients[VICTIM].phase is Phase.ABORTED
    return caught.value, federation


# ----------------------------------------------------------------- roster attacks
def test_abort_when_server_swaps_a_public_key() -> None:
    def swap(roster: Roster) -> Roster:
        fake = generate_keypair(DeterministicRandom(b"coordinator"))
        entries = list(roster.entries)
        entries[1] = dataclasses.replace(entries[1], masking_public_key=fake.public_key)
        return Roster(tuple(entries))

    error, _ = attack(Roster, swap)
    assert error.reason is AbortReason.BAD_SIGNATURE


def test_abort_when_server_swaps_this_sites_own_key() -> None:
    def swap(roster: Roster) -> Roster:
        fake = generate_keypair(DeterministicRandom(b"coordinator"))
        entries = list(roster.entries)
        entries[0] = dataclasses.replace(entries[0], encryption_public_key=fake.public_key)
        return Roster(tuple(entries))

    error, _ = attack(Roster, swap)
    assert error.reason is AbortReason.KEY_MISMATCH


def test_abort_when_server_presents_another_sites_certificate() -> None:
    def swap(roster: Roster) -> Roster:
        entries = list(roster.entries)
        entries[2] = dataclasses.replace(entries[2], certificate_der=entries[3].certificate_der)
        return Roster(tuple(entries))

    error, _ = attack(Roster, swap)
    assert error.reason is AbortReason.BAD_SIGNATURE


def test_abort_when_server_replays_roster_from_another_round() -> None:
    old = make_federation(6, threshold=4, round_number=6)
    run_round(old, random_inputs(old.params, 1))
    old_roster = _roster_of(old)

    def replay(roster: Roster) -> Roster:
        # Our own entry is current (else KEY_MISMATCH); the peers' keys and signatures
        # are last round's, whose secrets the coordinator might have learnt since.
        return Roster((roster.entries[0], *old_roster[1:]))

    error, _ = attack(Roster, replay)
    assert error.reason is AbortReason.BAD_SIGNATURE


def test_abort_when_roster_repeats_a_site() -> None:
    error, _ = attack(Roster, lambda r: Roster((*r.entries, r.entries[1])))
    assert error.reason is AbortReason.DUPLICATE_PEER


def test_abort_when_roster_names_an_unknown_site() -> None:
    def add_stranger(roster: Roster) -> Roster:
        stranger = dataclasses.replace(roster.entries[1], site_id="site-999")
        return Roster((*roster.entries, stranger))

    error, _ = attack(Roster, add_stranger)
    assert error.reason is AbortReason.UNKNOWN_PEER


def test_abort_when_roster_omits_this_site() -> None:
    error, _ = attack(Roster, lambda r: Roster(r.entries[1:]))
    assert error.reason is AbortReason.SELF_MISSING


def test_abort_when_roster_has_fewer_than_t_sites() -> None:
    error, _ = attack(Roster, lambda r: Roster(r.entries[:3]))
    assert error.reason is AbortReason.TOO_FEW_PARTICIPANTS


# ------------------------------------------------------------------ share attacks
def test_abort_when_server_tampers_with_a_share() -> None:
    def flip(inbox: SharesForRecipient) -> SharesForRecipient:
        first = inbox.shares[0]
        corrupted = bytearray(first.ciphertext)
        corrupted[20] ^= 0x01
        return SharesForRecipient((EncryptedShare(first.peer_site_id, bytes(corrupted)),))

    error, _ = attack(SharesForRecipient, flip)
    assert error.reason is AbortReason.DECRYPTION_FAILED


def test_abort_when_server_relabels_the_sender_of_a_share() -> None:
    def relabel(inbox: SharesForRecipient) -> SharesForRecipient:
        # Share from site-001 presented as coming from site-002 (AD binds the sender).
        a, b, *rest = inbox.shares
        return SharesForRecipient(
            (
                EncryptedShare(a.peer_site_id, b.ciphertext),
                EncryptedShare(b.peer_site_id, a.ciphertext),
                *rest,
            )
        )

    error, _ = attack(SharesForRecipient, relabel)
    assert error.reason is AbortReason.DECRYPTION_FAILED


def test_abort_when_server_replays_a_share_from_another_round() -> None:
    old = make_federation(6, threshold=4, round_number=6)
    captured: dict[str, SharesForRecipient] = {}

    def capture(site: str, message: object) -> object:
        if site == VICTIM and isinstance(message, SharesForRecipient):
            captured["inbox"] = message
        return message

    run_round(old, random_inputs(old.params, 1), tamper=capture)
    error, _ = attack(SharesForRecipient, lambda _: captured["inbox"])
    assert error.reason is AbortReason.DECRYPTION_FAILED


def test_abort_when_server_duplicates_a_share() -> None:
    error, _ = attack(
        SharesForRecipient, lambda inbox: SharesForRecipient((*inbox.shares, inbox.shares[0]))
    )
    assert error.reason is AbortReason.DUPLICATE_PEER


def test_abort_when_server_delivers_a_share_from_a_non_neighbour() -> None:
    federation = make_federation(8, threshold=3, neighbours=2)
    run_round(federation, random_inputs(federation.params, 1))
    neighbours = set(federation.clients[VICTIM].neighbours)
    stranger = next(s for s in federation.params.participants[1:] if s not in neighbours)

    def forge(inbox: SharesForRecipient) -> SharesForRecipient:
        return SharesForRecipient(
            (*inbox.shares, EncryptedShare(stranger, inbox.shares[0].ciphertext))
        )

    error, _ = attack(SharesForRecipient, forge, n=8, threshold=3, neighbours=2)
    assert error.reason is AbortReason.NOT_A_NEIGHBOUR


# -------------------------------------------------------------- survivor attacks
def test_abort_when_server_lists_peer_as_both_alive_and_dropped() -> None:
    error, _ = attack(
        SurvivorList, lambda s: SurvivorList(s.survivors, (*s.dropped, s.survivors[1]))
    )
    assert error.reason is AbortReason.PEER_BOTH_ALIVE_AND_DROPPED


def test_abort_when_server_repeats_a_peer() -> None:
    error, _ = attack(
        SurvivorList, lambda s: SurvivorList((*s.survivors, s.survivors[1]), s.dropped)
    )
    assert error.reason is AbortReason.DUPLICATE_PEER


def test_abort_when_server_names_an_unknown_peer() -> None:
    error, _ = attack(SurvivorList, lambda s: SurvivorList((*s.survivors, "site-999"), s.dropped))
    assert error.reason is AbortReason.UNKNOWN_PEER


def test_abort_when_server_lists_this_site_as_dropped() -> None:
    error, _ = attack(SurvivorList, lambda s: SurvivorList(s.survivors[1:], (*s.dropped, VICTIM)))
    assert error.reason is AbortReason.SELF_LISTED_AS_DROPPED


def test_abort_when_server_omits_this_site_from_survivors() -> None:
    error, _ = attack(SurvivorList, lambda s: SurvivorList(s.survivors[1:], s.dropped))
    assert error.reason is AbortReason.SELF_MISSING


def test_abort_when_server_lists_a_peer_that_sent_no_shares() -> None:
    # The coordinator withholds site-001's shares from the victim yet lists site-001
    # as a survivor: the victim never masked against it.
    def withhold(message: object) -> object:
        if isinstance(message, SharesForRecipient):
            return SharesForRecipient(
                tuple(s for s in message.shares if s.peer_site_id != "site-001")
            )
        return message

    federation = make_federation(6, threshold=4)

    def tamper(site: str, message: object) -> object:
        return withhold(message) if site == VICTIM else message

    with pytest.raises(ProtocolAbort) as caught:
        run_round(federation, random_inputs(federation.params, 1), tamper=tamper)
    assert caught.value.reason is AbortReason.SURVIVORS_NOT_SUBSET


def test_abort_when_server_hides_a_peer_that_sent_shares() -> None:
    error, _ = attack(
        SurvivorList,
        lambda s: SurvivorList(tuple(x for x in s.survivors if x != "site-001"), s.dropped),
    )
    assert error.reason is AbortReason.SURVIVORS_NOT_SUBSET


# ------------------------------------------------------------ consistency attacks
def test_abort_when_server_sends_different_survivor_sets() -> None:
    """Equivocation: the victim is told site-005 dropped, everybody else that it lived.

    If the victim revealed site-005's mask key while the others revealed its self-mask
    seed, the coordinator would unmask site-005's input. The victim's signature fails
    at the coordinator; the others' signatures do not verify on the victim's list.
    """
    rejected: list[str] = []

    def equivocate(s: SurvivorList) -> SurvivorList:
        return SurvivorList(tuple(x for x in s.survivors if x != "site-005"), ("site-005",))

    error, federation = attack(SurvivorList, equivocate, rejected=rejected)
    assert error.reason is AbortReason.INCONSISTENT_SURVIVOR_SETS
    assert rejected == [VICTIM]  # the honest coordinator refused the victim's signature
    assert federation.clients[VICTIM].revealed_kind("site-005") is None


def test_abort_when_two_groups_are_told_two_stories() -> None:
    """A malicious coordinator relays to each group only that group's signatures: the
    group that was told the minority story has fewer than t confirmations."""
    federation = make_federation(5, threshold=3)
    server, clients = federation.server, federation.clients
    assert server is not None
    for site, client in clients.items():
        server.receive_advertisement(
            site, client.advertise_keys(), certificate_der=federation.certificate(site)
        )
    roster = server.close_advertise()
    for site in clients:
        server.receive_shares(site, clients[site].receive_roster(roster))
    inboxes = server.close_shares()
    inputs = random_inputs(federation.params, 3)
    for site, inbox in inboxes.items():
        clients[site].receive_shares(inbox, inputs[site].copy())
    truth = SurvivorList(federation.params.participants, ())
    lie = SurvivorList(federation.params.participants[:4], ("site-004",))
    group_a = ["site-000", "site-001"]  # told site-004 dropped
    signatures = {
        site: clients[site].receive_survivors(lie if site in group_a else truth).signature
        for site in clients
    }
    to_a = ConsistencySignatures(tuple((s, signatures[s]) for s in group_a))
    with pytest.raises(ProtocolAbort) as caught:
        clients["site-000"].receive_consistency(to_a)
    assert caught.value.reason is AbortReason.INCONSISTENT_SURVIVOR_SETS
    everyone = ConsistencySignatures(tuple(sorted(signatures.items())))
    with pytest.raises(ProtocolAbort) as caught:
        clients["site-001"].receive_consistency(everyone)
    assert caught.value.reason is AbortReason.INCONSISTENT_SURVIVOR_SETS
    # Neither victim revealed anything about site-004.
    assert clients["site-000"].revealed_kind("site-004") is None
    assert clients["site-001"].revealed_kind("site-004") is None


def test_abort_when_server_forges_a_consistency_signature() -> None:
    def forge(sigs: ConsistencySignatures) -> ConsistencySignatures:
        (site, signature), *rest = sigs.signatures[1:]
        return ConsistencySignatures((sigs.signatures[0], (site, bytes(len(signature))), *rest))

    error, _ = attack(ConsistencySignatures, forge)
    assert error.reason is AbortReason.INCONSISTENT_SURVIVOR_SETS


def test_abort_when_server_relays_fewer_than_t_signatures() -> None:
    error, _ = attack(ConsistencySignatures, lambda s: ConsistencySignatures(s.signatures[:3]))
    assert error.reason is AbortReason.INCONSISTENT_SURVIVOR_SETS


def test_abort_when_server_relays_a_signature_from_a_dropped_site() -> None:
    def add_dropped(sigs: ConsistencySignatures) -> ConsistencySignatures:
        return ConsistencySignatures((*sigs.signatures, ("site-005", sigs.signatures[0][1])))

    federation = make_federation(6, threshold=4)

    def tamper(site: str, message: object) -> object:
        if site == VICTIM and isinstance(message, ConsistencySignatures):
            return add_dropped(message)
        return message

    with pytest.raises(ProtocolAbort) as caught:
        run_round(
            federation,
            random_inputs(federation.params, 1),
            dropouts={"site-005": Phase.MASKED_INPUT},
            tamper=tamper,
        )
    assert caught.value.reason is AbortReason.INCONSISTENT_SURVIVOR_SETS


def test_abort_when_server_asks_for_both_shares_of_a_peer() -> None:
    """After revealing site-001's self-mask share, a second request (a survivor list
    now calling site-001 dropped) is refused: the phase is over, nothing is revealed."""
    federation = make_federation(6, threshold=4)
    run_round(federation, random_inputs(federation.params, 1))
    victim = federation.clients[VICTIM]
    assert victim.revealed_kind("site-001") is ShareKind.SELF_MASK_SEED
    survivors = tuple(s for s in federation.params.participants if s != "site-001")
    with pytest.raises(ProtocolAbort) as caught:
        victim.receive_survivors(SurvivorList(survivors, ("site-001",)))
    assert caught.value.reason is AbortReason.UNEXPECTED_MESSAGE
    with pytest.raises(ProtocolAbort) as caught:
        victim.receive_consistency(ConsistencySignatures(()))
    assert caught.value.reason is AbortReason.UNEXPECTED_MESSAGE
    assert victim.revealed_kind("site-001") is ShareKind.SELF_MASK_SEED


def test_reveal_guard_refuses_the_second_kind_of_share_for_one_owner() -> None:
    guard = RevealGuard()
    guard.record("site-001", ShareKind.SELF_MASK_SEED)
    guard.record("site-001", ShareKind.SELF_MASK_SEED)  # idempotent for the same kind
    with pytest.raises(ProtocolAbort) as caught:
        guard.record("site-001", ShareKind.MASKING_KEY)
    assert caught.value.reason is AbortReason.PEER_BOTH_ALIVE_AND_DROPPED
    assert guard.revealed("site-001") is ShareKind.SELF_MASK_SEED


# ---------------------------------------------------------------- out of order
def test_abort_when_a_message_arrives_out_of_order() -> None:
    federation = make_federation(4, threshold=3)
    client = federation.clients[VICTIM]
    with pytest.raises(ProtocolAbort) as caught:
        client.receive_survivors(SurvivorList(federation.params.participants, ()))
    assert caught.value.reason is AbortReason.UNEXPECTED_MESSAGE
    assert client.phase is Phase.ABORTED
    # Once aborted, even the first step is refused.
    with pytest.raises(ProtocolAbort):
        client.advertise_keys()


def test_abort_when_keys_are_advertised_twice() -> None:
    client = make_federation(4, threshold=3).clients[VICTIM]
    client.advertise_keys()
    with pytest.raises(ProtocolAbort) as caught:
        client.advertise_keys()
    assert caught.value.reason is AbortReason.UNEXPECTED_MESSAGE


def test_masked_vector_hides_the_input() -> None:
    """Sanity: what the coordinator receives is far from the plaintext (masking ran)."""
    federation = make_federation(4, threshold=3, vector_length=4096)
    inputs = random_inputs(federation.params, 5)
    captured: dict[str, np.ndarray] = {}
    server = federation.server
    assert server is not None
    original = server.receive_masked_input

    def spy(site: str, vector: object) -> None:
        captured[site] = np.array(vector.vector)  # type: ignore[attr-defined]
        original(site, vector)  # type: ignore[arg-type]

    server.receive_masked_input = spy  # type: ignore[method-assign]
    run_round(federation, inputs)
    for site, masked in captured.items():
        assert np.mean(masked == inputs[site]) < 0.01


def _roster_of(federation: Federation) -> tuple:
    server = federation.server
    assert server is not None
    return server.roster.entries


def test_abort_when_server_gathers_confirmations_outside_the_peers_neighbourhood() -> None:
    """SecAgg+ specific: far-away sites (which hold no share of u) happily sign a list
    calling u dropped; their signatures must not count towards u's quorum."""
    federation = make_federation(12, threshold=3, neighbours=4)
    server, clients = federation.server, federation.clients
    assert server is not None
    for site, client in clients.items():
        server.receive_advertisement(
            site, client.advertise_keys(), certificate_der=federation.certificate(site)
        )
    roster = server.close_advertise()
    for site in clients:
        server.receive_shares(site, clients[site].receive_roster(roster))
    inboxes = server.close_shares()
    inputs = random_inputs(federation.params, 11)
    for site, inbox in inboxes.items():
        clients[site].receive_shares(inbox, inputs[site].copy())
    victim = clients[VICTIM]
    target = victim.neighbours[0]
    closed = {target, *server.graph[target]}
    far = [site for site in federation.params.participants if site not in closed]
    lie = SurvivorList(tuple(s for s in federation.params.participants if s != target), (target,))
    signatures = [(VICTIM, victim.receive_survivors(lie).signature)]
    signatures += [(site, clients[site].receive_survivors(lie).signature) for site in far]
    assert len(signatures) >= federation.params.threshold  # a global quorum alone is met
    with pytest.raises(ProtocolAbort) as caught:
        victim.receive_consistency(ConsistencySignatures(tuple(sorted(signatures))))
    assert caught.value.reason is AbortReason.INCONSISTENT_SURVIVOR_SETS
    assert victim.revealed_kind(target) is None


def test_abort_when_a_colluding_site_advertises_a_low_order_key() -> None:
    """A validly signed all-zero X25519 key would make the agreed secret predictable
    (RFC 7748 sec. 6.1); the victim refuses the round instead of using it."""
    federation = make_federation(6, threshold=4)

    def low_order(roster: Roster) -> Roster:
        entries = list(roster.entries)
        bad = entries[1]
        message = advertise_message(
            round_number=federation.params.round_number,
            round_nonce=federation.params.round_nonce,
            site_id=bad.site_id,
            encryption_public_key=bytes(32),
            masking_public_key=bad.masking_public_key,
            announcement_digest=federation.params.announcement_digest,
        )
        entries[1] = dataclasses.replace(
            bad,
            encryption_public_key=bytes(32),
            signature=federation.signing_keys[bad.site_id].sign(message),
        )
        return Roster(tuple(entries))

    def tamper(site: str, message: object) -> object:
        return low_order(message) if site == VICTIM and isinstance(message, Roster) else message

    with pytest.raises(ProtocolAbort) as caught:
        run_round(federation, random_inputs(federation.params, 1), tamper=tamper)
    assert caught.value.reason is AbortReason.DECRYPTION_FAILED
    assert federation.clients[VICTIM].phase is Phase.ABORTED


def test_abort_when_roster_keys_have_the_wrong_length() -> None:
    def shorten(roster: Roster) -> Roster:
        short = dataclasses.replace(roster.entries[1], masking_public_key=b"\x01" * 31)
        return Roster((roster.entries[0], short, *roster.entries[2:]))

    error, _ = attack(Roster, shorten)
    assert error.reason is AbortReason.WRONG_LENGTH


def test_handle_dispatches_by_message_type_and_refuses_site_messages() -> None:
    federation = make_federation(4, threshold=3)
    server = federation.server
    assert server is not None
    clients = federation.clients
    for site, client in clients.items():
        server.receive_advertisement(
            site, client.advertise_keys(), certificate_der=federation.certificate(site)
        )
    roster = server.close_advertise()
    out = clients[VICTIM].handle(roster)
    assert isinstance(out, ShareKeysOut)
    assert clients[VICTIM].phase is Phase.SHARE_KEYS
    with pytest.raises(ProtocolAbort) as caught:
        clients["site-001"].handle(out)  # a site never receives another site's upload
    assert caught.value.reason is AbortReason.UNEXPECTED_MESSAGE
    assert clients["site-001"].phase is Phase.ABORTED


# ------------------------------------------------------- round-size floor
def _policy_federation(n: int, **kwargs: object) -> Federation:
    """A federation whose clients apply the shipped site policy (floor 3, T = 1)."""
    options: dict[str, object] = {
        "min_round_sites": DEFAULT_MIN_ROUND_SITES,
        "max_colluding_sites": DEFAULT_MAX_COLLUDING_SITES,
        **kwargs,
    }
    return make_federation(n, **options)  # type: ignore[arg-type]


def _advertise_all(federation: Federation) -> Roster:
    """Phase 1 through the real server: every client advertises, the roster comes back."""
    server = federation.server
    assert server is not None
    for site, client in federation.clients.items():
        server.receive_advertisement(
            site, client.advertise_keys(), certificate_der=federation.certificate(site)
        )
    return server.close_advertise()


def _mask_all(federation: Federation, inputs: dict[str, np.ndarray]) -> SurvivorList:
    """Phases 2-3 through the real server; returns the survivor list it would send."""
    server, clients = federation.server, federation.clients
    assert server is not None
    roster = _advertise_all(federation)
    for site in clients:
        server.receive_shares(site, clients[site].receive_roster(roster))
    for site, inbox in server.close_shares().items():
        server.receive_masked_input(site, clients[site].receive_shares(inbox, inputs[site].copy()))
    return server.close_masked_input()


def test_abort_when_round_has_only_two_sites() -> None:
    """The sum of two reveals the other input to whoever holds one of them
    (a coordinator holding a site certificate). Refused before any key is made; and a
    round announced with three whose roster holds only two is refused before shares."""
    two = make_federation(2, threshold=2)  # the harness's floor is 2: build it anyway
    with pytest.raises(ProtocolAbort) as caught:
        SecAggClient(
            two.params,
            site_id=VICTIM,
            signing_key=two.signing_keys[VICTIM],
            identity=two.identity,
            rng=DeterministicRandom(b"victim"),
        )
    assert caught.value.reason is AbortReason.ROUND_TOO_SMALL

    # Announced with three; the third "drops" before AdvertiseKeys, so the coordinator
    # (as site-001) and the victim are all the roster has. t = 2 passes the threshold.
    federation = _policy_federation(3, threshold=2, max_colluding_sites=0)
    server, clients = federation.server, federation.clients
    assert server is not None
    for site in (VICTIM, "site-001"):
        server.receive_advertisement(
            site, clients[site].advertise_keys(), certificate_der=federation.certificate(site)
        )
    roster = server.close_advertise()
    assert len(roster.entries) == 2
    with pytest.raises(ProtocolAbort) as caught:
        clients[VICTIM].receive_roster(roster)
    assert caught.value.reason is AbortReason.ROUND_TOO_SMALL
    assert clients[VICTIM].aborted_in is Phase.ADVERTISE_KEYS  # no share was sent


def test_abort_when_survivor_set_shrinks_below_floor_after_masked_input() -> None:
    """After every masked input arrived, the coordinator declares two honest sites
    dropped, so that the sum it unmasks covers four sites (one its colluder) and it
    learns their mask keys. A consortium policy of min_round_sites = 5 refuses: no
    site signs the list, none reveals a share."""
    federation = _policy_federation(6, threshold=4, min_round_sites=5)
    inputs = random_inputs(federation.params, 9)
    truth = _mask_all(federation, inputs)
    shrunk = SurvivorList(truth.survivors[:4], truth.survivors[4:])
    for site in shrunk.survivors:
        client = federation.clients[site]
        with pytest.raises(ProtocolAbort) as caught:
            client.receive_survivors(shrunk)
        assert caught.value.reason is AbortReason.SURVIVORS_BELOW_FLOOR
        assert client.aborted_in is Phase.MASKED_INPUT  # its masked input was sent
        assert all(client.revealed_kind(owner) is None for owner in federation.params.participants)


def test_abort_when_survivors_beyond_the_floor_are_not_authenticated() -> None:
    """SecAgg+ neighbourhoods: the victim checks only its neighbourhood's signatures.
    Listed survivors it never authenticated (they could be entries the coordinator
    forged) do not count: relaying only the victim's own neighbourhood's signatures
    leaves 5 authenticated survivors, below a floor of 7, so it reveals nothing. With
    every signature relayed the victim verifies just enough more to reach the floor."""
    for relay_all in (False, True):
        federation = _policy_federation(12, threshold=3, neighbours=4, min_round_sites=7)
        survivors = _mask_all(federation, random_inputs(federation.params, 4))
        assert len(survivors.survivors) == 12
        clients = federation.clients
        signatures = {
            site: clients[site].receive_survivors(survivors).signature for site in clients
        }
        victim = clients[VICTIM]
        closed = {VICTIM, *victim.neighbours}
        relayed = ConsistencySignatures(
            tuple(sorted((s, sig) for s, sig in signatures.items() if relay_all or s in closed))
        )
        if not relay_all:
            with pytest.raises(ProtocolAbort) as caught:
                victim.receive_consistency(relayed)
            assert caught.value.reason is AbortReason.SURVIVORS_BELOW_FLOOR
            assert all(victim.revealed_kind(owner) is None for owner in closed)
            continue
        before = victim.signatures_verified
        victim.receive_consistency(relayed)
        # The two-hop neighbourhood (2k + 1 = 9 sites with the victim) already meets the
        # floor of 7: its 8 other signatures are all that was verified.
        assert victim.signatures_verified - before == 8
        assert victim.revealed_kind(VICTIM) is ShareKind.SELF_MASK_SEED


# -------------------------------------------------- one story for every site
def _divergent_roster(federation: Federation, told_b: set[str]) -> tuple[Roster, bytes]:
    """A deviating coordinator: the sites in `told_b` were given announcement B, the
    others A. It relays every advertisement unverified (an honest SecAggServer refuses
    the B-signed ones, see the test below)."""
    digest_b = hashlib.sha256(b"announcement B").digest()
    params_b = dataclasses.replace(federation.params, announcement_digest=digest_b)
    for site in told_b:
        federation.clients[site] = SecAggClient(
            params_b,
            site_id=site,
            signing_key=federation.signing_keys[site],
            identity=federation.identity,
            rng=DeterministicRandom(b"b" + site.encode()),
        )
    entries = []
    for site, client in federation.clients.items():
        advert = client.advertise_keys()
        entries.append(
            RosterEntry(
                site_id=site,
                encryption_public_key=advert.encryption_public_key,
                masking_public_key=advert.masking_public_key,
                signature=advert.signature,
                certificate_der=federation.certificate(site),
            )
        )
    return Roster(tuple(entries)), digest_b


def test_abort_when_sites_get_divergent_announcements() -> None:
    """Two sites are told a different model than the other three (e.g. so that their
    score histograms land in other bins). Every site refuses the roster: nobody sends a
    share, nobody masks an input."""
    digest_a = hashlib.sha256(b"announcement A").digest()
    federation = _policy_federation(5, threshold=3, announcement_digest=digest_a)
    roster, _ = _divergent_roster(federation, {"site-003", "site-004"})
    inputs = random_inputs(federation.params, 2)
    for site, client in federation.clients.items():
        with pytest.raises(ProtocolAbort) as caught:
            client.receive_roster(roster)
        assert caught.value.reason is AbortReason.BAD_SIGNATURE
        assert client.aborted_in is Phase.ADVERTISE_KEYS
        vector = inputs[site].copy()
        with pytest.raises(ProtocolAbort):
            client.receive_shares(SharesForRecipient(()), vector)
        assert np.array_equal(vector, inputs[site])  # nothing was masked, nothing sent


def test_honest_server_refuses_keys_signed_for_another_announcement() -> None:
    """The coordinator's own check: an advertisement signed for another announcement
    (a site holding a stale or different one) does not verify against its params."""
    federation = make_federation(4, threshold=3)
    server = federation.server
    assert server is not None
    other = dataclasses.replace(
        federation.params, announcement_digest=hashlib.sha256(b"announcement B").digest()
    )
    stale = SecAggClient(
        other,
        site_id="site-003",
        signing_key=federation.signing_keys["site-003"],
        identity=federation.identity,
        rng=DeterministicRandom(b"stale"),
    )
    with pytest.raises(CryptoError):
        server.receive_advertisement(
            "site-003", stale.advertise_keys(), certificate_der=federation.certificate("site-003")
        )


def test_divergent_announcement_in_neighbourhoods_aborts_every_neighbour_at_the_roster() -> None:
    """SecAgg+ neighbourhoods: the site told another story and each of its neighbours
    refuse the roster (nothing is shared between them); the remaining sites never meet
    its keys, and its session id, hence every mask and share key, differs from theirs."""
    federation = _policy_federation(12, threshold=3, neighbours=4)
    roster, _ = _divergent_roster(federation, {VICTIM})
    aborted = set()
    for site, client in federation.clients.items():
        try:
            client.receive_roster(roster)
        except ProtocolAbort as error:
            assert error.reason is AbortReason.BAD_SIGNATURE
            assert client.aborted_in is Phase.ADVERTISE_KEYS
            aborted.add(site)
    honest = federation.clients["site-006"]
    assert honest.phase is Phase.SHARE_KEYS
    graph = neighbourhoods(honest.session_id, federation.params.participants, 4)
    assert aborted == {VICTIM, *graph[VICTIM]}


# ------------------------------------------------ identity callback and verification cost
@pytest.mark.parametrize("reason", [AbortReason.REVOKED_PEER, AbortReason.UNKNOWN_MEMBER])
def test_identity_callback_abort_reason_reaches_the_caller_unchanged(
    reason: AbortReason,
) -> None:
    """The site agent's identity check raises ProtocolAbort for a revoked or unpinned
    peer; the client must not turn it into a bad signature."""
    federation = _policy_federation(5, threshold=3)
    calls: list[str] = []

    def identity(site: str, certificate_der: bytes) -> VerifyingKey:
        calls.append(site)
        if site == "site-002":
            raise ProtocolAbort(reason, "site-002")
        return federation.identity(site, certificate_der)

    federation.clients[VICTIM] = SecAggClient(
        federation.params,
        site_id=VICTIM,
        signing_key=federation.signing_keys[VICTIM],
        identity=identity,
        rng=DeterministicRandom(b"victim"),
    )
    roster = _advertise_all(federation)
    with pytest.raises(ProtocolAbort) as caught:
        federation.clients[VICTIM].receive_roster(roster)
    assert caught.value.reason is reason
    assert federation.clients[VICTIM].aborted_in is Phase.ADVERTISE_KEYS


def test_identity_abort_from_a_two_hop_signer_reaches_the_caller_unchanged() -> None:
    """A signer outside the victim's neighbourhood is first met at the consistency check."""
    federation = _policy_federation(12, threshold=3, neighbours=4)
    revoked: dict[str, str] = {}

    def identity(site: str, certificate_der: bytes) -> VerifyingKey:
        if site == revoked.get("site"):
            raise ProtocolAbort(AbortReason.REVOKED_PEER, site)
        return federation.identity(site, certificate_der)

    federation.clients[VICTIM] = SecAggClient(
        federation.params,
        site_id=VICTIM,
        signing_key=federation.signing_keys[VICTIM],
        identity=identity,
        rng=DeterministicRandom(b"victim"),
        min_round_sites=DEFAULT_MIN_ROUND_SITES,
    )
    survivors = _mask_all(federation, random_inputs(federation.params, 6))
    victim = federation.clients[VICTIM]
    graph = federation.server.graph  # type: ignore[union-attr]
    two_hop = {h for o in (VICTIM, *graph[VICTIM]) for h in (o, *graph[o])}
    revoked["site"] = sorted(two_hop - {VICTIM, *graph[VICTIM]})[0]
    signatures = tuple(
        (site, client.receive_survivors(survivors).signature)
        for site, client in sorted(federation.clients.items())
    )
    with pytest.raises(ProtocolAbort) as caught:
        victim.receive_consistency(ConsistencySignatures(signatures))
    assert caught.value.reason is AbortReason.REVOKED_PEER
    assert victim.revealed_kind(VICTIM) is None


@pytest.mark.parametrize("n", [24, 48])
def test_signature_checks_per_client_do_not_grow_with_n(n: int) -> None:
    """k roster signatures (the neighbours) and 2k survivor-list signatures (the rest
    of the two-hop neighbourhood of a Harary graph), each verified once, whatever n;
    identity is asked about each of those 2k sites once."""
    k = 4
    federation = _policy_federation(n, threshold=3, neighbours=k)
    calls: list[str] = []

    def identity(site: str, certificate_der: bytes) -> VerifyingKey:
        calls.append(site)
        return federation.identity(site, certificate_der)

    federation.clients[VICTIM] = SecAggClient(
        federation.params,
        site_id=VICTIM,
        signing_key=federation.signing_keys[VICTIM],
        identity=identity,
        rng=DeterministicRandom(b"victim"),
    )
    _total, survivors = run_round(federation, random_inputs(federation.params, 3))
    assert len(survivors) == n
    victim = federation.clients[VICTIM]
    assert victim.phase is Phase.UNMASK
    assert victim.signatures_verified == k + 2 * k
    assert len(calls) == len(set(calls)) == 2 * k
