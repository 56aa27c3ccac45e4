"""A tcp channel's connections to its unit: each authenticated once, pooled per lane, used by one request at a time.

A :class:`ConnectionPool` opens connections on demand up to its cap, hands
out an idle one to each request and takes it back once the request left it
in sync; one a request left mid-frame (a timeout, a lost peer, a broken
frame) is closed instead. Closing the pool fails the requests in flight.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np

from gputq.errors import ClosedError, GputqTimeoutError, PeerLostError, ProtocolError, UnitBusyError
from gputq.transport.tcp_connection import tune_socket
from gputq.transport.wire import Deadline, FrameReader, FrameWriter, Op, error_from_wire

__all__ = ["Connection", "ConnectionPool", "TRANSPORT_FAILURES"]

#: Transport failures, not errors the unit replied with: a channel raises them again naming the unit and the request.
TRANSPORT_FAILURES = (PeerLostError, GputqTimeoutError, ProtocolError)


class Connection:
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
    """Connections of one lane: a request finding all busy opens another, up to a cap, then waits."""

    def __init__(self, connect, max_connections: int, unit: str):
        self._connect = connect
        self._max = max_connections
        self._unit = unit
        self._cond = threading.Condition()
        self._idle: list[Connection] = []
        self._busy: set[Connection] = set()
        self.nopen = 0
        self._closed = False

    def add(self, conn: Connection) -> None:
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
