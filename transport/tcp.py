"""The tcp backend: plain sockets, no native dependency.

Writes land directly in the arena: the server reserves the region with
``begin_write`` and receives the payload with ``recv_into`` at that offset.
Reads stream the leased regions with ``sendall`` of arena slices and the
client receives them with ``recv_into`` straight into the caller's buffer
(through a pinned staging ring when that buffer is on a GPU), or, through a
:class:`~gputq.transport.tcp_pipeline.ReadPipeline`, sends reads ahead of
their replies and hands each reply over chunk by chunk as it lands. No
payload byte is copied in Python on either side. The channel's connections
and their pools are :mod:`gputq.transport.tcp_pool`; the serving side is
:mod:`gputq.transport.tcp_server` (accepting, handshakes) and
:mod:`gputq.transport.tcp_connection` (each connection's requests); the
framing is :mod:`gputq.transport.wire`.

A :class:`TcpChannel` keeps two capped pools of connections: one for
writes, which may wait on the unit for arena space, and one for reads and
control calls, which must never queue behind them. Read pipelines, each
holding its connection until it closes (a stream's, for the stream's
life), take theirs from a third pool without a cap, so streams paused
between micro-batches never starve a call. Every transport failure the
channel raises (lost peer, timeout, broken frame) names the unit, and for
reads the keys. A unit at its connection cap refuses new connections at
the door; the channel retries them with backoff within the caller's
timeout and then raises :class:`~gputq.errors.UnitBusyError`, a timeout
that says the unit is alive.
"""

from __future__ import annotations

import contextlib
import random
import time
from typing import Any, Sequence

from gputq.errors import (
    ClosedError,
    InvalidInputError,
    ProtocolError,
    RequestTooLargeError,
    UnitBusyError,
)
from gputq.transport.base import Channel, TransportType, byte_view, describe_keys, is_device_buffer
from gputq.transport.handler import ArenaHandler, ServerLimits
from gputq.transport.staging import StagingPool, device_nbytes
from gputq.transport.tcp_connection import SOCKET_BUFFER_BYTES, serve_connection
from gputq.transport.tcp_pipeline import ReadPipeline, read_body, reply_lengths
from gputq.transport.tcp_pool import TRANSPORT_FAILURES, Connection, ConnectionPool
from gputq.transport.tcp_server import TcpServer
from gputq.transport.wire import MAX_WRITE_ITEMS, Op, error_from_wire

__all__ = [
    "SOCKET_BUFFER_BYTES",
    "CHANNEL_CONNECTIONS",
    "TcpTransport",
    "TcpServer",
    "TcpChannel",
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


class TcpChannel(Channel):
    """A thread-safe client of one unit over small pools of connections.

    Build it with :meth:`TcpTransport.connect`. Writes, which may wait on the
    unit for arena space, use their own pool; reads and control calls use
    the other, so a reader is never starved by writers blocked on a full
    unit. Both are capped at ``max_connections``; read pipelines (:meth:`pipeline`) take
    their connections from a pool of their own without a cap (the unit's
    ``max_connections`` still bounds them). A connection whose request
    failed mid-frame (timeout, lost peer, protocol error) is discarded; one
    whose request ended with a typed error from the unit is reused.

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
        self._requests = ConnectionPool(self._open, max_connections, self.unit)
        self._writes = ConnectionPool(self._open, max_connections, self.unit)
        self._pipelines = ConnectionPool(self._open, None, self.unit)
        self._requests.add(first)
        self._staging = staging or StagingPool()

    def _open(self, timeout: float | None, watch=None) -> Connection:
        """A new authenticated connection; refusals of a busy unit are retried with backoff.

        ``watch(sock)``, if given, is told each attempt's socket before its handshake (a pool's, which shuts
        it down if closed meanwhile, and refuses to let another attempt start).

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
                return Connection(self._address, self.unit, self._token, self._max_frame_bytes, left, watch)
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
    def _checkout(self, pool: ConnectionPool, timeout: float | None, what: str, keys=()):
        with self._naming(what, keys), pool.checkout(timeout, self._connect_timeout) as conn:
            yield conn

    @contextlib.contextmanager
    def _naming(self, what: str, keys=()):
        """Transport failures of the block raised again naming the unit, what failed and ``keys``."""
        try:
            yield
        except TRANSPORT_FAILURES as exc:
            if type(exc) not in TRANSPORT_FAILURES:  # a subclass the unit replied with (no space): already named
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
        body, pieces = read_body(keys, generations, incarnation, spans)
        on_device = is_device_buffer(dest)
        if on_device:
            capacity = device_nbytes(dest)
        else:
            host = byte_view(dest, writable=True)
            capacity = host.nbytes
        with self._checkout(self._requests, timeout, f"read of keys {describe_keys(keys)}", keys) as conn:
            conn.writer.send(Op.READ, body)
            lengths, total = reply_lengths(conn, pieces)
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

    def pipeline(self) -> ReadPipeline:
        """Reads sent ahead of their replies on one connection of this channel (see :class:`ReadPipeline`)."""
        if self._closed:
            raise ClosedError(f"tcp channel to {self.unit} is closed")
        return ReadPipeline(self.unit, lambda timeout: self._pipelines.checkout(timeout, self._connect_timeout),
                            self._naming)

    @property
    def connections(self) -> dict:
        """Connections open, and of those in use now, per pool: ``requests_open``, ``requests_busy``,
        ``pipelines_open``, ``pipelines_busy``, ``writes_open``, ``writes_busy``."""
        counts = {"requests": self._requests.counts, "pipelines": self._pipelines.counts,
                  "writes": self._writes.counts}
        return {f"{pool}_{what}": n for pool, (nopen, busy) in counts.items()
                for what, n in (("open", nopen), ("busy", busy))}

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
        self._pipelines.close()
        self._writes.close()
        self._staging.close()


class TcpTransport(TransportType):
    """The tcp backend: ``serve`` an arena, ``connect`` a channel to one."""

    name = "tcp"

    def serve(self, handler: ArenaHandler, *, host: str = "127.0.0.1", port: int = 0, token: str,
              limits: ServerLimits = ServerLimits()) -> TcpServer:
        return TcpServer(handler, host, port, token, limits)

    def connect(self, address: dict, *, token: str, max_frame_bytes: int,
                timeout: float | None = None) -> TcpChannel:
        return TcpChannel(address, token=token, max_frame_bytes=max_frame_bytes, timeout=timeout)
