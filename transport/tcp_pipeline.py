"""Reads sent ahead of their replies on one tcp connection, each reply landed chunk by chunk as it arrives.

:class:`ReadPipeline` is what a stream's tcp fetch reads through (see its
docstring); :func:`read_body`, :func:`reply_lengths` and
:func:`frame_deadline` are the request and reply helpers it shares with
:meth:`TcpChannel.read <gputq.transport.tcp.TcpChannel.read>`.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import struct
from typing import Callable, Sequence

import numpy as np

from gputq.errors import ClosedError, GputqTimeoutError, InvalidInputError, PeerLostError, ProtocolError
from gputq.transport.base import describe_keys, read_args
from gputq.transport.tcp_pool import TRANSPORT_FAILURES, Connection
from gputq.transport.wire import Deadline, Op

__all__ = ["ReadPipeline", "read_body", "reply_lengths", "frame_deadline"]


def read_body(keys: Sequence[str], generations, incarnation, spans) -> tuple[dict, int]:
    """A READ request's body, and how many lengths its reply must give (one per key, or per span)."""
    body, spans_named = read_args(keys, generations, incarnation, spans)
    return body, len(body["keys"]) if spans_named is None else spans_named


def frame_deadline(conn: Connection, timeout: float | None) -> Deadline | None:
    """The deadline of one send or receive on ``conn``; unbounded ones leave the socket blocking."""
    if timeout is None:
        conn.sock.settimeout(None)
        return None
    return Deadline(timeout)


def reply_lengths(conn: Connection, pieces: int) -> tuple[list[int], int]:
    """A READ reply's header: its lengths (checked against ``pieces`` and the payload) and payload bytes.
    The unit's typed error is raised with the connection still in sync."""
    header, reply = conn.reply_header()
    lengths = reply.get("lengths")
    total = header.payload_len
    if not isinstance(lengths, list) or len(lengths) != pieces \
            or not all(type(n) is int and n >= 0 for n in lengths) or sum(lengths) != total:
        raise ProtocolError("READ reply lengths do not match its payload")
    return lengths, total


#: A payload's kernel receive timeout is armed again once less than this share of it is left.
_REARM_SHARE = 0.9


def _land_payload(conn: Connection, total: int, sink, chunk_bytes: int, deadline: Deadline | None,
                  breaks: Sequence[int] = ()) -> None:
    """Receive ``total`` payload bytes chunk by chunk into ``conn``'s buffer, handing each to ``sink``;
    a chunk also ends at each offset of ``breaks``.

    One system call a chunk: the socket blocks in the kernel, bounded by a
    kernel receive timeout (``SO_RCVTIMEO``) armed from ``deadline``, not by
    Python's per-call timeout, which makes the socket non-blocking and polls
    before every receive (three calls a chunk, a third of the receive's CPU
    at 64 KiB chunks). The timeout is armed again whenever less than 90% of
    it is left, so the receive ends at most a tenth of the deadline past it.
    """
    sock = conn.sock
    bounce = conn.bounce(chunk_bytes)
    view = memoryview(bounce)
    armed = None
    sock.settimeout(None)
    try:
        got = 0
        upcoming = 0  # the first of ``breaks`` past ``got``
        while got < total:
            if deadline is not None:
                left = deadline.remaining()  # raises once expired
                if armed is None or left < _REARM_SHARE * armed:
                    _receive_timeout(sock, left)
                    armed = left
            n = min(chunk_bytes, total - got)
            while upcoming < len(breaks) and breaks[upcoming] <= got:
                upcoming += 1
            if upcoming < len(breaks) and breaks[upcoming] < got + n:
                n = breaks[upcoming] - got
            landed = 0
            while landed < n:
                try:
                    received = sock.recv_into(view[landed:n])
                except BlockingIOError:  # the kernel receive timeout
                    raise GputqTimeoutError("timed out waiting for the peer") from None
                except OSError as exc:
                    raise PeerLostError(f"connection lost: {exc}") from None
                if not received:
                    raise PeerLostError(f"truncated frame: connection closed after {got + landed} of {total} bytes")
                landed += received
            sink(got, bounce[:n])
            got += n
    finally:
        if armed is not None:
            with contextlib.suppress(OSError):
                _receive_timeout(sock, 0.0)


def _check_breaks(breaks: Sequence[int]) -> None:
    previous = 0
    for offset in breaks:
        if type(offset) is not int or offset <= previous or offset % 16:
            raise InvalidInputError(f"breaks must be increasing positive multiples of 16, got {list(breaks)[:8]}")
        previous = offset


def _receive_timeout(sock: socket.socket, seconds: float) -> None:
    """The kernel's bound on one blocking receive (0: none)."""
    whole, micros = divmod(max(0, round(seconds * 1e6)), 1_000_000)
    if seconds > 0 and not whole and not micros:
        micros = 1  # a zero timeval would mean no bound at all
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", whole, micros))


