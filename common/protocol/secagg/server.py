"""The coordinator side of SecAgg+ as a pure state machine (no I/O, no clock).

Bonawitz et al. 2017 (CCS), sec. 4 (Fig. 4), with SecAgg+ neighbourhoods of Bell et al.
2020 (CCS), sec. 3. The caller attributes every message to the site id taken from the
verified mTLS certificate. A bad message from one site (ValidationError, CryptoError, or
ProtocolAbort(UNEXPECTED_MESSAGE) when it arrives in the wrong phase) is refused for
that site only and leaves the round state unchanged; only the `close_*` methods can
abort the round, and then nothing is revealed.

`SecAggServer` keeps the phase order, each site's progress and the quorum of every
phase; each phase's messages are a concern of their own module: the signed keys
(`server_keys`), the share relay (`server_shares`), the masked sum, O(d) in memory
whatever the number of sites (`server_sum`), the survivors' confirmations
(`server_consistency`) and the robust unmasking (`server_unmask`): a wrong share is
corrected when enough right ones remain and its holder reported in
`misbehaving_sites`; otherwise the round aborts (RECONSTRUCTION_FAILED) and no sum is
returned. Never a silently wrong sum.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, TypeVar

import numpy as np

from common.core.errors import AbortReason, ProtocolAbort
from common.crypto.prg import apply_masks
from common.protocol.secagg.identity import IdentityVerifier
from common.protocol.secagg.messages import (
    AdvertiseKeys,
    ConsistencySignature,
    ConsistencySignatures,
    MaskedInput,
    Roster,
    ShareKeysOut,
    SharesForRecipient,
    SurvivorList,
    UnmaskShares,
)
from common.protocol.secagg.params import SecAggParams
from common.protocol.secagg.phases import Phase, PhaseTracker
from common.protocol.secagg.roster import RoundRoster
from common.protocol.secagg.server_consistency import SurvivorConfirmations
from common.protocol.secagg.server_keys import KeyAdvertisements
from common.protocol.secagg.server_shares import ShareRelay
from common.protocol.secagg.server_sum import MaskedSum
from common.protocol.secagg.server_unmask import RevealedShares

_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")


class SiteProgress(enum.IntEnum):
    """The last step a site completed in this round (ordered)."""

    INVITED = 0
    ADVERTISED = 1
    SHARED = 2
    MASKED = 3
    CONFIRMED = 4
    UNMASKED = 5


@dataclass
class SiteStatus:
    """Per-site view: how far it got, and in which phase it was declared dropped."""

    progress: SiteProgress = SiteProgress.INVITED
    dropped_in: Phase | None = None


def _closes_phase(
    phase: Phase,
) -> Callable[
    [Callable[Concatenate[SecAggServer, _P], _R]], Callable[Concatenate[SecAggServer, _P], _R]
]:
    """A `close_*` method: refused (UNEXPECTED_MESSAGE, round unchanged) outside `phase`;
    inside it, any ProtocolAbort aborts the round and discards the masked sum."""

    def decorate(
        method: Callable[Concatenate[SecAggServer, _P], _R],
    ) -> Callable[Concatenate[SecAggServer, _P], _R]:
        def wrapper(self: SecAggServer, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            self._tracker.require(phase, method.__name__)
            try:
                return method(self, *args, **kwargs)
            except ProtocolAbort:
                self.abort()
                raise

        # Not functools.wraps: mypy cannot type it together with ParamSpec.
        wrapper.__name__ = method.__name__
        wrapper.__qualname__ = method.__qualname__
        wrapper.__doc__ = method.__doc__
        return wrapper

    return decorate


class SecAggServer:
    """The coordinator's side of one SecAgg+ round."""

    def __init__(self, params: SecAggParams, *, identity: IdentityVerifier) -> None:
        self.params = params
        self._identity = identity
        self._tracker = PhaseTracker()
        self.status: dict[str, SiteStatus] = {site: SiteStatus() for site in params.participants}
        self._advertisements = KeyAdvertisements(params, identity=identity)
        self._roster = RoundRoster()
        self._relay: ShareRelay | None = None
        self._sum: MaskedSum | None = None
        self._survivor_list: SurvivorList | None = None
        self._confirmations: SurvivorConfirmations | None = None
        self._revealed: RevealedShares | None = None

    # ----------------------------------------------------------------- properties
    @property
    def phase(self) -> Phase:
        return self._tracker.phase

    @property
    def session_id(self) -> bytes:
        return self._roster.session_id

    @property
    def roster(self) -> Roster:
        """The roster relayed to the sites (empty before AdvertiseKeys closes)."""
        return Roster(entries=tuple(self._roster.entries.values()))

    @property
    def graph(self) -> Mapping[str, tuple[str, ...]]:
        return self._roster.graph

    @property
    def misbehaving_sites(self) -> Mapping[str, tuple[str, ...]]:
        """Holder -> owners whose secrets it revealed wrong shares of at Unmask.

        Filled by `close_unmask` (also when it aborts) for the operator to act on; a
        wrong share was corrected, or the round aborted: it never reached the sum."""
        return self._revealed.misbehaving if self._revealed is not None else {}

    @property
    def survivors(self) -> tuple[str, ...]:
        """Sites whose masked input is in the sum (empty before MaskedInput closes)."""
        return self._survivor_list.survivors if self._survivor_list else ()

    # ------------------------------------------------------- phase 1: AdvertiseKeys
    def receive_advertisement(
        self, site_id: str, message: AdvertiseKeys, *, certificate_der: bytes
    ) -> None:
        """Accept one site's signed keys; `certificate_der` is its verified TLS cert."""
        self._tracker.require(Phase.ADVERTISE_KEYS, "advertisement")
        self._advertisements.accept(site_id, message, certificate_der=certificate_der)
        self.status[site_id].progress = SiteProgress.ADVERTISED

    @_closes_phase(Phase.ADVERTISE_KEYS)
    def close_advertise(self) -> Roster:
        """End phase 1: the roster of every valid advertisement, sorted by site id."""
        sites = self._advertisements.sites
        self._mark_dropped(set(self.params.participants) - sites, Phase.ADVERTISE_KEYS)
        self._require_quorum(len(sites), "sites advertised keys")
        self._roster = self._advertisements.settle()
        self._relay = ShareRelay(self._roster)
        self._tracker.advance(Phase.SHARE_KEYS)
        return self.roster

    # ----------------------------------------------------------- phase 2: ShareKeys
    def receive_shares(self, site_id: str, message: ShareKeysOut) -> None:
        """Accept one encrypted share pair for each of the site's neighbours."""
        self._tracker.require(Phase.SHARE_KEYS, "shares")
        self._phase_part(self._relay).accept(site_id, message)
        self.status[site_id].progress = SiteProgress.SHARED

    @_closes_phase(Phase.SHARE_KEYS)
    def close_shares(self) -> dict[str, SharesForRecipient]:
        """End phase 2: route every share to its recipient (among sites that shared)."""
        relay = self._phase_part(self._relay)
        senders = relay.senders
        self._mark_dropped(set(self._roster.entries) - senders, Phase.SHARE_KEYS)
        self._require_quorum(len(senders), "sites sent shares")
        self._sum = MaskedSum(senders=senders, vector_length=self.params.vector_length)
        self._tracker.advance(Phase.MASKED_INPUT)
        return relay.route()

    # --------------------------------------------------------- phase 3: MaskedInput
    def receive_masked_input(self, site_id: str, vector: np.ndarray | MaskedInput) -> None:
        """Add one masked vector into the single accumulator (mod 2^32)."""
        self._tracker.require(Phase.MASKED_INPUT, "masked input")
        array = vector.vector if isinstance(vector, MaskedInput) else vector
        self._phase_part(self._sum).add(site_id, array)
        self.status[site_id].progress = SiteProgress.MASKED

    def receive_masked_input_windows(
        self, site_id: str, windows: Iterable[np.ndarray]
    ) -> None:
        """As `receive_masked_input`, for a vector delivered in consecutive windows (the
        coordinator stages very large uploads on disk, not in memory).

        The windows must cover exactly `vector_length` elements. If they do not, or the
        iterator fails part-way, the accumulator already holds part of the vector and
        cannot be repaired: the round is poisoned and `close_masked_input` aborts it
        (nothing is ever unmasked from a corrupted sum).
        """
        self._tracker.require(Phase.MASKED_INPUT, "masked input")
        self._phase_part(self._sum).add_windows(site_id, windows)
        self.status[site_id].progress = SiteProgress.MASKED

    @_closes_phase(Phase.MASKED_INPUT)
    def close_masked_input(self) -> SurvivorList:
        """End phase 3: survivors (masked input in the sum) and dropped (shares only)."""
        masked_sum = self._phase_part(self._sum)
        masked_sum.vector()  # aborts if a windowed input was added only in part
        masked = masked_sum.contributors
        dropped = self._phase_part(self._relay).senders - masked
        self._mark_dropped(dropped, Phase.MASKED_INPUT)
        self._require_quorum(len(masked), "sites sent masked input")
        listing = self._survivor_list = SurvivorList(
            survivors=tuple(sorted(masked)), dropped=tuple(sorted(dropped))
        )
        self._confirmations = SurvivorConfirmations(
            self.params, roster=self._roster, listing=listing, identity=self._identity
        )
        self._tracker.advance(Phase.CONSISTENCY_CHECK)
        return listing

    # ---------------------------------------------------- phase 4: ConsistencyCheck
    def receive_consistency(self, site_id: str, message: ConsistencySignature) -> None:
        """Accept a survivor's signature over the survivor list (verified here)."""
        self._tracker.require(Phase.CONSISTENCY_CHECK, "consistency signature")
        self._phase_part(self._confirmations).accept(site_id, message)
        self.status[site_id].progress = SiteProgress.CONFIRMED

    @_closes_phase(Phase.CONSISTENCY_CHECK)
    def close_consistency(self) -> ConsistencySignatures:
        """End phase 4: relay every signature so sites can cross-check the list."""
        confirmations = self._phase_part(self._confirmations)
        signers = confirmations.signers
        self._mark_dropped(set(self.survivors) - signers, Phase.CONSISTENCY_CHECK)
        self._require_quorum(len(signers), "survivors signed the survivor list")
        # Sites apply the same neighbourhood quorum; failing early saves a phase.
        confirmations.require_neighbourhood_quorums()
        self._revealed = RevealedShares(
            roster=self._roster,
            listing=self._phase_part(self._survivor_list),
            threshold=self.params.threshold,
            commitment=self._phase_part(self._relay).commitment,
        )
        self._tracker.advance(Phase.UNMASK)
        return confirmations.relayed()

    # -------------------------------------------------------------- phase 5: Unmask
    def receive_unmask(self, site_id: str, message: UnmaskShares) -> None:
        """Accept one survivor's revealed shares, all checked before any is stored."""
        self._tracker.require(Phase.UNMASK, "unmask shares")
        signers = self._phase_part(self._confirmations).signers
        self._phase_part(self._revealed).accept(site_id, message, confirmed=signers)
        self.status[site_id].progress = SiteProgress.UNMASKED

    @_closes_phase(Phase.UNMASK)
    def close_unmask(self) -> np.ndarray:
        """Reconstruct the needed secrets, strip every mask, return the ring sum.

        If any needed secret has fewer than t shares, or no t-subset of its shares
        yields a secret that passes its check, the round aborts and nothing (not even a
        partial sum) is returned. Holders of wrong shares land in `misbehaving_sites`.
        """
        add, subtract = self._phase_part(self._revealed).unmask_seeds()
        accumulator = self._phase_part(self._sum).vector()
        apply_masks(accumulator, add=add, subtract=subtract)
        self._tracker.advance(Phase.COMPLETED)
        return accumulator

    def abort(self) -> None:
        """Abandon the round (e.g. coordinator shutdown); nothing more is revealed."""
        self._tracker.abort()
        if self._sum is not None:
            self._sum.discard()

    # ------------------------------------------------------------------- helpers
    def _mark_dropped(self, sites: set[str], phase: Phase) -> None:
        """Record dropouts for the per-site status. A site that misses the consistency
        check or unmasking stays in the sum: its masked input already arrived."""
        for site in sites:
            status = self.status[site]
            if status.dropped_in is None:
                status.dropped_in = phase

    def _require_quorum(self, count: int, what: str) -> None:
        if count < self.params.threshold:
            raise ProtocolAbort(
                AbortReason.TOO_FEW_PARTICIPANTS,
                f"only {count} {what}; threshold is {self.params.threshold}",
            )

    @staticmethod
    def _phase_part(part: _T | None) -> _T:
        """The state an earlier phase set up (always there once the tracker let the
        call through; UNEXPECTED_MESSAGE otherwise, defensively)."""
        if part is None:
            raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "an earlier phase is missing")
        return part
