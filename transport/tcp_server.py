"""The serving side of the tcp backend: handshakes, connections, leases.

One thread accepts connections and runs every handshake in a selector loop:
an unauthenticated peer holds a socket and at most a few KiB
(:data:`~gputq.transport.wire.PRE_AUTH_BODY_BYTES`), never a thread, and must
complete its HELLO within the :class:`~gputq.transport.base.ServerLimits`'
``handshake_timeout_s``. Each authenticated connection then gets a thread.
``max_connections`` caps the connections of both kinds. At the cap a new
connection takes the place of the oldest one still handshaking, so a flood
of peers that never authenticate cannot lock token holders out: a client
sends its HELLO at once and is through long before the flood reaches it.
Only when every slot is authenticated is the new connection refused, with a
:class:`~gputq.errors.UnitBusyError` reply the client retries with backoff.
Failed handshakes are logged at a limited rate.

A read is sent under a lease the server holds itself (``expires=False``: it
never expires while the server sends) and under ``send_timeout_s``: a client
that stops reading loses its connection, and only then does the lease end,
so every byte it was sent is the key's. A write is received straight into
its reserved region under a deadline strictly shorter than the handler's
reservation timeout (:func:`~gputq.transport.base.write_window`): a client that
stalls mid-payload loses its connection and its reservation is aborted
while it still holds, so no byte of it lands in a region that expired and
went to another key. Every tcp server also answers the
one-sided readers' control calls (``lease``, ``end_lease``, ``arena_file``)
in front of the handler's own. Malformed requests get typed errors
(:class:`~gputq.errors.InvalidInputError`) and the connection goes on;
framing violations (:class:`~gputq.errors.ProtocolError`) close it.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import selectors
import socket
import threading
import time

import numpy as np

from gputq.errors import (
    AuthenticationError,
    GputqError,
    GputqTimeoutError,
    InvalidInputError,
    PeerLostError,
    ProtocolError,
    RequestTooLargeError,
    UnitBusyError,
)
from gputq.transport.base import (
    ArenaHandler,
    LogLimiter,
    Server,
    ServerLimits,
    byte_view,
    check_handler,
    write_window,
)
from gputq.transport.one_sided import ARENA_FILE, END_LEASE, LEASE
from gputq.transport.policy import local_hostname
from gputq.transport.spans import spans_from_wire
from gputq.transport.wire import (
    HEADER,
    PRE_AUTH_BODY_BYTES,
    Deadline,
    FrameReader,
    FrameWriter,
    Op,
    decode_header,
    encode_header,
    error_to_wire,
    pack_body,
    unpack_body,
)
from gputq.transport.write_batches import (
    FullArena,
    generation_of,
    reservation_call,
    reserve,
    typed_error,
    write_item,
    write_items,
)

__all__ = [
    "SOCKET_BUFFER_BYTES",
    "MAX_REQUEST_ITEMS",
    "TcpServer",
    "Handshake",
    "serve_connection",
    "lease_array",
    "tune_socket",
]

log = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 4 << 20
#: The most keys (or lease ids) one request may name.
MAX_REQUEST_ITEMS = 1 << 16
_ACCEPT_POLL_S = 0.1
_ACCEPT_RETRY_S = 0.05
_JOIN_S = 5.0
_LINGER_S = 0.5
_LINGER_BYTES = 4 << 20
_GENERATION_LIMIT = 1 << 64


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay, keepalive, and socket buffers sized for large frames."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


# ---------------------------------------------------------------- request validation

def _list_of(value, kind: type, what: str) -> list:
    if not isinstance(value, list) or not all(type(v) is kind for v in value):
        raise InvalidInputError(f"{what} must be a list of {kind.__name__}")
    if len(value) > MAX_REQUEST_ITEMS:
        raise InvalidInputError(f"{what}: {len(value)} items, at most {MAX_REQUEST_ITEMS} per request")
    return value


def _generations(value, nkeys: int) -> list | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != nkeys
            or not all(g is None or (type(g) is int and 0 <= g < _GENERATION_LIMIT) for g in value)):
        raise InvalidInputError(f"generations must be a list of {nkeys} ints in [0, 2**64) or None")
    return value


def _incarnation(value) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidInputError("incarnation must be a str")
    return value


# ---------------------------------------------------------------- leases

def lease_array(handler: ArenaHandler, keys: list, generations: list | None, incarnation: str | None, *,
                expires: bool, spans=None) -> tuple[int, np.ndarray]:
    """Lease ``keys`` with :meth:`ArenaHandler.lease_regions`; return ``(lease_id, int64 [n, 2])``.

    The rows are (offset, nbytes), one per key or, with ``spans`` (a
    request's wire bytes), one per span; little-endian as they go on the wire.
    """
    checked = spans_from_wire(spans, len(keys))
    # Whole-key reads pass no spans: a handler that overrides lease_regions without them still serves those.
    lease_id, regions = handler.lease_regions(keys, generations=generations, incarnation=incarnation,
                                              expires=expires, **({} if checked is None else {"spans": checked}))
    rows = len(keys) if checked is None else len(checked)
    return int(lease_id), np.asarray(regions, dtype="<i8").reshape(rows, 2)


def _held(result) -> bool:
    # None: a handler whose leases never expire (see ArenaHandler.end_lease).
    return result is None or bool(result)


def _generic_call(handler: ArenaHandler, method: str, args: dict):
    """The one-sided readers' control methods, answered by every tcp server.

    Returns ``NotImplemented`` for other methods (the handler's own).
    """
    if method == LEASE:
        for lease_id in _list_of(args.get("end", []), int, "end"):
            handler.end_lease(lease_id)  # first: a unit short of space frees them before leasing more
        keys = _list_of(args.get("keys"), str, "keys")
        # A one-sided reader may die mid-read: its lease must end without it.
        lease_id, regions = lease_array(handler, keys, _generations(args.get("generations"), len(keys)),
                                        _incarnation(args.get("incarnation")), expires=True,
                                        spans=args.get("spans"))
        reply = {"lease_id": lease_id, "regions": regions.tobytes()}
        lifetime = handler.lease_timeout_s
        if lifetime is not None:
            reply["expires_in"] = float(lifetime)  # lets the reader skip the confirm (gputq.transport.lease_ends)
        return reply
    if method == END_LEASE:
        return {"held": [_held(handler.end_lease(i)) for i in _list_of(args.get("lease_ids"), int, "lease_ids")]}
    if method == ARENA_FILE:
        reply = {"path": handler.arena_path, "nbytes": byte_view(handler.arena).nbytes}
        directory = handler.directory_file
        if directory is not None:
            reply["directory"] = directory
        return reply
    return reservation_call(handler, method, args)


# ---------------------------------------------------------------- serving one authenticated connection

def _reply_error(writer: FrameWriter, exc: BaseException) -> None:
    writer.send(Op.ERROR, error_to_wire(exc))


def _receive_write(reader, handler, key: str, nbytes: int, meta: dict, timeout, receive_s) -> dict | Exception:
    """Reserve ``nbytes`` for ``key``, receive them into the region and commit: the receipt, or the typed error
    the peer is told (its bytes drained, so the connection goes on). A stalled or lost peer raises."""
    generation = generation_of(meta)
    arena = byte_view(handler.arena)
    try:
        offset = reserve(handler, key, nbytes, meta, timeout)
    except Exception as exc:
        reader.drain(nbytes)
        return typed_error(exc, handler)
    # The region goes to another key once the reservation expires: a writer
    # that stalls must lose its connection while its reservation still holds,
    # or its late bytes would land in that key's bytes.
    try:
        with reader.bounded(receive_s):
            reader.recv_exact(arena[offset:offset + nbytes])
    except GputqTimeoutError:
        handler.abort_write(key, generation)
        raise GputqTimeoutError(
            f"unit {handler.name}: write of key {key!r} ({nbytes} bytes) not received within "
            f"{receive_s:g} s, inside its reservation; write aborted") from None
    except BaseException:
        handler.abort_write(key, generation)
        raise
    try:
        return handler.commit_write(key, generation)
    except Exception as exc:
        return typed_error(exc, handler)


def _serve_write(reader, writer, handler, body, payload_len: int, receive_s: float | None) -> None:
    try:
        key, nbytes, meta, timeout = write_item(body.get("key"), body.get("nbytes"), body.get("meta"),
                                                 body.get("timeout"))
        if nbytes != payload_len:
            raise InvalidInputError(f"WRITE of {key!r} announces {nbytes} bytes but carries {payload_len}")
    except Exception as exc:
        reader.drain(payload_len)  # the stream stays in sync: the connection goes on
        _reply_error(writer, typed_error(exc, handler))
        return
    result = _receive_write(reader, handler, key, nbytes, meta, timeout, receive_s)
    if isinstance(result, Exception):
        _reply_error(writer, result)
    else:
        writer.send(Op.OK, {"receipt": result})


def _serve_write_many(reader, writer, handler, body, payload_len: int, receive_s: float | None) -> None:
    """Several writes in one request, each received as :func:`_serve_write` would; one reply of every result
    (the full-arena rule of :mod:`gputq.transport.write_batches`)."""
    try:
        timeout = body.get("timeout")
        items = write_items(body.get("items"), timeout)
        announced = sum(nbytes for _, nbytes, _ in items)
        if announced != payload_len:
            raise InvalidInputError(f"WRITE_MANY announces {announced} bytes but carries {payload_len}")
    except Exception as exc:
        reader.drain(payload_len)
        _reply_error(writer, typed_error(exc, handler))
        return
    full, results = FullArena(handler, timeout), []
    for key, nbytes, meta in items:
        result = full.refusal(key, nbytes)
        if result is None:
            result = _receive_write(reader, handler, key, nbytes, meta, full.left(), receive_s)
            full.saw(result)
        else:
            reader.drain(nbytes)
        results.append({"error": error_to_wire(result)} if isinstance(result, Exception) else {"receipt": result})
    writer.send(Op.OK, {"results": results})


def _coalesce(arena: memoryview, regions: np.ndarray) -> list[memoryview]:
    # Regions laid out back to back in the arena go out in one sendall.
    spans: list[list[int]] = []
    for offset, nbytes in regions.tolist():
        if nbytes == 0:
            continue
        if spans and spans[-1][0] + spans[-1][1] == offset:
            spans[-1][1] += nbytes
        else:
            spans.append([offset, nbytes])
    return [arena[off:off + n] for off, n in spans]


def _serve_read(writer, handler, body, max_frame_bytes: int) -> None:
    try:
        keys = _list_of(body.get("keys"), str, "keys")
        # expires=False: the server ends it in `finally`, so the handler's lease timeout
        # cannot cut a slow send short and free the region under it.
        lease_id, regions = lease_array(handler, keys, _generations(body.get("generations"), len(keys)),
                                        _incarnation(body.get("incarnation")), expires=False,
                                        spans=body.get("spans"))
    except Exception as exc:
        _reply_error(writer, typed_error(exc, handler))
        return
    # Held until the last byte is in the kernel's send buffer or the send
    # deadline closed the connection: the region cannot be reused mid-send.
    try:
        lengths = regions[:, 1].tolist()
        total = sum(lengths)
        if total > max_frame_bytes:
            _reply_error(writer, RequestTooLargeError(
                f"read of {len(keys)} keys is {total} bytes, over max_frame_bytes={max_frame_bytes}; split it"))
            return
        writer.send(Op.OK, {"lengths": lengths}, _coalesce(byte_view(handler.arena), regions))
    finally:
        handler.end_lease(lease_id)


def _serve_call(writer, handler, body) -> None:
    method, args = body.get("method"), body.get("args") or {}
    try:
        if not isinstance(method, str) or not isinstance(args, dict):
            raise InvalidInputError("CALL needs method (str) and args (map)")
        result = _generic_call(handler, method, args)
        if result is NotImplemented:
            result = handler.control(method, args)
    except Exception as exc:
        _reply_error(writer, typed_error(exc, handler))
        return
    try:
        writer.send(Op.OK, {"result": result})
    except (TypeError, ValueError, OverflowError) as exc:  # result not msgpack-able; nothing was sent
        _reply_error(writer, InvalidInputError(f"control {method!r} returned an unserialisable result: {exc}"))


def _linger(sock) -> None:
    # Closing with unread input makes the kernel send RST, which can destroy
    # the ERROR reply before the client reads it: stop sending, then swallow
    # what the client still sends, briefly and boundedly.
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline = Deadline(_LINGER_S)
        scratch, budget = bytearray(1 << 16), _LINGER_BYTES
        while budget > 0:
            sock.settimeout(deadline.remaining())
            n = sock.recv_into(scratch)
            if n == 0:
                return
            budget -= n
    except (OSError, GputqTimeoutError):
        pass


def serve_connection(sock, handler: ArenaHandler, limits: ServerLimits) -> None:
    """Serve one authenticated connection until it closes, then close ``sock``.

    Sends the HELLO reply (``unit``, ``incarnation``) first. A protocol
    violation (bad magic or version, a frame over ``limits.max_frame_bytes``,
    truncated frame, malformed msgpack) is answered with a best-effort ERROR
    frame and ends this connection only; so does a reply not sent within
    ``limits.send_timeout_s``, and a write payload not received within
    :func:`~gputq.transport.base.write_window` of the handler's
    ``reservation_timeout_s`` (and ``send_timeout_s``): its reservation is
    then aborted, before it could expire. A request with malformed fields,
    and any error raised by ``handler``, gets a typed ERROR reply and the
    connection goes on.

    Raises
    ------
    InvalidInputError
        ``handler`` is not an :class:`~gputq.transport.base.ArenaHandler`
        (``sock`` is left open).
    """
    check_handler(handler)
    max_frame_bytes = limits.max_frame_bytes
    reader = FrameReader(sock, max_frame_bytes)
    writer = FrameWriter(sock, frame_timeout=limits.send_timeout_s)
    receive_s = write_window(handler.reservation_timeout_s, limits.send_timeout_s)
    try:
        sock.settimeout(None)
        writer.send(Op.OK, {"unit": handler.name, "incarnation": handler.incarnation})
        while True:
            try:
                header = reader.read_header()
            except PeerLostError:
                return  # closed between frames: a normal goodbye
            body = reader.read_body(header)
            if header.opcode == Op.WRITE:
                _serve_write(reader, writer, handler, body, header.payload_len, receive_s)
                continue
            if header.opcode == Op.WRITE_MANY:
                _serve_write_many(reader, writer, handler, body, header.payload_len, receive_s)
                continue
            if header.payload_len:
                raise ProtocolError(f"opcode {header.opcode} carries no payload")
            if header.opcode == Op.READ:
                _serve_read(writer, handler, body, max_frame_bytes)
            elif header.opcode == Op.CALL:
                _serve_call(writer, handler, body)
            else:
                raise ProtocolError(f"unexpected opcode {header.opcode} from a client")
    except ProtocolError as exc:
        log.warning("unit %s: closing connection: %s", handler.name, exc)
        with contextlib.suppress(GputqError):
            _reply_error(writer, exc)
        _linger(sock)
    except GputqTimeoutError as exc:
        log.warning("unit %s: closing a connection whose peer stalled: %s", handler.name, exc)
    except PeerLostError as exc:
        log.debug("unit %s: connection ended: %s", handler.name, exc)
    finally:
        with contextlib.suppress(OSError):
            sock.close()


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
            hs.draining = _LINGER_BYTES
            hs.deadline = min(hs.deadline, time.monotonic() + _LINGER_S)

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
