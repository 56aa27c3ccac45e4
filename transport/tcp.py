"""The tcp backend: plain sockets, no native dependency.

Writes land directly in the arena: the server reserves the region with
``begin_write`` and receives the payload with ``recv_into`` at that offset.
Reads stream the leased regions with ``sendall`` of arena slices and the
client receives them with ``recv_into`` straight into the caller's buffer
(through a pinned staging ring when that buffer is on a GPU), or, through a
:class:`ReadPipeline`, sends reads ahead of their replies and hands each
reply over chunk by chunk as it lands. No payload byte is copied in Python
on either side. The serving side is :mod:`gputq.transport.tcp_server`
(accepting, handshakes) and :mod:`gputq.transport.tcp_connection` (each
connection's requests); the framing is :mod:`gputq.transport.wire`.

A :class:`TcpChannel` keeps two pools of connections: one for writes, which
may wait on the unit for arena space, and one for reads and control calls,
which must never queue behind them. Every transport failure it raises (lost
peer, timeout, broken frame) names the unit, and for reads the keys. A unit
at its connection cap refuses new connections at the door; the channel
retries them with backoff within the caller's timeout and then raises
:class:`~gputq.errors.UnitBusyError`, a timeout that says the unit is alive.
"""

from __future__ import annotations

import collections
import contextlib
import random
import socket
import struct
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from gputq.errors import (
    ClosedError,
    GputqTimeoutError,
    InvalidInputError,
    PeerLostError,
    ProtocolError,
    RequestTooLargeError,
    UnitBusyError,
)
from gputq.transport.base import (
    ArenaHandler,
    Channel,
    ServerLimits,
    TransportType,
    byte_view,
    describe_keys,
    is_device_buffer,
    read_args,
)
from gputq.transport.staging import StagingPool, device_nbytes
from gputq.transport.tcp_connection import SOCKET_BUFFER_BYTES, serve_connection, tune_socket
from gputq.transport.tcp_server import TcpServer
from gputq.transport.wire import MAX_WRITE_ITEMS, Deadline, FrameReader, FrameWriter, Op, error_from_wire

__all__ = [
    "SOCKET_BUFFER_BYTES",
    "CHANNEL_CONNECTIONS",
    "TcpTransport",
    "TcpServer",
    "TcpChannel",
    "ReadPipeline",
    "serve_connection",
]

#: Pooled connections per channel in each of its two lanes (writes; reads and calls).
CHANNEL_CONNECTIONS = 8
# A write may wait `timeout` seconds for arena space on the server; its
# reply (the unit's no-space error included) needs a little longer to come back.
_REPLY_GRACE_S = 5.0
# A unit at its connection cap refuses at the door; the retries back off
# from the first to the last delay (jittered, so many clients do not retry
# in step) until the caller's timeout.
_BUSY_FIRST_S = 0.005
_BUSY_LAST_S = 0.5
_BUSY_LAST_TRY_S = 0.01


# ---------------------------------------------------------------- client side

