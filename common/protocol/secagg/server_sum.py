"""MaskedInput at the coordinator: every masked vector added into one uint32 accumulator
as it arrives (mod 2^32), so memory is one vector whatever the number of sites.

Only the sum is ever kept: no site's masked vector is stored. A vector delivered in
windows (a large upload staged on disk) is added window by window; if its windows do not
cover it exactly, the accumulator already holds part of it and cannot be repaired, so the
sum is poisoned and refuses to be unmasked (never a silently wrong sum).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import numpy as np

from common.core.errors import AbortReason, ProtocolAbort, ValidationError
from common.protocol.secagg.phases import require_sender


class MaskedSum:
    """The running sum of the masked inputs of this round's senders of shares."""

    def __init__(self, *, senders: Collection[str], vector_length: int) -> None:
        self._senders = frozenset(senders)
        self._vector_length = vector_length
        self._accumulator: np.ndarray | None = np.zeros(vector_length, dtype=np.uint32)
        self._poisoned = False
        self.contributors: set[str] = set()
        """Sites whose masked input is in the sum."""

    @property
    def discarded(self) -> bool:
        """True once the sum was dropped (round aborted, or a partial input found)."""
        return self._accumulator is None

    def add(self, site_id: str, vector: np.ndarray) -> None:
        """Add one site's masked vector; ValidationError (the sum unchanged) for a second
        input, a stranger or a vector that is not uint32 of the round's length."""
        self._check_sender(site_id)
        if (
            not isinstance(vector, np.ndarray)
            or vector.dtype != np.uint32
            or vector.shape != (self._vector_length,)
        ):
            raise ValidationError(
                f"masked input must be a uint32 vector of length {self._vector_length}"
            )
        accumulator = self.vector()
        np.add(accumulator, vector, out=accumulator)  # wraps modulo 2^32
        self.contributors.add(site_id)

    def add_windows(self, site_id: str, windows: Iterable[np.ndarray]) -> None:
        """As `add`, for a vector delivered in consecutive windows. Windows that do not
        cover exactly the round's length, or an iterator that fails part-way, poison
        the sum once any part of them was added."""
        self._check_sender(site_id)
        accumulator = self.vector()
        position = 0
        try:
            for window in windows:
                end = position + window.size
                if window.dtype != np.uint32 or window.ndim != 1 or end > accumulator.size:
                    raise ValidationError("masked input window does not fit the vector")
                part = accumulator[position:end]
                np.add(part, window, out=part)  # wraps modulo 2^32
                position = end
            if position != accumulator.size:
                raise ValidationError("masked input windows do not cover the vector")
        except BaseException:
            if position:
                self._poisoned = True
            raise
        self.contributors.add(site_id)

    def vector(self) -> np.ndarray:
        """The accumulator itself (unmasking writes into it). ProtocolAbort once it was
        discarded, or (discarding it) once a partial input poisoned it."""
        if self._accumulator is None:
            raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "no accumulator")
        if self._poisoned:
            self._accumulator = None
            raise ProtocolAbort(
                AbortReason.RECONSTRUCTION_FAILED, "a masked input was added only in part"
            )
        return self._accumulator

    def discard(self) -> None:
        """Drop the sum (the round aborted): nothing of it can be revealed any more."""
        self._accumulator = None

    def _check_sender(self, site_id: str) -> None:
        require_sender(site_id, self._senders, "a site that sent shares")
        if site_id in self.contributors:
            raise ValidationError(f"{site_id!r} already sent its masked input")
