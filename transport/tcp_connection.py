"""Serving one authenticated tcp connection: its requests, the leases its reads are sent under, its writes.

A read is sent under a lease the server holds itself (``expires=False``: it
never expires while the server sends) and under ``send_timeout_s``: a client
that stops reading loses its connection, and only then does the lease end,
so every byte it was sent is the key's. A write is received straight into
its reserved region under a deadline strictly shorter than the handler's
reservation timeout (:func:`~gputq.transport.handler.write_window`): a client that
stalls mid-payload loses its connection and its reservation is aborted
while it still holds, so no byte of it lands in a region that expired and
went to another key. Every connection also answers the one-sided readers'
control calls (``lease``, ``end_lease``, ``arena_file``) in front of the
handler's own. Malformed requests get typed errors
(:class:`~gputq.errors.InvalidInputError`) and the connection goes on;
framing violations (:class:`~gputq.errors.ProtocolError`) close it.
"""

from __future__ import annotations

import contextlib
import logging
import socket

import numpy as np

from gputq.errors import (
    GputqError,
    GputqTimeoutError,
    InvalidInputError,
    PeerLostError,
    ProtocolError,
    RequestTooLargeError,
)
from gputq.transport.base import byte_view
from gputq.transport.handler import ArenaHandler, ServerLimits, check_handler, write_window
from gputq.transport.one_sided import ARENA_FILE, END_LEASE, LEASE
from gputq.transport.spans import spans_from_wire
from gputq.transport.wire import (
    Deadline,
    FrameReader,
    FrameWriter,
    Op,
    error_to_wire,
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
    "LINGER_S",
    "LINGER_BYTES",
    "serve_connection",
    "lease_array",
    "tune_socket",
]

log = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 4 << 20
#: The most keys (or lease ids) one request may name.
MAX_REQUEST_ITEMS = 1 << 16
#: How long, and for how many bytes, a connection closed on an error goes on reading what the peer
#: still sends, so that the error reply reaches it instead of a reset.
LINGER_S = 0.5
LINGER_BYTES = 4 << 20
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
        deadline = Deadline(LINGER_S)
        scratch, budget = bytearray(1 << 16), LINGER_BYTES
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
    :func:`~gputq.transport.handler.write_window` of the handler's
    ``reservation_timeout_s`` (and ``send_timeout_s``): its reservation is
    then aborted, before it could expire. A request with malformed fields,
    and any error raised by ``handler``, gets a typed ERROR reply and the
    connection goes on.

    Raises
    ------
    InvalidInputError
        ``handler`` is not an :class:`~gputq.transport.handler.ArenaHandler`
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