class _Connection:
    """One authenticated client socket; used by one request at a time."""

    def __init__(self, address: tuple[str, int], unit: str, token: str, max_frame_bytes: int,
                 timeout: float | None):
        where = f"unit {unit} at {address[0]}:{address[1]}"
        self._bounce: np.ndarray | None = None
        try:
            self.sock = socket.create_connection(address, timeout=timeout)
        except (socket.timeout, TimeoutError):
            raise GputqTimeoutError(f"timed out connecting to {where}") from None
        except OSError as exc:
            raise PeerLostError(f"cannot connect to {where}: {exc}") from None
        try:
            tune_socket(self.sock)
            self.reader = FrameReader(self.sock, max_frame_bytes, truncated_error=PeerLostError)
            self.writer = FrameWriter(self.sock)
            self.in_sync = True
            self.begin(timeout)
            self.writer.send(Op.HELLO, {"token": token})
            hello = self.reply()
            self.unit, self.incarnation = hello.get("unit"), hello.get("incarnation", "")
            if not isinstance(self.unit, str) or not isinstance(self.incarnation, str):
                raise ProtocolError(f"malformed HELLO reply from {where}")
        except PeerLostError as exc:
            self.close()
            # The unit's kernel accepted, then the unit closed before its HELLO reply: the unit is
            # there and at its cap (the busy reply lost to the reset, or our handshake the oldest
            # one closed for a newer). A unit that is gone refuses the next connect instead.
            raise UnitBusyError(f"{where} closed the connection before its HELLO reply: {exc}") from None
        except BaseException:
            self.close()
            raise

    def bounce(self, nbytes: int) -> np.ndarray:
        """This connection's chunk buffer for :meth:`ReadPipeline.receive`, kept for its next replies."""
        if self._bounce is None or self._bounce.nbytes != nbytes:
            self._bounce = np.ones(nbytes, np.uint8)  # touched now: a chunk lands in it at cache speed
        return self._bounce

    def begin(self, timeout: float | None) -> None:
        """Start a request: arm its deadline; the stream is out of sync until the reply is consumed."""
        deadline = None if timeout is None else Deadline(timeout)
        if deadline is None:
            self.sock.settimeout(None)
        self.reader.deadline = self.writer.deadline = deadline
        self.in_sync = False

    def reply_header(self):
        """Read the reply header and body; raise the peer's error if it sent one."""
        header, body = self.reader.read_frame()
        if header.opcode == Op.ERROR:
            if header.payload_len:
                raise ProtocolError("ERROR reply carries a payload")
            self.in_sync = True
            raise error_from_wire(body)
        if header.opcode != Op.OK:
            raise ProtocolError(f"unexpected reply opcode {header.opcode}")
        return header, body

    def reply(self) -> dict:
        header, body = self.reply_header()
        if header.payload_len:
            raise ProtocolError("unexpected payload in reply")
        self.in_sync = True
        return body

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class _Pool:
    """Connections of one lane: a request finding all busy opens another, up to a cap, then waits."""

    def __init__(self, connect, max_connections: int, unit: str):
        self._connect = connect
        self._max = max_connections
        self._unit = unit
        self._cond = threading.Condition()
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self.nopen = 0
        self._closed = False

    def add(self, conn: _Connection) -> None:
        with self._cond:
            self.nopen += 1
            self._idle.append(conn)

    @contextlib.contextmanager
    def checkout(self, timeout: float | None, connect_timeout: float | None):
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = None
        with self._cond:
            while True:
                if self._closed:
                    raise ClosedError(f"tcp channel to {self._unit} is closed")
                if self._idle:
                    conn = self._idle.pop()
                    break
                if self.nopen < self._max:
                    self.nopen += 1  # reserve the slot before connecting outside the lock
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise GputqTimeoutError(f"no free connection within {timeout} s")
                self._cond.wait(left)
        if conn is None:
            try:
                conn = self._connect(connect_timeout if timeout is None else timeout)
            except BaseException:
                with self._cond:
                    self.nopen -= 1
                    self._cond.notify()
                raise
        with self._cond:
            self._busy.add(conn)
        try:
            conn.begin(timeout)
            yield conn
        finally:
            with self._cond:
                self._busy.discard(conn)
                if conn.in_sync and not self._closed:
                    self._idle.append(conn)
                else:
                    self.nopen -= 1
                    conn.close()
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, busy = self._idle, list(self._busy)
            self._idle = []
            self.nopen -= len(idle)
            self._cond.notify_all()
        for conn in idle:
            conn.close()
        for conn in busy:  # the request in flight fails; its thread closes the socket
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)


# Transport failures (not errors the unit replied with) get the unit and the request added.
_RENAMED = (PeerLostError, GputqTimeoutError, ProtocolError)


