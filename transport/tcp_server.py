"""The serving side of the tcp backend: the accept loop and the handshakes.

One thread accepts connections and runs every handshake in a selector loop:
an unauthenticated peer holds a socket and at most a few KiB
(:data:`~gputq.transport.wire.PRE_AUTH_BODY_BYTES`), never a thread, and must
complete its HELLO within the :class:`~gputq.transport.handler.ServerLimits`'
``handshake_timeout_s``. Each authenticated connection then gets a thread,
which :func:`~gputq.transport.tcp_connection.serve_connection` serves.
``max_connections`` caps the connections of both kinds. At the cap a new
connection takes the place of the oldest one still handshaking, so a flood
of peers that never authenticate cannot lock token holders out: a client
sends its HELLO at once and is through long before the flood reaches it.
Only when every slot is authenticated is the new connection refused, with a
:class:`~gputq.errors.UnitBusyError` reply the client retries with backoff.
Failed handshakes are logged at a limited rate.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import selectors
import socket
import threading
import time

from gputq.errors import (
    AuthenticationError,
    GputqTimeoutError,
    InvalidInputError,
    ProtocolError,
    UnitBusyError,
)
from gputq.transport.base import LogLimiter, Server
from gputq.transport.handler import ArenaHandler, ServerLimits, check_handler
from gputq.transport.policy import local_hostname
from gputq.transport.tcp_connection import LINGER_BYTES, LINGER_S, serve_connection, tune_socket
from gputq.transport.wire import (
    HEADER,
    PRE_AUTH_BODY_BYTES,
    Op,
    decode_header,
    encode_header,
    error_to_wire,
    pack_body,
    unpack_body,
)

__all__ = ["TcpServer", "Handshake"]

log = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.1
_ACCEPT_RETRY_S = 0.05
_JOIN_S = 5.0


# ---------------------------------------------------------------- handshakes

class Handshake:
    """An unauthenticated connection: the bytes of its HELLO so far, and its deadline.

    Pure bookkeeping (no socket calls), so it can be fuzzed on its own. It
    never holds more than one header plus
    :data:`~gputq.transport.wire.PRE_AUTH_BODY_BYTES`.
    """

    __slots__ = ("sock", "peer", "deadline", "buf", "header", "draining")

    def __init__(self, sock=None, peer=None, deadline: float = 0.0):
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.buf = bytearray()
        self.header = None
        self.draining = 0  # bytes still to swallow after an error reply; 0: handshaking

    def missing(self) -> int:
        """Bytes to receive before the HELLO is complete (or its header is)."""
        if self.header is None:
            return HEADER.size - len(self.buf)
        return HEADER.size + self.header.body_len - len(self.buf)

    def feed(self, data: bytes) -> dict | None:
        """Take at most :meth:`missing` bytes; return the HELLO body once complete.

        Raises
        ------
        ProtocolError
            Not a frame, or a body over the pre-authentication limit.
        AuthenticationError
            A frame other than HELLO came first.
        """
        if len(data) > self.missing():
            raise ProtocolError("more bytes than the handshake asked for")
        self.buf += data
        if self.header is None and len(self.buf) == HEADER.size:
            self.header = decode_header(bytes(self.buf), 0, PRE_AUTH_BODY_BYTES)
            if self.header.opcode != Op.HELLO:
                raise AuthenticationError("the first frame must be HELLO")
        if self.header is not None and self.missing() == 0:
            return unpack_body(bytes(self.buf[HEADER.size:]))
        return None


def _token_ok(body: dict, token: str) -> bool:
    offered = body.get("token")
    return isinstance(offered, str) and hmac.compare_digest(offered.encode(), token.encode())


class TcpServer(Server):
    """Serves one arena over tcp: a handshake/accept thread plus one thread per authenticated connection.

    Build it with :meth:`TcpTransport.serve`.

    Attributes
    ----------
    refused : int
        Connections refused with :class:`~gputq.errors.UnitBusyError`:
        ``limits.max_connections`` were open and all authenticated.
    evicted : int
        Handshaking connections closed to admit a newer one at the cap.
    failed_handshakes : int
        Connections that did not authenticate (wrong token, bad frame, deadline).
    """

    def __init__(self, handler: ArenaHandler, host: str, port: int, token: str,
                 limits: ServerLimits = ServerLimits()):
        if not isinstance(limits, ServerLimits):
            raise InvalidInputError(f"limits must be a ServerLimits, got {type(limits).__name__}")
        self._handler = check_handler(handler)
        self._token = token
        self._limits = limits
        self._lock = threading.Lock()
        self._closed = False
        self._nconns = 0  # handshaking + authenticated
        self._threads: dict[socket.socket, threading.Thread] = {}
        self._pending: dict[socket.socket, Handshake] = {}
        self.refused = 0
        self.evicted = 0
        self.failed_handshakes = 0
        self._limited_log = LogLimiter(log)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._host = host
        self._port = self._listener.getsockname()[1]
        self._address = {"transport": "tcp", "unit": handler.name,
                         "incarnation": handler.incarnation,
                         "host": host, "port": self._port, "hostname": local_hostname()}
        self._loop = threading.Thread(target=self._accept_loop, name=f"gputq-tcp-accept-{handler.name}",
                                      daemon=True)
        self._loop.start()

    @property
    def address(self) -> dict:
        return dict(self._address)

    @property
    def limits(self) -> ServerLimits:
        """What the server allows its peers."""
        return self._limits

    @property
    def connections(self) -> int:
        """Open connections, handshaking or authenticated."""
        with self._lock:
            return self._nconns

    # -- the accept and handshake loop (one thread) --

    def _accept_loop(self) -> None:
        try:
            while not self._closed:
                now = time.monotonic()
                timeout = _ACCEPT_POLL_S
                if self._pending:
                    timeout = max(0.0, min(timeout, min(h.deadline for h in self._pending.values()) - now))
                for key, _ in self._selector.select(timeout):
                    try:
                        if key.data is None:
                            self._accept()
                        else:
                            self._advance(key.data)
                    except Exception as exc:  # one connection is lost; the server goes on serving
                        self._limited_log.warning("unit %s: handshake loop: %s", self._handler.name, exc)
                        if key.data is not None:
                            self._drop(key.data)
                now = time.monotonic()
                for hs in [h for h in self._pending.values() if h.deadline <= now]:
                    if not hs.draining:
                        self._fail(hs, GputqTimeoutError(
                            f"no valid HELLO within {self.limits.handshake_timeout_s:g} s"), linger=False)
                    self._drop(hs)
        finally:
            for hs in list(self._pending.values()):
                self._drop(hs)

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._closed:
                    return
                # EMFILE, ENFILE, ECONNABORTED: transient; keep serving.
                self._limited_log.warning("unit %s: accept failed: %s", self._handler.name, exc)
                time.sleep(_ACCEPT_RETRY_S)
                return
            with self._lock:
                full = self._nconns >= self.limits.max_connections
            if full and not self._admit_at_cap(sock, peer):
                continue
            with self._lock:  # only this thread adds connections: the cap holds
                self._nconns += 1
            sock.setblocking(False)
            hs = Handshake(sock, peer, time.monotonic() + self.limits.handshake_timeout_s)
            self._pending[sock] = hs
            self._selector.register(sock, selectors.EVENT_READ, hs)
            # A client's HELLO may have come in before its accept (a backlog filled by a flood): read it now,
            # or the accepts behind it in this loop can take its place as the oldest handshake first.
            self._advance(hs)

    def _admit_at_cap(self, sock: socket.socket, peer) -> bool:
        """At the cap: close the oldest handshaking connection for ``sock``, or refuse ``sock``.

        An unauthenticated connection is the cheapest to lose and the one a
        flood is made of; an authenticated one is never closed for a newcomer.
        """
        oldest = min(self._pending.values(), key=lambda h: h.deadline, default=None)
        if oldest is not None:
            self.evicted += 1
            self._limited_log.warning("unit %s: %d connections open (max_connections); closing the oldest "
                                      "handshake (%s) for %s", self._handler.name, self.limits.max_connections,
                                      oldest.peer, peer)
            self._drop(oldest)
            return True
        self.refused += 1
        self._limited_log.warning("unit %s: %d authenticated connections open (max_connections); refusing %s",
                                  self._handler.name, self.limits.max_connections, peer)
        # Best effort and non-blocking: the client takes a close before its HELLO reply the same way.
        raw = pack_body(error_to_wire(UnitBusyError(
            f"unit {self._handler.name} holds {self.limits.max_connections} connections (max_connections); "
            f"retry later")))
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(encode_header(Op.ERROR, len(raw), 0) + raw)
        sock.close()
        return False

    def _advance(self, hs: Handshake) -> None:
        # Read on until the socket would block: a HELLO already in (header, then body) completes in one call.
        while True:
            try:
                data = hs.sock.recv(min(hs.draining, 1 << 16) if hs.draining else hs.missing())
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if hs.draining:
                hs.draining -= len(data)
                if not data or hs.draining <= 0:
                    self._drop(hs)
                return
            try:
                if not data:
                    raise ProtocolError(f"truncated HELLO: connection closed after {len(hs.buf)} bytes")
                body = hs.feed(data)
                if body is None:
                    continue
                if not _token_ok(body, self._token):
                    raise AuthenticationError(f"tcp handshake refused by unit {self._handler.name}")
            except (ProtocolError, AuthenticationError) as exc:
                self._fail(hs, exc, linger=bool(data))
                if not hs.draining:
                    self._drop(hs)
                return
            break
        self._selector.unregister(hs.sock)
        del self._pending[hs.sock]
        thread = threading.Thread(target=self._run, args=(hs.sock,), daemon=True,
                                  name=f"gputq-tcp-conn-{self._handler.name}")
        with self._lock:
            self._threads[hs.sock] = thread
        try:
            thread.start()
        except RuntimeError:  # no thread can be started now: refuse this connection, keep the rest
            with self._lock:
                self._threads.pop(hs.sock, None)
                self._nconns -= 1
            hs.sock.close()
            raise

    def _fail(self, hs: Handshake, exc: Exception, *, linger: bool) -> None:
        """Log (rate-limited), send the ERROR reply if it fits the socket buffer, stop sending."""
        self.failed_handshakes += 1
        self._limited_log.warning("unit %s: handshake from %s failed: %s", self._handler.name, hs.peer, exc)
        raw = pack_body(error_to_wire(exc))
        with contextlib.suppress(OSError):
            hs.sock.send(encode_header(Op.ERROR, len(raw), 0) + raw)
            hs.sock.shutdown(socket.SHUT_WR)
        if linger:
            # Closing with unread input sends RST, which can destroy the reply: swallow a little first.
            hs.draining = LINGER_BYTES
            hs.deadline = min(hs.deadline, time.monotonic() + LINGER_S)

    def _drop(self, hs: Handshake) -> None:
        if self._pending.pop(hs.sock, None) is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(hs.sock)
        hs.sock.close()
        with self._lock:
            self._nconns -= 1

    # -- authenticated connections --

    def _run(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(True)
            tune_socket(sock)
            serve_connection(sock, self._handler, self.limits)
        except Exception:  # a handler bug must not go unnoticed, nor kill the server
            log.exception("unit %s: connection thread failed", self._handler.name)
            with contextlib.suppress(OSError):
                sock.close()
        finally:
            with self._lock:
                self._threads.pop(sock, None)
                self._nconns -= 1

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._loop.join(_JOIN_S)
        self._selector.close()
        self._listener.close()
        with self._lock:
            threads = dict(self._threads)
        for sock in threads:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv
        for thread in threads.values():
            thread.join(_JOIN_S)
