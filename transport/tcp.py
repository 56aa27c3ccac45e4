"""The tcp backend: plain sockets, no native dependency.

Writes land directly in the arena: the server reserves the region with
``begin_write`` and receives the payload with ``recv_into`` at that offset.
Reads stream the leased regions with ``sendall`` of arena slices and the
client receives them with ``recv_into`` straight into the caller's buffer
(through a pinned staging ring when that buffer is on a GPU). No payload
byte is copied in Python on either side.

The server runs one daemon thread per connection; a channel keeps a small
pool of connections so concurrent requests from several threads proceed in
parallel. Every connection starts with a HELLO frame carrying the shared
token. See :mod:`transport.wire` for the framing.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
import time
from typing import Any, Sequence

from transport.base import ArenaHandler, Channel, Server, TransportType, byte_view, is_device_buffer
from transport.errors import (
    AuthenticationError,
    ClosedError,
    GputqError,
    GputqTimeoutError,
    InvalidInputError,
    PeerLostError,
    ProtocolError,
    RequestTooLargeError,
    TransferError,
    error_from_wire,
    error_to_wire,
)
from transport.staging import StagingPool, device_nbytes
from transport.wire import Deadline, FrameReader, FrameWriter, Op

__all__ = [
    "SOCKET_BUFFER_BYTES",
    "MAX_CONNECTIONS",
    "TcpTransport",
    "TcpServer",
    "TcpChannel",
    "serve_connection",
]

log = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 4 << 20
MAX_CONNECTIONS = 8
# A write may wait `timeout` seconds for arena space on the server; its
# reply (CapacityError included) needs a little longer to come back.
_REPLY_GRACE_S = 5.0
_ACCEPT_POLL_S = 0.1
_ACCEPT_RETRY_S = 0.05
# A client must authenticate this soon after connecting, or its connection thread ends.
_HANDSHAKE_S = 10.0
_JOIN_S = 5.0
_LINGER_S = 0.5
_LINGER_BYTES = 4 << 20


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def _body_field(body: dict, name: str, kind):
    value = body.get(name)
    if not isinstance(value, kind):
        raise ProtocolError(f"frame body field {name!r} missing or mistyped")
    return value


# ---------------------------------------------------------------- server side

def _reply_error(writer: FrameWriter, exc: BaseException) -> None:
    writer.send(Op.ERROR, error_to_wire(exc))


def _handshake(reader: FrameReader, writer: FrameWriter, handler: ArenaHandler, token: str) -> bool:
    header, body = reader.read_frame()
    offered = body.get("token") if header.opcode == Op.HELLO else None
    if header.opcode != Op.HELLO or not isinstance(offered, str) or not hmac.compare_digest(
            offered.encode(), token.encode()):
        _reply_error(writer, AuthenticationError(f"tcp handshake refused by unit {handler.name}"))
        return False
    if header.payload_len:
        raise ProtocolError("HELLO carries no payload")
    writer.send(Op.OK, {"unit": handler.name})
    return True


def _serve_write(reader, writer, handler, body, payload_len: int) -> None:
    key = _body_field(body, "key", str)
    nbytes = _body_field(body, "nbytes", int)
    meta = body.get("meta") or {}
    timeout = body.get("timeout")
    if nbytes != payload_len:
        raise ProtocolError(f"WRITE of {key!r} announces {nbytes} bytes but carries {payload_len}")
    try:
        offset = handler.begin_write(key, nbytes, meta, timeout)
        arena = byte_view(handler.arena)
        if offset < 0 or offset + nbytes > arena.nbytes:
            handler.abort_write(key)
            raise TransferError(f"unit {handler.name} reserved [{offset}, {offset + nbytes}) outside its arena",
                                handler.name, (key,))
    except Exception as exc:
        reader.drain(nbytes)
        _reply_error(writer, exc)
        return
    try:
        reader.recv_exact(arena[offset:offset + nbytes])
    except BaseException:
        handler.abort_write(key)
        raise
    try:
        receipt = handler.commit_write(key)
    except Exception as exc:
        _reply_error(writer, exc)
        return
    writer.send(Op.OK, {"receipt": receipt})


def _coalesce(arena: memoryview, regions) -> list[memoryview]:
    # Regions laid out back to back in the arena go out in one sendall.
    spans: list[list[int]] = []
    for region in regions:
        if region.nbytes == 0:
            continue
        if spans and spans[-1][0] + spans[-1][1] == region.offset:
            spans[-1][1] += region.nbytes
        else:
            spans.append([region.offset, region.nbytes])
    return [arena[off:off + n] for off, n in spans]


def _serve_read(writer, handler, body, max_frame_bytes: int) -> None:
    keys = _body_field(body, "keys", list)
    try:
        lease = handler.lease(keys)
    except Exception as exc:
        _reply_error(writer, exc)
        return
    try:
        lengths = [region.nbytes for region in lease.regions]
        total = sum(lengths)
        if total > max_frame_bytes:
            _reply_error(writer, RequestTooLargeError(
                f"read of {len(keys)} keys is {total} bytes, over max_frame_bytes={max_frame_bytes}; split it"))
            return
        writer.send(Op.OK, {"lengths": lengths}, _coalesce(byte_view(handler.arena), lease.regions))
    finally:
        handler.end_lease(lease.lease_id)


def _serve_call(writer, handler, body) -> None:
    method = _body_field(body, "method", str)
    args = body.get("args") or {}
    try:
        result = handler.control(method, args)
    except Exception as exc:
        _reply_error(writer, exc)
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


def serve_connection(sock, handler: ArenaHandler, token: str, max_frame_bytes: int) -> None:
    """Serve one client connection until it closes, then close ``sock``.

    A protocol violation (bad magic or version, oversized or truncated
    frame, malformed body) or a failed handshake is answered with a
    best-effort ERROR frame and ends this connection only. Errors raised by
    ``handler`` are sent back as ERROR replies and the connection goes on.
    """
    reader = FrameReader(sock, max_frame_bytes)
    writer = FrameWriter(sock)
    try:
        sock.settimeout(_HANDSHAKE_S)
        if not _handshake(reader, writer, handler, token):
            return
        sock.settimeout(None)
        while True:
            try:
                header = reader.read_header()
            except PeerLostError:
                return  # closed between frames: a normal goodbye
            body = reader.read_body(header)
            if header.opcode == Op.WRITE:
                _serve_write(reader, writer, handler, body, header.payload_len)
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
    except (PeerLostError, GputqTimeoutError) as exc:
        log.debug("unit %s: connection ended: %s", handler.name, exc)
    finally:
        with contextlib.suppress(OSError):
            sock.close()


class TcpServer(Server):
    """Serves one arena over tcp: an accept thread plus one thread per connection.

    Build it with :meth:`TcpTransport.serve`.
    """

    def __init__(self, handler: ArenaHandler, host: str, port: int, token: str, max_frame_bytes: int):
        self._handler = handler
        self._token = token
        self._max_frame_bytes = int(max_frame_bytes)
        self._lock = threading.Lock()
        self._closed = False
        self._conns: dict[socket.socket, threading.Thread] = {}
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.settimeout(_ACCEPT_POLL_S)  # lets the accept loop notice close()
        self._host = host
        self._port = self._listener.getsockname()[1]
        self._accepter = threading.Thread(target=self._accept_loop, name=f"gputq-tcp-accept-{handler.name}",
                                          daemon=True)
        self._accepter.start()

    @property
    def address(self) -> dict:
        return {"transport": "tcp", "host": self._host, "port": self._port}

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError as exc:
                if self._closed:
                    return  # listener closed
                # EMFILE, ENFILE, ECONNABORTED: transient; keep serving.
                log.warning("unit %s: accept failed: %s", self._handler.name, exc)
                time.sleep(_ACCEPT_RETRY_S)
                continue
            sock.settimeout(None)
            _tune(sock)
            thread = threading.Thread(target=self._run, args=(sock,), daemon=True,
                                      name=f"gputq-tcp-conn-{self._handler.name}")
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns[sock] = thread
            thread.start()

    def _run(self, sock: socket.socket) -> None:
        try:
            serve_connection(sock, self._handler, self._token, self._max_frame_bytes)
        except Exception:  # a handler bug must not go unnoticed, nor kill the server
            log.exception("unit %s: connection thread failed", self._handler.name)
            with contextlib.suppress(OSError):
                sock.close()
        finally:
            with self._lock:
                self._conns.pop(sock, None)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = dict(self._conns)
        self._listener.close()
        self._accepter.join(_JOIN_S)
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv
        for thread in conns.values():
            thread.join(_JOIN_S)


# ---------------------------------------------------------------- client side

class _Connection:
    """One authenticated client socket; used by one request at a time."""

    def __init__(self, address: tuple[str, int], token: str, max_frame_bytes: int, timeout: float | None):
        try:
            self.sock = socket.create_connection(address, timeout=timeout)
        except (socket.timeout, TimeoutError):
            raise GputqTimeoutError(f"timed out connecting to {address[0]}:{address[1]}") from None
        except OSError as exc:
            raise PeerLostError(f"cannot connect to {address[0]}:{address[1]}: {exc}") from None
        try:
            _tune(self.sock)
            self.reader = FrameReader(self.sock, max_frame_bytes, truncated_error=PeerLostError)
            self.writer = FrameWriter(self.sock)
            self.in_sync = True
            self.begin(timeout)
            self.writer.send(Op.HELLO, {"token": token})
            self.unit = self.reply()["unit"]
        except BaseException:
            self.close()
            raise

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


class TcpChannel(Channel):
    """A thread-safe client of one unit over a small pool of connections.

    Build it with :meth:`TcpTransport.connect`. A connection serves one
    request at a time; a request finding all of them busy opens another, up
    to ``max_connections``, then waits. A connection whose request failed
    mid-frame (timeout, lost peer, protocol error) is discarded; one whose
    request ended with a typed error from the unit is reused.
    """

    def __init__(self, address: dict, *, token: str, max_frame_bytes: int, timeout: float | None = None,
                 max_connections: int = MAX_CONNECTIONS, staging: StagingPool | None = None):
        if address.get("transport") != "tcp":
            raise InvalidInputError(f"not a tcp address: {address!r}")
        if max_connections < 1:
            raise InvalidInputError("max_connections must be at least 1")
        self._address = (address["host"], int(address["port"]))
        self._token = token
        self._max_frame_bytes = int(max_frame_bytes)
        self._connect_timeout = timeout
        self._max_connections = max_connections
        self._cond = threading.Condition()
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self._nopen = 1
        self._closed = False
        self._staging = staging or StagingPool()
        first = _Connection(self._address, token, self._max_frame_bytes, timeout)
        self.unit = first.unit
        self._idle.append(first)

    @contextlib.contextmanager
    def _lease(self, timeout: float | None):
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = None
        with self._cond:
            while True:
                if self._closed:
                    raise ClosedError(f"tcp channel to {self.unit} is closed")
                if self._idle:
                    conn = self._idle.pop()
                    break
                if self._nopen < self._max_connections:
                    self._nopen += 1  # reserve the slot before connecting outside the lock
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise GputqTimeoutError(f"no free connection to {self.unit} within {timeout} s")
                self._cond.wait(left)
        if conn is None:
            try:
                conn = _Connection(self._address, self._token, self._max_frame_bytes,
                                   self._connect_timeout if timeout is None else timeout)
            except BaseException:
                with self._cond:
                    self._nopen -= 1
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
                    self._nopen -= 1
                    conn.close()
                self._cond.notify()

    def write(self, key: str, payload, meta: dict | None = None, timeout: float | None = None) -> dict:
        view = byte_view(payload)
        if view.nbytes > self._max_frame_bytes:
            raise RequestTooLargeError(
                f"key {key!r}: {view.nbytes} bytes exceed max_frame_bytes={self._max_frame_bytes}")
        body = {"key": key, "nbytes": view.nbytes, "meta": meta or {}, "timeout": timeout}
        with self._lease(None if timeout is None else timeout + _REPLY_GRACE_S) as conn:
            conn.writer.send(Op.WRITE, body, (view,))
            return conn.reply()["receipt"]

    def read(self, keys: Sequence[str], dest, timeout: float | None = None) -> list[int]:
        on_device = is_device_buffer(dest)
        if on_device:
            capacity = device_nbytes(dest)
        else:
            host = byte_view(dest, writable=True)
            capacity = host.nbytes
        with self._lease(timeout) as conn:
            conn.writer.send(Op.READ, {"keys": list(keys)})
            header, body = conn.reply_header()
            lengths = body.get("lengths")
            total = header.payload_len
            if not isinstance(lengths, list) or sum(lengths) != total or len(lengths) != len(keys):
                raise ProtocolError("READ reply lengths do not match its payload")
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

    def call(self, method: str, timeout: float | None = None, **args) -> Any:
        with self._lease(timeout) as conn:
            conn.writer.send(Op.CALL, {"method": method, "args": args})
            return conn.reply()["result"]

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            idle, busy = self._idle, list(self._busy)
            self._idle = []
            self._nopen -= len(idle)
            self._cond.notify_all()
        for conn in idle:
            conn.close()
        for conn in busy:  # the request in flight fails; its thread closes the socket
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        self._staging.close()


class TcpTransport(TransportType):
    """The tcp backend: ``serve`` an arena, ``connect`` a channel to one."""

    name = "tcp"

    def serve(self, handler: ArenaHandler, *, host: str = "127.0.0.1", port: int = 0,
              token: str, max_frame_bytes: int) -> TcpServer:
        return TcpServer(handler, host, port, token, max_frame_bytes)

    def connect(self, address: dict, *, token: str, max_frame_bytes: int,
                timeout: float | None = None) -> TcpChannel:
        return TcpChannel(address, token=token, max_frame_bytes=max_frame_bytes, timeout=timeout)