class TcpChannel(Channel):
    """A thread-safe client of one unit over two small pools of connections.

    Build it with :meth:`TcpTransport.connect`. Writes, which may wait on the
    unit for arena space, use their own pool; reads and control calls use
    the other, so a reader is never starved by writers blocked on a full
    unit. A connection whose request failed mid-frame (timeout, lost peer,
    protocol error) is discarded; one whose request ended with a typed
    error from the unit is reused.

    Attributes
    ----------
    unit, incarnation : str
        From the unit's HELLO reply.
    """

    def __init__(self, address: dict, *, token: str, max_frame_bytes: int, timeout: float | None = None,
                 max_connections: int = CHANNEL_CONNECTIONS, staging: StagingPool | None = None):
        if address.get("transport") != "tcp":
            raise InvalidInputError(f"not a tcp address: {sorted(address)}")
        if max_connections < 1:
            raise InvalidInputError("max_connections must be at least 1")
        self._address = (address["host"], int(address["port"]))
        self._token = token
        self._max_frame_bytes = int(max_frame_bytes)
        self._connect_timeout = timeout
        self._closed = False
        self.unit = str(address.get("unit") or f"{self._address[0]}:{self._address[1]}")
        first = self._open(timeout)
        self.unit, self.incarnation = first.unit, first.incarnation
        self._requests = _Pool(self._open, max_connections, self.unit)
        self._writes = _Pool(self._open, max_connections, self.unit)
        self._requests.add(first)
        self._staging = staging or StagingPool()

    def _open(self, timeout: float | None) -> _Connection:
        """A new authenticated connection; refusals of a busy unit are retried with backoff.

        Raises
        ------
        UnitBusyError
            Every attempt within ``timeout`` was refused (a timeout, not a lost unit).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay, refusals = _BUSY_FIRST_S, 0
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                return _Connection(self._address, self.unit, self._token, self._max_frame_bytes, left)
            except UnitBusyError as exc:
                refusals += 1
                left = None if deadline is None else deadline - time.monotonic()
                # The last try keeps a few ms to connect in: one made with no time left would
                # fail as a connect timeout, which takes the unit for lost.
                if left is not None and left <= _BUSY_LAST_TRY_S:
                    raise UnitBusyError(f"unit {self.unit}: {refusals} connections refused in {timeout:g} s, "
                                        f"the last: {exc}") from None
                pause = random.uniform(delay / 2, delay)
                time.sleep(pause if left is None else min(pause, left - _BUSY_LAST_TRY_S))
                delay = min(2 * delay, _BUSY_LAST_S)

    @contextlib.contextmanager
    def _checkout(self, pool: _Pool, timeout: float | None, what: str, keys=()):
        with self._naming(what, keys), pool.checkout(timeout, self._connect_timeout) as conn:
            yield conn

    @contextlib.contextmanager
    def _naming(self, what: str, keys=()):
        """Transport failures of the block raised again naming the unit, what failed and ``keys``."""
        try:
            yield
        except _RENAMED as exc:
            if type(exc) not in _RENAMED:  # a subclass the unit replied with (no space): already named
                raise
            error = type(exc)(f"unit {self.unit}: {what} failed: {exc}")
            error.unit, error.keys = self.unit, tuple(keys)
            raise error from exc

    def write(self, key: str, payload, meta: dict | None = None, timeout: float | None = None) -> dict:
        view = byte_view(payload)
        if view.nbytes > self._max_frame_bytes:
            raise RequestTooLargeError(
                f"key {key!r}: {view.nbytes} bytes exceed max_frame_bytes={self._max_frame_bytes}")
        body = {"key": key, "nbytes": view.nbytes, "meta": meta or {}, "timeout": timeout}
        with self._checkout(self._writes, None if timeout is None else timeout + _REPLY_GRACE_S,
                            f"write of key {key!r}", (key,)) as conn:
            conn.writer.send(Op.WRITE, body, (view,))
            return conn.reply()["receipt"]

    def write_many(self, items: Sequence[tuple], timeout: float | None = None) -> list:
        """Store several ``(key, payload, meta)`` items in as few requests as the frame size allows.

        Returns each item's receipt, or the error the unit answered for it
        (an exception instance), in order. ``timeout`` bounds each request's
        waits for arena space together. A transport failure raises; the
        items of its request may then be stored or not.
        """
        views = [byte_view(payload) for _, payload, _ in items]
        results: list = [None] * len(items)
        batch: list[int] = []
        nbytes = 0
        for i, view in enumerate(views):
            if view.nbytes > self._max_frame_bytes:
                results[i] = RequestTooLargeError(
                    f"key {items[i][0]!r}: {view.nbytes} bytes exceed max_frame_bytes={self._max_frame_bytes}")
                continue
            if batch and (len(batch) == MAX_WRITE_ITEMS or nbytes + view.nbytes > self._max_frame_bytes):
                self._write_batch(items, views, batch, results, timeout)
                batch, nbytes = [], 0
            batch.append(i)
            nbytes += view.nbytes
        if batch:
            self._write_batch(items, views, batch, results, timeout)
        return results

    def _write_batch(self, items, views, batch: list[int], results: list, timeout: float | None) -> None:
        keys = [items[i][0] for i in batch]
        body = {"items": [[items[i][0], views[i].nbytes, items[i][2] or {}] for i in batch], "timeout": timeout}
        with self._checkout(self._writes, None if timeout is None else timeout + _REPLY_GRACE_S,
                            f"write of keys {describe_keys(keys)}", keys) as conn:
            conn.writer.send(Op.WRITE_MANY, body, [views[i] for i in batch])
            replies = conn.reply().get("results")
        if not isinstance(replies, list) or len(replies) != len(batch) \
                or not all(isinstance(r, dict) and ("receipt" in r or "error" in r) for r in replies):
            raise ProtocolError(f"unit {self.unit}: malformed WRITE_MANY reply for keys {describe_keys(keys)}")
        for i, reply in zip(batch, replies):
            results[i] = error_from_wire(reply["error"]) if "error" in reply else reply["receipt"]

    def read(self, keys: Sequence[str], dest, timeout: float | None = None, *,
             generations: Sequence[int] | None = None, incarnation: str | None = None,
             spans=None) -> list[int]:
        body, pieces = _read_body(keys, generations, incarnation, spans)
        on_device = is_device_buffer(dest)
        if on_device:
            capacity = device_nbytes(dest)
        else:
            host = byte_view(dest, writable=True)
            capacity = host.nbytes
        with self._checkout(self._requests, timeout, f"read of keys {describe_keys(keys)}", keys) as conn:
            conn.writer.send(Op.READ, body)
            lengths, total = _reply_lengths(conn, pieces)
            if total > capacity:
                conn.reader.drain(total)
                conn.in_sync = True
                raise RequestTooLargeError(
                    f"read of {len(keys)} keys from {self.unit} needs {total} bytes, dest holds {capacity}")
            if on_device:
                self._staging.receive(conn.reader.recv_exact, dest, total)
            else:
                conn.reader.recv_exact(host[:total])
            conn.in_sync = True
            return lengths

    @property
    def pipelines_reads(self) -> bool:
        return True

    def pipeline(self) -> "ReadPipeline":
        """Reads sent ahead of their replies on one connection of this channel (see :class:`ReadPipeline`)."""
        if self._closed:
            raise ClosedError(f"tcp channel to {self.unit} is closed")
        return ReadPipeline(self)

    def call(self, method: str, timeout: float | None = None, **args) -> Any:
        return self.request(method, args, timeout)

    def request(self, method: str, args: dict, timeout: float | None = None, *, keys: Sequence[str] = (),
                write: bool = False) -> Any:
        """:meth:`call` for backends built on this control lane (rdma, shm).

        A transport failure names the unit and, for calls serving a read or
        a ``write``, ``keys``. A ``write``'s call, which may wait on the unit
        for arena space, goes on the writes' connections.
        """
        what = f"{'write' if write else 'read'} of keys {describe_keys(keys)} ({method})" if keys \
            else f"control call {method!r}"
        with self._checkout(self._writes if write else self._requests, timeout, what, keys) as conn:
            conn.writer.send(Op.CALL, {"method": method, "args": args})
            return conn.reply()["result"]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._requests.close()
        self._writes.close()
        self._staging.close()


def _read_body(keys: Sequence[str], generations, incarnation, spans) -> tuple[dict, int]:
    """A READ request's body, and how many lengths its reply must give (one per key, or per span)."""
    body, spans_named = read_args(keys, generations, incarnation, spans)
    return body, len(body["keys"]) if spans_named is None else spans_named


