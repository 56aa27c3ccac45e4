"""Framing tests over fake sockets, and a real server surviving bad clients."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from tests.transport.fakes import DictArenaHandler, FakeSocket
from transport.errors import (
    AuthenticationError,
    GputqTimeoutError,
    InvalidInputError,
    PeerLostError,
    ProtocolError,
)
from transport.tcp import TcpTransport, serve_connection
from transport.wire import (
    HEADER,
    MAGIC,
    MAX_BODY_BYTES,
    VERSION,
    Deadline,
    FrameReader,
    FrameWriter,
    Op,
    byte_view,
    decode_header,
    encode_header,
    pack_body,
    unpack_body,
)

TOKEN = "secret-token"
MAX = 1 << 20


def frame(opcode: int, body: dict, payload: bytes = b"", *, magic=MAGIC, version=VERSION,
          payload_len: int | None = None) -> bytes:
    raw = pack_body(body)
    length = len(payload) if payload_len is None else payload_len
    return HEADER.pack(magic, version, opcode, len(raw), length) + raw + payload


def hello(token: str = TOKEN) -> bytes:
    return frame(Op.HELLO, {"token": token})


def replies(data: bytes) -> list[tuple[int, dict]]:
    """Decode every frame the server sent (replies carry no payload here except READ)."""
    sock = FakeSocket()
    sock.load(data)
    sock.feed_eof()
    reader = FrameReader(sock, MAX)
    out = []
    while True:
        try:
            header, body = reader.read_frame()
        except PeerLostError:
            return out
        reader.drain(header.payload_len)
        out.append((header.opcode, body))


def run_server_on(data: bytes, handler=None) -> tuple[FakeSocket, list[tuple[int, dict]]]:
    """Feed crafted client bytes to serve_connection; return the server socket and its replies."""
    sock = FakeSocket()
    sock.load(data)
    sock.feed_eof()
    serve_connection(sock, handler or DictArenaHandler(1 << 16), TOKEN, MAX)
    return sock, replies(bytes(sock.sent))


# ------------------------------------------------------------------ pure functions

def test_header_round_trip():
    raw = encode_header(Op.WRITE, 123, 1 << 40)
    assert len(raw) == HEADER.size == 20
    header = decode_header(raw, 1 << 41)
    assert (header.opcode, header.body_len, header.payload_len) == (Op.WRITE, 123, 1 << 40)


@pytest.mark.parametrize("raw, match", [
    (HEADER.pack(b"XXXX", VERSION, Op.READ, 1, 0), "magic"),
    (HEADER.pack(MAGIC, VERSION + 1, Op.READ, 1, 0), "version"),
    (HEADER.pack(MAGIC, VERSION, 99, 1, 0), "opcode"),
    (HEADER.pack(MAGIC, VERSION, Op.READ, MAX_BODY_BYTES + 1, 0), "body"),
    (HEADER.pack(MAGIC, VERSION, Op.WRITE, 1, MAX + 1), "max_frame_bytes"),
])
def test_decode_header_rejects(raw, match):
    with pytest.raises(ProtocolError, match=match):
        decode_header(raw, MAX)


def test_body_round_trip_and_malformed():
    body = {"key": "k", "nbytes": 5, "meta": {"a": [1, 2.5, None]}, "blob": b"\x00\xff"}
    assert unpack_body(pack_body(body)) == body
    with pytest.raises(ProtocolError, match="map"):
        unpack_body(pack_body([1, 2]))
    with pytest.raises(ProtocolError, match="malformed"):
        unpack_body(b"\xc1")


def test_byte_view():
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)
    view = byte_view(arr)
    assert view.format == "B" and view.nbytes == 48
    with pytest.raises(InvalidInputError, match="contiguous"):
        byte_view(arr[:, ::2])
    with pytest.raises(InvalidInputError, match="read-only"):
        byte_view(b"abc", writable=True)
    with pytest.raises(InvalidInputError, match="bytes-like"):
        byte_view(42)


# ------------------------------------------------------------------ reader / writer

@pytest.mark.parametrize("sizes", [[], [0], [7], [100, 3], [200_000, 1, 70_000]])
def test_frame_round_trip(sizes):
    a, b = FakeSocket.pair()
    rng = np.random.default_rng(len(sizes))
    payloads = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    FrameWriter(a).send(Op.OK, {"lengths": sizes}, payloads)
    reader = FrameReader(b, MAX)
    header, body = reader.read_frame()
    assert header.opcode == Op.OK and body == {"lengths": sizes}
    assert header.payload_len == sum(sizes)
    got = bytearray(header.payload_len)
    reader.recv_exact(got)
    assert bytes(got) == b"".join(p.tobytes() for p in payloads)


def test_eof_between_frames_is_peer_lost():
    a, b = FakeSocket.pair()
    a.close()
    with pytest.raises(PeerLostError, match="closed"):
        FrameReader(b, MAX).read_header()


def test_truncated_header_and_body():
    sock = FakeSocket()
    sock.load(hello()[:7])
    sock.feed_eof()
    with pytest.raises(ProtocolError, match="truncated"):
        FrameReader(sock, MAX).read_header()
    sock = FakeSocket()
    sock.load(hello()[:-2])
    sock.feed_eof()
    with pytest.raises(PeerLostError, match="truncated"):  # the client's flavour
        FrameReader(sock, MAX, truncated_error=PeerLostError).read_frame()


def test_reader_deadline_times_out():
    a, b = FakeSocket.pair()
    reader = FrameReader(b, MAX)
    reader.deadline = Deadline(0.05)
    with pytest.raises(GputqTimeoutError):
        reader.read_header()


def test_writer_maps_closed_peer():
    a, b = FakeSocket.pair()
    b.close()
    with pytest.raises(PeerLostError):
        FrameWriter(a).send(Op.CALL, {"method": "stats"})


def test_unpackable_body_sends_nothing():
    a, b = FakeSocket.pair()
    with pytest.raises(TypeError):
        FrameWriter(a).send(Op.OK, {"result": object()})
    assert a.sent == b""


# ------------------------------------------------------------------ server connection over fakes

def test_serve_connection_good_session():
    handler = DictArenaHandler(1 << 16)
    data = (hello() + frame(Op.WRITE, {"key": "k", "nbytes": 5, "meta": {}}, b"hello")
            + frame(Op.READ, {"keys": ["k"]}) + frame(Op.CALL, {"method": "stats", "args": {}}))
    sock, out = run_server_on(data, handler)
    assert sock.closed
    assert [op for op, _ in out] == [Op.OK] * 4
    assert out[0][1] == {"unit": "unit-0"}
    assert out[1][1]["receipt"]["nbytes"] == 5
    assert out[2][1] == {"lengths": [5]}
    assert bytes(sock.sent).endswith(frame(Op.OK, {"result": handler.control("stats", {})}))
    assert bytes(handler.arena[:5]) == b"hello"


@pytest.mark.parametrize("data, error", [
    (hello("wrong"), "AuthenticationError"),
    (frame(Op.READ, {"keys": []}), "AuthenticationError"),  # no HELLO first
    (frame(Op.HELLO, {}), "AuthenticationError"),  # missing token
    (hello()[:-3], "ProtocolError"),  # truncated
    (hello().replace(MAGIC, b"HTTP", 1), "ProtocolError"),
    (hello() + frame(Op.WRITE, {"key": "k", "nbytes": MAX + 1}, payload_len=MAX + 1), "ProtocolError"),
    (hello() + frame(Op.READ, {"keys": []}, version=VERSION + 1), "ProtocolError"),
    (hello() + frame(Op.OK, {}), "ProtocolError"),  # a reply opcode from a client
])
def test_serve_connection_closes_on_bad_input(data, error):
    sock, out = run_server_on(data)
    assert sock.closed
    assert out[-1][0] == Op.ERROR and out[-1][1]["error"] == error


def test_truncated_write_payload_aborts_reservation():
    handler = DictArenaHandler(1 << 16)
    data = hello() + frame(Op.WRITE, {"key": "k", "nbytes": 100, "meta": {}}, b"x" * 40, payload_len=100)
    sock, out = run_server_on(data, handler)
    assert sock.closed
    assert out[-1][1]["error"] == "ProtocolError"
    assert handler.calls.get("abort_write") == 1 and handler.calls.get("commit_write") is None
    assert handler.used_bytes() == 0
    assert handler.control("stats", {})["pending"] == 0


def test_failed_begin_write_drains_payload_and_keeps_serving():
    handler = DictArenaHandler(64)
    data = (hello() + frame(Op.WRITE, {"key": "big", "nbytes": 100, "meta": {}}, b"y" * 100)
            + frame(Op.WRITE, {"key": "ok", "nbytes": 3, "meta": {}}, b"abc"))
    sock, out = run_server_on(data, handler)
    assert out[1][0] == Op.ERROR and out[1][1]["error"] == "RequestTooLargeError"
    assert out[2][0] == Op.OK and out[2][1]["receipt"]["key"] == "ok"


# ------------------------------------------------------------------ real server survives bad clients

BAD_CLIENT_BYTES = {
    "truncated": hello()[:-3],
    "oversized": hello() + frame(Op.WRITE, {"key": "k", "nbytes": MAX + 1}, payload_len=MAX + 1),
    "bad_magic": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "wrong_token": hello("nope"),
}


@pytest.fixture
def server():
    handler = DictArenaHandler(1 << 20)
    with TcpTransport().serve(handler, token=TOKEN, max_frame_bytes=MAX) as srv:
        yield srv


def raw_exchange(address: dict, data: bytes) -> bytes:
    """Send crafted bytes, half-close, and return everything until the server closes."""
    with socket.create_connection((address["host"], address["port"]), timeout=5) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("case", sorted(BAD_CLIENT_BYTES))
def test_real_server_survives_bad_client(server, case):
    got = raw_exchange(server.address, BAD_CLIENT_BYTES[case])  # returns only once the server closed
    expected = "AuthenticationError" if case == "wrong_token" else "ProtocolError"
    assert replies(got)[-1][1]["error"] == expected
    with TcpTransport().connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        ch.write("after", b"fine")
        dest = bytearray(4)
        assert ch.read(["after"], dest) == [4] and dest == b"fine"


def test_wrong_token_raises_authentication_error(server):
    with pytest.raises(AuthenticationError):
        TcpTransport().connect(server.address, token="guess", max_frame_bytes=MAX, timeout=5)


def test_bad_client_does_not_disturb_a_live_one(server):
    with TcpTransport().connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        ch.write("k", b"12345")
        done = threading.Event()

        def bad():
            raw_exchange(server.address, BAD_CLIENT_BYTES["oversized"])
            done.set()

        threading.Thread(target=bad, daemon=True).start()
        assert done.wait(5)
        dest = bytearray(5)
        assert ch.read(["k"], dest) == [5] and dest == b"12345"
