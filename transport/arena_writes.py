"""Same-host writes straight into a unit's arena file: reserve, copy, commit.

A writer on the unit's host need not send a step's bytes through a socket
(a copy into the kernel, one out of it, and the unit's thread receiving
them). It maps the unit's arena file writable, reserves a region for every
write of a batch in one control call
(:data:`~gputq.transport.write_batches.RESERVE_WRITES`), copies each
payload to its region, and commits the batch in one more. The unit's
bookkeeping is the tcp write's: a key is readable only once committed,
under the writer's generation, and a write the unit refused (a full arena,
a key written already) is that item's error.

The unit cannot stop a copy into its arena, and once a reservation expires
its region may hold another key. So every copy starts inside
:func:`~gputq.transport.base.write_window` of the unit's reservation
lifetime, counted from when the reservation was *requested* (the unit
granted it later); a batch whose copies would start after that is aborted,
its regions given back, and raises ``GputqTimeoutError``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Sequence

import numpy as np

from gputq.errors import GputqTimeoutError, ProtocolError
from gputq.transport.base import byte_view, describe_keys, write_window
from gputq.transport.wire import error_from_wire
from gputq.transport.write_batches import ABORT_WRITES, COMMIT_WRITES, RESERVE_WRITES, generation_of

__all__ = ["ArenaWrites", "REPLY_GRACE_S"]

#: Seconds a reservation's reply may take beyond the request's own wait for space; and what a
#: commit or an abort may take when the write's timeout is spent (a copied batch must get committed).
REPLY_GRACE_S = 10.0


class ArenaWrites:
    """Writes of one channel into its unit's arena file, mapped writable here.

    Parameters
    ----------
    control:
        The unit's control lane (a :class:`~gputq.transport.tcp.TcpChannel`: ``request``).
    unit:
        The unit's name, for messages.
    mapping:
        The unit's arena file mapped writable (a
        :class:`~gputq.transport.shm.ArenaMapping`); closed by :meth:`close`.
    """

    def __init__(self, control, unit: str, mapping):
        self._control = control
        self.unit = unit
        self.mapping = mapping
        #: Payloads copied into the arena (committed or not).
        self.copied = 0

    def write_many(self, items: Sequence[tuple], timeout: float | None = None) -> list:
        """Store ``(key, payload, meta)`` items: each one's receipt or the unit's error for it, in order
        (see :meth:`Channel.write_many <gputq.transport.base.Channel.write_many>`)."""
        keys = [key for key, _, _ in items]
        views = [np.frombuffer(byte_view(payload), np.uint8) for _, payload, _ in items]
        metas = [meta or {} for _, _, meta in items]
        asked = time.monotonic()
        reply = self._control.request(
            RESERVE_WRITES, {"items": [[k, v.nbytes, m] for k, v, m in zip(keys, views, metas)], "wait_s": timeout},
            None if timeout is None else timeout + REPLY_GRACE_S, keys=keys, write=True)
        results, reserved = self._reserved(reply, keys, views)
        named = [[keys[i], generation_of(metas[i])] for i, _ in reserved]
        if not reserved:
            return results
        window = write_window(reply.get("reservation_s"))
        try:
            self._copy(reserved, views, None if window is None else asked + window, keys)
        except BaseException:
            with contextlib.suppress(Exception):  # the copy's error is the one to see
                self._control.request(ABORT_WRITES, {"items": named}, REPLY_GRACE_S, keys=keys, write=True)
            raise
        done = self._control.request(COMMIT_WRITES, {"items": named}, None if timeout is None else REPLY_GRACE_S,
                                     keys=keys, write=True)
        committed = done.get("results") if isinstance(done, dict) else None
        if not _results(committed, len(reserved), "receipt"):
            raise ProtocolError(f"unit {self.unit}: malformed {COMMIT_WRITES} reply for keys {describe_keys(keys)}")
        for (i, _), result in zip(reserved, committed):
            results[i] = error_from_wire(result["error"]) if "error" in result else result["receipt"]
        return results

    def _reserved(self, reply, keys: list, views: list) -> tuple[list, list[tuple[int, int]]]:
        """The reservation reply's errors in place, and ``(item, offset)`` of every region reserved."""
        answers = reply.get("results") if isinstance(reply, dict) else None
        if not _results(answers, len(keys), "offset"):
            raise ProtocolError(f"unit {self.unit}: malformed {RESERVE_WRITES} reply for keys {describe_keys(keys)}")
        results: list = [None] * len(keys)
        reserved = []
        for i, answer in enumerate(answers):
            if "error" in answer:
                results[i] = error_from_wire(answer["error"])
                continue
            offset = answer["offset"]
            if type(offset) is not int or offset < 0 or offset + views[i].nbytes > self.mapping.nbytes:
                raise ProtocolError(f"unit {self.unit} reserved {offset!r} for {views[i].nbytes} bytes of "
                                    f"{keys[i]!r}, outside its arena of {self.mapping.nbytes}")
            reserved.append((i, offset))
        return results, reserved

    def _copy(self, reserved: list, views: list, start_by: float | None, keys: list) -> None:
        with self.mapping.held():
            arena = self.mapping.array
            for i, offset in reserved:
                if start_by is not None and time.monotonic() > start_by:
                    raise GputqTimeoutError(f"unit {self.unit}: the copy of key {keys[i]!r} would start past "
                                            f"its reservation's safe window; writes of {describe_keys(keys)} "
                                            f"aborted")
                np.copyto(arena[offset:offset + views[i].nbytes], views[i])
                self.copied += 1

    def close(self) -> None:
        """Unmap, once no copy runs. Idempotent."""
        self.mapping.close()


def _results(answers, count: int, ok: str) -> bool:
    return isinstance(answers, list) and len(answers) == count and \
        all(isinstance(a, dict) and (ok in a or "error" in a) for a in answers)