def _deadline(conn: _Connection, timeout: float | None) -> Deadline | None:
    """The deadline of one send or receive on ``conn``; unbounded ones leave the socket blocking."""
    if timeout is None:
        conn.sock.settimeout(None)
        return None
    return Deadline(timeout)


#: A payload's kernel receive timeout is armed again once less than this share of it is left.
_REARM_SHARE = 0.9


def _land_payload(conn: _Connection, total: int, sink, chunk_bytes: int, deadline: Deadline | None,
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


def _reply_lengths(conn: _Connection, pieces: int) -> tuple[list[int], int]:
    """A READ reply's header: its lengths (checked against ``pieces`` and the payload) and payload bytes.
    The unit's typed error is raised with the connection still in sync."""
    header, reply = conn.reply_header()
    lengths = reply.get("lengths")
    total = header.payload_len
    if not isinstance(lengths, list) or len(lengths) != pieces \
            or not all(type(n) is int and n >= 0 for n in lengths) or sum(lengths) != total:
        raise ProtocolError("READ reply lengths do not match its payload")
    return lengths, total


class ReadPipeline:
    """Reads sent ahead of their replies on one connection, each reply handed over chunk by chunk as it lands.

    Build it with :meth:`TcpChannel.pipeline`. A unit serves a connection's
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
    """

    def __init__(self, channel: "TcpChannel"):
        self._channel = channel
        self._hold = contextlib.ExitStack()
        self._conn: _Connection | None = None
        self._sent: collections.deque = collections.deque()  # (keys, lengths the reply gives), in order
        self._dropped: Exception | None = None  # the transport failure that dropped reads in flight

    @property
    def pending(self) -> int:
        """Reads sent whose replies were not received yet."""
        return len(self._sent)

    def send(self, keys: Sequence[str], timeout: float | None = None, *, generations: Sequence[int] | None = None,
             incarnation: str | None = None, spans=None) -> None:
        """Send a read (the arguments of :meth:`TcpChannel.read`, less ``dest``); its reply is left queued."""
        body, pieces = _read_body(keys, generations, incarnation, spans)
        what = f"read of keys {describe_keys(keys)}"
        with self._failing(), self._channel._naming(what, keys):
            if self._conn is None:
                self._conn = self._hold.enter_context(self._channel._requests.checkout(
                    timeout, self._channel._connect_timeout))
            self._dropped = None
            self._conn.in_sync = False  # until every reply is in
            self._conn.writer.deadline = _deadline(self._conn, timeout)
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
            raise ClosedError(f"no read of unit {self._channel.unit} is in flight on this pipeline")
        keys, pieces = self._sent.popleft()
        conn = self._conn
        with self._failing(), self._channel._naming(f"read of keys {describe_keys(keys)}", keys):
            deadline = conn.reader.deadline = _deadline(conn, timeout)
            conn.in_sync = False
            lengths, total = _reply_lengths(conn, pieces)
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
                self._dropped = exc if self._sent and isinstance(exc, _RENAMED) else None
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


class TcpTransport(TransportType):
    """The tcp backend: ``serve`` an arena, ``connect`` a channel to one."""

    name = "tcp"

    def serve(self, handler: ArenaHandler, *, host: str = "127.0.0.1", port: int = 0, token: str,
              limits: ServerLimits = ServerLimits()) -> TcpServer:
        return TcpServer(handler, host, port, token, limits)

    def connect(self, address: dict, *, token: str, max_frame_bytes: int,
                timeout: float | None = None) -> TcpChannel:
        return TcpChannel(address, token=token, max_frame_bytes=max_frame_bytes, timeout=timeout)
