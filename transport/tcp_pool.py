"""A tcp channel's connections to its unit: each authenticated once, pooled per lane, used by one request at a time.

A :class:`ConnectionPool` opens connections on demand up to its cap, hands
out an idle one to each request and takes it back once the request left it
in sync; one a request left mid-frame (a timeout, a lost peer, a broken
frame) is closed instead. A request that waits its whole timeout for a
connection raises :class:`~gputq.errors.UnitBusyError`: it sent nothing,
so the unit is not taken for lost. Closing the pool fails the requests in
flight.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Callable

import numpy as np

from gputq.errors import ClosedError, GputqError, GputqTimeoutError, PeerLostError, ProtocolError, UnitBusyError
from gputq.transport.tcp_connection import tune_socket
from gputq.transport.wire import Deadline, FrameReader, FrameWriter, Op, error_from_wire

__all__ = ["Connection", "ConnectionPool", "TRANSPORT_FAILURES"]

#: Transport failures, not errors the unit replied with: a channel raises them again naming the unit and the request.
TRANSPORT_FAILURES = (PeerLostError, GputqTimeoutError, ProtocolError)


class Connection:
    """One authenticated client socket; used by one request at a time."""

    def __init__(self, address: tuple[str, int], unit: str, token: str, max_frame_bytes: int,
                 timeout: float | None, watch: Callable[[socket.socket], None] | None = None):
        where = f"unit {unit} at {address[0]}:{address[1]}"
        self._bounce: np.ndarray | None = None
        try:
            self.sock = socket.create_connection(address, timeout=timeout)
        except (socket.timeout, TimeoutError):
            raise GputqTimeoutError(f"timed out connecting to {where}") from None
        except OSError as exc:
            raise PeerLostError(f"cannot connect to {where}: {exc}") from None
        try:
            if watch is not None:  # a pool closed during the handshake shuts the socket down
                watch(self.sock)
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
        """This connection's chunk buffer for a read pipeline's replies (:mod:`gputq.transport.tcp_pipeline`),
        kept for its next ones."""
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


class ConnectionPool:
    """Connections of one lane: a request finding all busy opens another, up to a cap, then waits.

    ``max_connections`` ``None`` sets no cap, for holders that keep a
    connection as long as their caller pleases (read pipelines): waiting
    for one of those could wait on a consumer, not on the unit.
    """

    def __init__(self, connect, max_connections: int | None, unit: str):
        self._connect = connect  # connect(timeout, watch): a new Connection
        self._max = max_connections
        self._unit = unit
        self._cond = threading.Condition()
        self._idle: list[Connection] = []
        self._busy: set[Connection] = set()
        self._connecting: set[socket.socket] = set()  # sockets of connections still handshaking
        self.nopen = 0
        self._closed = False

    def add(self, conn: Connection) -> None:
        with self._cond:
            self.nopen += 1
            self._idle.append(conn)

    @contextlib.contextmanager
    def checkout(self, timeout: float | None, connect_timeout: float | None):
        """Lend a connection, idle or new, for one request of ``timeout`` seconds (the block).

        Raises
        ------
        UnitBusyError
            Every connection stayed in use for the whole ``timeout``.
        ClosedError
            The pool is closed, or was closed before the new connection was lent: a request
            must never go out on a channel closed under it (the unit was marked lost).
        """
        conn = self._lend(timeout, connect_timeout)
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

    def _lend(self, timeout: float | None, connect_timeout: float | None) -> Connection:
        with self._cond:
            conn = self._idle_or_slot(timeout)
            if conn is not None:
                self._busy.add(conn)
                return conn
        return self._new(connect_timeout if timeout is None else timeout)

    def _idle_or_slot(self, timeout: float | None) -> Connection | None:
        """An idle connection, or None with a slot reserved for a new one; waits (under the lock) for either."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:
                raise ClosedError(f"tcp channel to {self._unit} is closed")
            if self._idle:
                return self._idle.pop()
            if self._max is None or self.nopen < self._max:
                self.nopen += 1  # reserve the slot before connecting outside the lock
                return None
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise UnitBusyError(f"unit {self._unit}: all {self._max} connections of this channel's lane "
                                    f"stayed in use for {timeout:g} s; the request was not sent")
            self._cond.wait(left)

    def _new(self, timeout: float | None) -> Connection:
        """A new connection in the slot reserved for it, lent unless the pool closed meanwhile."""
        handshaking: list[socket.socket] = []
        conn = failure = None
        try:
            conn = self._connect(timeout, lambda sock: self._watch(sock, handshaking))
        except BaseException as exc:  # noqa: BLE001 - raised again below
            failure = exc
        with self._cond:
            self._connecting.difference_update(handshaking)
            closed = self._closed
            if conn is not None and not closed:
                self._busy.add(conn)
                return conn
            self.nopen -= 1
            self._cond.notify()
        if conn is not None:
            conn.close()
        elif not closed or not isinstance(failure, GputqError) or isinstance(failure, ClosedError):
            raise failure
        # Made, or cut mid-handshake, by close(): not refused by the unit, so no busy unit to retry, and
        # no loss of its own.
        raise ClosedError(f"tcp channel to {self._unit} was closed while connecting") from failure

    def _watch(self, sock: socket.socket, handshaking: list) -> None:
        """Track a handshaking socket so that :meth:`close` can shut it down; refuse once closed."""
        with self._cond:
            if self._closed:
                raise ClosedError(f"tcp channel to {self._unit} is closed")
            self._connecting.add(sock)
            handshaking.append(sock)

    @property
    def counts(self) -> tuple[int, int]:
        """Connections open, and of those lent to a request now."""
        with self._cond:
            return self.nopen, len(self._busy)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, busy, connecting = self._idle, list(self._busy), list(self._connecting)
            self._idle = []
            self.nopen -= len(idle)
            self._cond.notify_all()
        for conn in idle:
            conn.close()
        # The request in flight fails, and so does a handshake; their threads close the sockets.
        for sock in [conn.sock for conn in busy] + connecting:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
