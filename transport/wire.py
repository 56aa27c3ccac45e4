"""The tcp backend's framing: headers, msgpack bodies and raw payloads.

A frame is a fixed 20-byte header, a msgpack body (control data) and
optional raw payload bytes::

    magic "GPTQ" | version u8 | opcode u8 | 2 pad | body length u32 | payload length u64

All integers are big-endian. Bodies are bounded by :data:`MAX_BODY_BYTES`
(:data:`PRE_AUTH_BODY_BYTES` before the peer authenticated), payloads by the
``max_payload`` a :class:`FrameReader` is built with, so a corrupt or hostile
length can never make a peer allocate or wait for more than it agreed to.

:class:`FrameReader` and :class:`FrameWriter` work over any socket-like
object (``sendall``, ``recv_into``, ``recv``, ``settimeout``, ``close``), so
tests can drive them with in-memory sockets. They translate socket failures
into the gputq error tree: a socket timeout becomes
:class:`~gputq.errors.GputqTimeoutError`, a reset or closed peer
:class:`~gputq.errors.PeerLostError`, a malformed frame
:class:`~gputq.errors.ProtocolError`.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from dataclasses import dataclass
from typing import Iterable

import msgpack

from gputq.errors import GputqError, GputqTimeoutError, PeerLostError, ProtocolError, RequestTooLargeError
from gputq.transport.base import byte_view

__all__ = [
    "MAGIC",
    "VERSION",
    "HEADER",
    "error_to_wire",
    "error_from_wire",
    "MAX_BODY_BYTES",
    "MAX_WRITE_ITEMS",
    "PRE_AUTH_BODY_BYTES",
    "Op",
    "Header",
    "Deadline",
    "encode_header",
    "decode_header",
    "pack_body",
    "unpack_body",
    "FrameReader",
    "FrameWriter",
]

MAGIC = b"GPTQ"
VERSION = 1
HEADER = struct.Struct("!4sBBxxIQ")
MAX_BODY_BYTES = 1 << 20
#: The largest body a server reads before the HELLO authenticated its peer
#: (a HELLO carries a token, nothing more; before it, no payload at all).
PRE_AUTH_BODY_BYTES = 4 << 10
#: The most writes one WRITE_MANY frame carries: its body and its reply stay far inside MAX_BODY_BYTES.
MAX_WRITE_ITEMS = 1024

# Below this size a payload is joined to its header in one send: one syscall
# instead of two, and no small-packet round trip with TCP_NODELAY.
_COALESCE_BYTES = 64 << 10
#: Buffers per sendmsg: Linux's IOV_MAX.
_IOV_BATCH = 1024
_DRAIN_CHUNK = 1 << 20


class Op:
    """Frame opcodes. Requests come from clients, replies from servers."""

    HELLO = 1
    WRITE = 2
    READ = 3
    CALL = 4
    #: Several writes in one frame: ``items`` of ``[key, nbytes, meta]`` and their payloads back to back;
    #: the reply's ``results`` hold each one's ``receipt`` or ``error``, in order.
    WRITE_MANY = 5
    OK = 16
    ERROR = 17

    ALL = frozenset({HELLO, WRITE, READ, CALL, WRITE_MANY, OK, ERROR})


@dataclass(frozen=True)
class Header:
    """A decoded frame header."""

    opcode: int
    body_len: int
    payload_len: int


def encode_header(opcode: int, body_len: int, payload_len: int) -> bytes:
    """Return the 20-byte header of a frame."""
    return HEADER.pack(MAGIC, VERSION, opcode, body_len, payload_len)


def decode_header(raw, max_payload: int, max_body: int = MAX_BODY_BYTES) -> Header:
    """Parse and validate a header.

    Raises
    ------
    ProtocolError
        Bad magic or version, unknown opcode, a body longer than
        ``max_body`` or a payload longer than ``max_payload``.
    """
    magic, version, opcode, body_len, payload_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise ProtocolError(f"unsupported wire version {version} (this side speaks {VERSION})")
    if opcode not in Op.ALL:
        raise ProtocolError(f"unknown opcode {opcode}")
    if body_len > max_body:
        raise ProtocolError(f"frame body of {body_len} bytes exceeds the {max_body}-byte limit")
    if payload_len > max_payload:
        raise ProtocolError(f"frame payload of {payload_len} bytes exceeds max_frame_bytes={max_payload}")
    return Header(opcode, body_len, payload_len)


def pack_body(body: dict) -> bytes:
    """Serialise a control body (raises ``TypeError`` for non-msgpack values)."""
    return msgpack.packb(body, use_bin_type=True)


def unpack_body(raw) -> dict:
    """Deserialise a control body; anything but a msgpack map is a ``ProtocolError``."""
    try:
        body = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"malformed frame body: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"frame body is a {type(body).__name__}, expected a map")
    return body


class Deadline:
    """An absolute expiry shared by the reader and writer of one request."""

    __slots__ = ("expires",)

    def __init__(self, timeout: float):
        self.expires = time.monotonic() + timeout

    def remaining(self) -> float:
        """Seconds left; raises ``GputqTimeoutError`` once expired."""
        left = self.expires - time.monotonic()
        if left <= 0:
            raise GputqTimeoutError("timed out")
        return left


def _arm(sock, deadline: Deadline | None) -> None:
    if deadline is not None:
        sock.settimeout(deadline.remaining())


class FrameReader:
    """Reads frames from a socket-like object.

    Parameters
    ----------
    sock
        Anything with ``recv_into`` and ``settimeout``.
    max_payload
        The largest payload length accepted in a header.
    truncated_error
        What a connection closed inside a frame raises: a server treats it
        as a protocol violation, a client as a lost peer.

    Attributes
    ----------
    deadline
        When set, every receive is bounded by it.
    """

    def __init__(self, sock, max_payload: int, truncated_error: type[Exception] = ProtocolError):
        self._sock = sock
        self.max_payload = int(max_payload)
        self.truncated_error = truncated_error
        self.deadline: Deadline | None = None
        self._header = bytearray(HEADER.size)
        self._scratch: bytearray | None = None

    def _recv_into(self, view: memoryview) -> int:
        _arm(self._sock, self.deadline)
        try:
            return self._sock.recv_into(view)
        except (socket.timeout, TimeoutError):
            raise GputqTimeoutError("timed out waiting for the peer") from None
        except OSError as exc:
            raise PeerLostError(f"connection lost: {exc}") from None

    @contextlib.contextmanager
    def bounded(self, timeout: float | None):
        """Bound every receive in the block by one deadline ``timeout`` seconds away (None: unbounded).

        The socket is left blocking without a timeout afterwards.
        """
        if timeout is None:
            yield
            return
        self.deadline = Deadline(timeout)
        try:
            yield
        finally:
            self.deadline = None
            with contextlib.suppress(OSError):
                self._sock.settimeout(None)

    def recv_exact(self, view) -> None:
        """Fill ``view`` (a writable byte memoryview) completely."""
        view = memoryview(view)
        got, want = 0, view.nbytes
        while got < want:
            n = self._recv_into(view[got:])
            if n == 0:
                raise self.truncated_error(f"truncated frame: connection closed after {got} of {want} bytes")
            got += n

    def drain(self, nbytes: int) -> None:
        """Receive and discard ``nbytes`` so the stream stays in sync."""
        if self._scratch is None:
            self._scratch = bytearray(_DRAIN_CHUNK)
        scratch = memoryview(self._scratch)
        while nbytes > 0:
            step = min(nbytes, len(scratch))
            self.recv_exact(scratch[:step])
            nbytes -= step

    def read_header(self) -> Header:
        """Read the next header.

        Raises ``PeerLostError`` when the peer closed cleanly between frames
        and ``truncated_error`` when it closed inside the header.
        """
        view = memoryview(self._header)
        n = self._recv_into(view)
        if n == 0:
            raise PeerLostError("connection closed by peer")
        if n < HEADER.size:
            self.recv_exact(view[n:])
        return decode_header(self._header, self.max_payload)

    def read_body(self, header: Header) -> dict:
        """Read and decode the body that follows ``header``."""
        raw = bytearray(header.body_len)
        self.recv_exact(raw)
        return unpack_body(raw)

    def read_frame(self) -> tuple[Header, dict]:
        """Read a header and its body; the payload is left for the caller."""
        header = self.read_header()
        return header, self.read_body(header)


class FrameWriter:
    """Writes frames to a socket-like object (``sendall``, ``settimeout``).

    Parameters
    ----------
    sock
        Anything with ``sendall`` and ``settimeout``.
    frame_timeout
        When set, each frame must be sent within this many seconds (a
        server's send deadline: a peer that stops reading cannot hold it).

    Attributes
    ----------
    deadline
        When set, every send is bounded by it.
    """

    def __init__(self, sock, frame_timeout: float | None = None):
        self._sock = sock
        self.frame_timeout = frame_timeout
        self.deadline: Deadline | None = None

    def _sendall(self, data) -> None:
        _arm(self._sock, self.deadline)
        try:
            self._sock.sendall(data)
        except (socket.timeout, TimeoutError):
            raise GputqTimeoutError("timed out sending to the peer") from None
        except OSError as exc:
            raise PeerLostError(f"connection lost: {exc}") from None

    def send(self, opcode: int, body: dict, payloads: Iterable = ()) -> None:
        """Send one frame; ``payloads`` are byte buffers sent back to back, uncopied.

        The body is serialised before anything is sent, so a body that
        cannot be packed raises ``TypeError`` with the stream still in sync.
        """
        raw = pack_body(body)
        if len(raw) > MAX_BODY_BYTES:  # the peer would drop the connection: refuse here, in sync
            raise RequestTooLargeError(f"control body of {len(raw)} bytes exceeds {MAX_BODY_BYTES}; "
                                       f"split the request (e.g. fewer keys per read)")
        views = [byte_view(p) for p in payloads]
        if self.frame_timeout is None:
            self._send_frame(opcode, raw, views)
            return
        self.deadline = Deadline(self.frame_timeout)
        try:
            self._send_frame(opcode, raw, views)
        finally:
            self.deadline = None
            with contextlib.suppress(OSError):  # the next receive waits for the peer, unbounded
                self._sock.settimeout(None)

    def _send_frame(self, opcode: int, raw: bytes, views: list) -> None:
        total = sum(v.nbytes for v in views)
        head = encode_header(opcode, len(raw), total) + raw
        if total <= _COALESCE_BYTES:
            self._sendall(b"".join([head, *views]))
            return
        self._send_views([memoryview(head), *views])

    def _send_views(self, views: list) -> None:
        """Send ``views`` back to back, up to :data:`_IOV_BATCH` of them per ``sendmsg``.

        A read of a rank's slice is one span per layer and token chunk:
        gathering them in one system call costs what one span does.
        """
        views = [v for v in views if v.nbytes]  # byte views (send made them so)
        first = 0
        while first < len(views):
            _arm(self._sock, self.deadline)
            try:
                sent = self._sock.sendmsg(views[first:first + _IOV_BATCH])
            except (socket.timeout, TimeoutError):
                raise GputqTimeoutError("timed out sending to the peer") from None
            except OSError as exc:
                raise PeerLostError(f"connection lost: {exc}") from None
            while sent and first < len(views):
                size = views[first].nbytes
                if sent >= size:
                    sent -= size
                    first += 1
                else:
                    views[first] = views[first][sent:]
                    sent = 0


# -- errors in ERROR frames ------------------------------------------------------------

def _registry() -> dict[str, type[GputqError]]:
    found: dict[str, type[GputqError]] = {}
    stack = [GputqError]
    while stack:
        cls = stack.pop()
        found[cls.__name__] = cls
        stack.extend(cls.__subclasses__())
    return found


def error_to_wire(exc: BaseException) -> dict:
    """Describe ``exc`` for a peer: its class name (if a gputq error) and message."""
    name = type(exc).__name__ if isinstance(exc, GputqError) else "GputqError"
    message = str(exc) if isinstance(exc, GputqError) else f"{type(exc).__name__}: {exc}"
    return {"error": name, "message": message}


def error_from_wire(payload: dict) -> GputqError:
    """Rebuild the exception a peer described with :func:`error_to_wire`.

    Names of classes this process does not know (a newer peer) fall back
    to :class:`GputqError`.
    """
    cls = _registry().get(payload.get("error", ""), GputqError)
    return cls(payload.get("message", ""))
