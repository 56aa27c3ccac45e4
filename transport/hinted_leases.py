"""Same-host reads that copy before their lease is granted, from the regions the unit's key directory names.

A unit publishes where each stored key lies in a directory file
(:mod:`gputq.transport.directory`) that a reader on its host maps
read-only. With the reference's generations in hand, a read takes the
regions the directory names for its keys (a *hint*) and copies from them
while a helper thread sends the lease request and reads the reply: the
lease's round trip runs beside the copy, not before it. The copy stands
when the lease names exactly those regions (the keys were stored there all
along, and the lease pinned them); otherwise the block that copied raises
:class:`~gputq.errors.HintMissedError` once it ends, and the caller copies
again under a lease of its own. A hint never makes a read return another
key's bytes: the lease decides.

:class:`HintedLeases` is one channel's side of it, over the one lease
protocol (:class:`~gputq.transport.one_sided.LeaseProtocol`).
"""

from __future__ import annotations

import contextlib
import time
import weakref

from gputq.errors import HintMissedError, InvalidInputError
from gputq.transport.base import describe_keys
from gputq.transport.directory import DirectoryView
from gputq.transport.lease_helpers import LeaseHelpers
from gputq.transport.one_sided import LeaseProtocol
from gputq.transport.spans import SPAN_WIRE_BYTES, span_regions, spans_from_wire

__all__ = ["HintedLeases", "read_checks"]


def read_checks(generations, incarnation) -> dict:
    """The optional staleness checks of a read, as keyword arguments (absent when unset)."""
    checks = {}
    if generations is not None:
        checks["generations"] = [int(g or 0) for g in generations]
    if incarnation:
        checks["incarnation"] = str(incarnation)
    return checks


class HintedLeases:
    """The leases of one same-host channel's reads, each copied from the directory's regions when it can be.

    Parameters
    ----------
    leases:
        The channel's lease protocol.
    unit:
        The unit's name.
    arena_nbytes:
        The arena's size: a hint or a lease naming regions past it is refused.
    directory:
        The unit's key directory mapped here, or None (every read then
        waits for its lease before copying).
    threads:
        Helper threads exchanging leases while their copies run.

    Attributes
    ----------
    reads_ahead : int
        Reads whose copy, made from the directory while the lease was
        requested, the lease confirmed.
    hint_misses : int
        Reads whose directory regions the lease did not confirm (copied again).
    """

    def __init__(self, leases: LeaseProtocol, unit: str, arena_nbytes: int, directory: DirectoryView | None,
                 threads: int):
        self._leases, self.unit, self._arena_nbytes, self._directory = leases, unit, int(arena_nbytes), directory
        self._exchanges = LeaseHelpers(threads, f"gputq-shm-lease-{unit}")
        # Dropped unclosed (its channel's clients never closed), the helper threads still end.
        self._ended = weakref.finalize(self, self._exchanges.close)
        self.reads_ahead = self.hint_misses = 0

    def regions(self, keys: list, generations, capacity: float, spans: bytes | None = None):
        """The regions the directory names for every key (or span), when they fit the arena and ``capacity``."""
        if self._directory is None or generations is None:
            return None
        regions = self._directory.lookup(keys, generations, within=self._arena_nbytes)
        if regions is not None and spans is not None:
            try:
                regions = span_regions(regions, spans_from_wire(spans, len(keys)), keys, self.unit)
            except InvalidInputError:
                return None  # the lease answers with the unit's own error
        if regions is None or (capacity < float("inf") and int(regions[:, 1].sum()) > capacity):
            return None  # a torn or foreign entry, or too many bytes: wait for the lease
        return regions

    @contextlib.contextmanager
    def lease(self, keys: list, generations, incarnation, timeout: float | None, *, hinted=None, spans=None):
        """Lease ``keys`` for the block; yields their regions; confirms the lease after it.

        With ``hinted``, the directory's regions of the keys, the block runs
        on them while a helper thread requests the lease, and the lease must
        name the same regions: else :class:`HintMissedError` is raised after
        the block, also in place of an error the block raised (a hint may name
        any bytes of the arena, misaligned ones too); the block's error stands
        where the hint was right or no lease came.
        """
        args = {"keys": keys, **read_checks(generations, incarnation)}
        rows = None
        if spans is not None:
            args["spans"], rows = spans, len(spans) // SPAN_WIRE_BYTES
        if hinted is None:
            reply, started = self._leases.request(args, timeout, keys)
            with self._confirmed(reply, started, keys, rows) as regions:
                yield regions
            return
        ended = self._leases.ends.take()
        if ended:
            args["end"] = ended
        started, reply, done = time.monotonic(), None, False
        # The exchange runs on a helper thread: its Python work (send, receive, decode) then
        # runs while the block copies or restores with the GIL released, not after it.
        exchange = self._exchanges.submit(lambda: self._leases.ask(args, timeout, keys))
        named = hinted.astype("<i8", copy=False).tobytes()  # what the lease's regions must be
        try:
            failed = None
            try:
                yield hinted
            except BaseException as exc:
                with contextlib.suppress(Exception):  # the block's error is the one to see
                    reply = exchange.result()
                if reply is None or reply.get("regions") == named or not isinstance(exc, Exception):
                    raise
                failed = exc  # read on a wrong hint: read again after the lease
            reply = reply if failed else exchange.result()
            done = True  # from here the confirmation ends the lease, whatever happens
            if reply.get("regions") == named:  # checked when hinted
                self._leases.settle(reply, started, keys)
                self.reads_ahead += 1
                return
            with self._confirmed(reply, started, keys, rows):
                self.hint_misses += 1
                raise HintMissedError(f"unit {self.unit}: the key directory named other regions than the "
                                      f"lease of keys {describe_keys(keys)}; read them again after the lease") \
                    from failed
        except BaseException:
            if reply is None:
                self._leases.ends.restore(ended)  # the request may never have reached the unit
            elif not done:
                self._leases.end(int(reply["lease_id"]), quiet=True)
            raise

    @contextlib.contextmanager
    def _confirmed(self, reply: dict, started: float, keys: list, rows: int | None = None):
        """The checked regions of a lease ``reply`` (``rows`` spans, or one per key) for the block;
        the lease settled after it."""
        ok = False
        try:
            yield self._leases.regions(reply, keys, self._arena_nbytes, rows)
            ok = True
        finally:
            self._leases.settle(reply, started, keys, ok=ok)

    def close(self) -> None:
        """Let the helper threads end once the exchanges handed over are done. Idempotent."""
        self._ended()