class ReadPipeline:
    """Reads sent ahead of their replies on one connection, each reply handed over chunk by chunk as it lands.

    Build it with :meth:`TcpChannel.pipeline <gputq.transport.tcp.TcpChannel.pipeline>`.
    A unit serves a connection's
    requests in the order they came, so a read sent before the previous
    reply is received has its reply queued right behind it: the round trip
    (the request's way there, the unit's work on it) overlaps the previous
    reply's transfer instead of following it. :meth:`receive` takes the
    replies in the order :meth:`send` sent their reads.

    A reply is received ``chunk_bytes`` at a time into one buffer of the
    connection, reused and small enough to stay in the CPU's caches; each
    chunk (the last may be shorter) goes to ``sink(offset, chunk)``: its
    offset in the reply's payload and a uint8 array valid only during the
    call. A consumer that widens each chunk there reads it from cache while
    the unit's next bytes queue in the socket buffers: no staging buffer,
    no hand-off to another thread. A consumer whose work divides the payload
    into runs (each widened to its own place) names where they end, as
    ``breaks``: a chunk then never spans two runs, and each is one copy.

    The unit's typed errors (a stale or unknown key) come from the
    :meth:`receive` of their read, and the reads behind it stay in flight.
    Any other failure (lost peer, timeout, a ``sink`` that raised) drops
    the connection with every read in flight: the :meth:`receive` of each
    of them raises that transport failure again (a
    :class:`~gputq.errors.ClosedError` for one a ``sink`` dropped).
    Not thread-safe: one thread sends and receives. ``close`` (idempotent)
    hands the connection back to the channel when no reply is pending, and
    drops it otherwise.

    Parameters
    ----------
    unit:
        The unit's name, for messages.
    checkout:
        ``checkout(timeout)``: a context manager lending one of the channel's
        read connections (the pipeline holds it until ``close``).
    naming:
        ``naming(what, keys)``: a context manager raising the block's
        transport failures again naming the unit, ``what`` failed and ``keys``.
    """

    def __init__(self, unit: str, checkout: Callable, naming: Callable):
        self.unit, self._checkout, self._naming = unit, checkout, naming
        self._hold = contextlib.ExitStack()
        self._conn: Connection | None = None
        self._sent: collections.deque = collections.deque()  # (keys, lengths the reply gives), in order
        self._dropped: Exception | None = None  # the transport failure that dropped reads in flight

    @property
    def pending(self) -> int:
        """Reads sent whose replies were not received yet."""
        return len(self._sent)

    def send(self, keys: Sequence[str], timeout: float | None = None, *, generations: Sequence[int] | None = None,
             incarnation: str | None = None, spans=None) -> None:
        """Send a read (the arguments of :meth:`TcpChannel.read <gputq.transport.tcp.TcpChannel.read>`, less
        ``dest``); its reply is left queued."""
        body, pieces = read_body(keys, generations, incarnation, spans)
        what = f"read of keys {describe_keys(keys)}"
        with self._failing(), self._naming(what, keys):
            if self._conn is None:
                self._conn = self._hold.enter_context(self._checkout(timeout))
            self._dropped = None
            self._conn.in_sync = False  # until every reply is in
            self._conn.writer.deadline = frame_deadline(self._conn, timeout)
            self._conn.writer.send(Op.READ, body)
            self._sent.append((list(keys), pieces))

    def receive(self, sink: Callable[[int, np.ndarray], None], timeout: float | None = None, *,
                chunk_bytes: int, breaks: Sequence[int] = ()) -> list[int]:
        """Receive the oldest pending reply into ``sink``, ``chunk_bytes`` at a time; returns its lengths.

        ``chunk_bytes`` is a positive multiple of 16, and ``breaks`` (payload
        offsets where a chunk also ends; those past the payload are ignored)
        are increasing positive multiples of 16: no element of a span
        starting on 16 bytes then straddles two chunks.
        """
        chunk_bytes = int(chunk_bytes)
        if chunk_bytes < 16 or chunk_bytes % 16:
            raise InvalidInputError(f"chunk_bytes must be a positive multiple of 16, got {chunk_bytes}")
        _check_breaks(breaks)
        if not self._sent:
            if self._dropped is not None:  # the reads in flight went with the connection
                raise type(self._dropped)(f"{self._dropped} (the read was in flight on that connection)")
            raise ClosedError(f"no read of unit {self.unit} is in flight on this pipeline")
        keys, pieces = self._sent.popleft()
        conn = self._conn
        with self._failing(), self._naming(f"read of keys {describe_keys(keys)}", keys):
            deadline = conn.reader.deadline = frame_deadline(conn, timeout)
            conn.in_sync = False
            lengths, total = reply_lengths(conn, pieces)
            _land_payload(conn, total, sink, chunk_bytes, deadline, breaks)
            conn.in_sync = True
            return lengths

    @contextlib.contextmanager
    def _failing(self):
        """A failure that leaves the connection out of sync drops it with every read in flight."""
        try:
            yield
        except BaseException as exc:
            if self._conn is not None and not self._conn.in_sync:
                self._dropped = exc if self._sent and isinstance(exc, TRANSPORT_FAILURES) else None
                self._sent.clear()
                self.close()
            raise

    def close(self) -> None:
        """Hand the connection back (dropped if a reply is pending). Idempotent."""
        if self._conn is not None:
            if self._sent:
                self._conn.in_sync = False
            self._sent.clear()
            self._conn = None
            self._hold.close()
