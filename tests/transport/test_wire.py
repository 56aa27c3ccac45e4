"""The wire format: golden byte vectors, framing over socket pairs, and a real server facing bad clients.

The golden vectors are literal bytes, written once by hand from the format
(``GPTQ`` | version | opcode | 2 pad | body length u32 | payload length u64,
big-endian, then a msgpack body and the payload). Changing any of them is a
protocol change: bump :data:`gputq.transport.wire.VERSION` and say so.
"""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

from gputq.errors import (
    AuthenticationError,
    DuplicateKeyError,
    GputqTimeoutError,
    InvalidInputError,
    PeerLostError,
    ProtocolError,
    UnknownKeyError,
)
from gputq.transport.handler import ServerLimits
from gputq.transport.tcp import TcpChannel, TcpTransport, serve_connection
from gputq.transport.tcp_server import Handshake
from gputq.transport.wire import (
    HEADER,
    MAGIC,
    MAX_BODY_BYTES,
    PRE_AUTH_BODY_BYTES,
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
from tests.transport.units import make_unit

TOKEN = "secret-token-of-the-wire-tests"
MAX = 1 << 20
LIMITS = ServerLimits(max_frame_bytes=MAX)
INC = "0123456789abcdef"

# name -> (literal frame, opcode, body, payload)
GOLDEN = {
    "hello": ("47505451010100000000000b000000000000000081a5746f6b656ea3746f6b",
              Op.HELLO, {"token": "tok"}, b""),
    "hello_ok": ("475054510110000000000028000000000000000082a4756e6974a473752d30ab696e6361726e6174696f6eb0"
                 "30313233343536373839616263646566",
                 Op.OK, {"unit": "su-0", "incarnation": INC}, b""),
    "write": ("47505451010200000000001e000000000000000384a36b6579a16ba66e627974657303a46d65746180a774696d65"
              "6f7574c0616263",
              Op.WRITE, {"key": "k", "nbytes": 3, "meta": {}, "timeout": None}, b"abc"),
    "write_ok": ("475054510110000000000043000000000000000081a77265636569707484a66f666673657400a66e6279746573"
                 "03aa67656e65726174696f6e05ab696e6361726e6174696f6eb030313233343536373839616263646566",
                 Op.OK, {"receipt": {"offset": 0, "nbytes": 3, "generation": 5, "incarnation": INC}}, b""),
    "write_many": ("47505451010500000000001b000000000000000382a56974656d739293a16b038093a16b0080a774696d656f7574c0"
                   "616263",
                   Op.WRITE_MANY, {"items": [["k", 3, {}], ["k", 0, {}]], "timeout": None}, b"abc"),
    "write_many_ok": ("47505451011000000000008f000000000000000081a7726573756c74739281a77265636569707484a66f6666736574"
                      "00a66e627974657303aa67656e65726174696f6e05ab696e6361726e6174696f6eb030313233343536373839616263"
                      "64656681a56572726f7282a56572726f72b14475706c69636174654b65794572726f72a76d657373616765b9756e"
                      "69742073752d303a206b657920276b2720657869737473",
                      Op.OK, {"results": [{"receipt": {"offset": 0, "nbytes": 3, "generation": 5, "incarnation": INC}},
                                          {"error": {"error": "DuplicateKeyError",
                                                     "message": "unit su-0: key 'k' exists"}}]}, b""),
    "read": ("47505451010300000000000b000000000000000081a46b65797392a161a162",
             Op.READ, {"keys": ["a", "b"]}, b""),
    "read_generations": ("475054510103000000000034000000000000000083a46b65797391a161ab67656e65726174696f6e7391"
                         "07ab696e6361726e6174696f6eb030313233343536373839616263646566",
                         Op.READ, {"keys": ["a"], "generations": [7], "incarnation": INC}, b""),
    "read_ok": ("47505451011000000000000c000000000000000381a76c656e6774687392010278797a",
                Op.OK, {"lengths": [1, 2]}, b"xyz"),
    "call": ("475054510104000000000014000000000000000082a66d6574686f64a57374617473a46172677380",
             Op.CALL, {"method": "stats", "args": {}}, b""),
    "call_ok": ("475054510110000000000009000000000000000081a6726573756c7401",
                Op.OK, {"result": 1}, b""),
    "error": ("47505451011100000000003a000000000000000082a56572726f72af556e6b6e6f776e4b65794572726f72a76d65"
              "7373616765ba756e69742073752d303a20756e6b6e6f776e206b657920276127",
              Op.ERROR, {"error": "UnknownKeyError", "message": "unit su-0: unknown key 'a'"}, b""),
}


def frame(opcode: int, body: dict, payload: bytes = b"", *, magic=MAGIC, version=VERSION,
          payload_len: int | None = None) -> bytes:
    raw = pack_body(body)
    length = len(payload) if payload_len is None else payload_len
    return HEADER.pack(magic, version, opcode, len(raw), length) + raw + payload


def hello(token: str = TOKEN) -> bytes:
    return frame(Op.HELLO, {"token": token})


def split_frames(data: bytes) -> list[tuple[int, dict, bytes]]:
    """Parse frames with struct and msgpack only (not the implementation's reader)."""
    import msgpack

    out = []
    while data:
        magic, version, opcode, body_len, payload_len = struct.unpack("!4sBBxxIQ", data[:20])
        assert (magic, version) == (b"GPTQ", 1)
        body = msgpack.unpackb(data[20:20 + body_len], raw=False)
        end = 20 + body_len + payload_len
        out.append((opcode, body, data[20 + body_len:end]))
        data = data[end:]
    return out


def send_and_collect(sock: socket.socket, data: bytes) -> bytes:
    """Send ``data`` from a helper thread (it may exceed the socket buffer), half-close, read to EOF."""
    def send():
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server closed first: what it sent is still readable

    sender = threading.Thread(target=send)
    sender.start()
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    sender.join(5)
    return b"".join(chunks)


def serve_pair(data: bytes, unit) -> list[tuple[int, dict, bytes]]:
    """Run serve_connection on one end of a socket pair fed ``data``; return its frames (greeting first)."""
    client, server = socket.socketpair()
    errors = []

    def run():
        try:
            serve_connection(server, unit, ServerLimits(max_frame_bytes=MAX, send_timeout_s=5))
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    with client:
        client.settimeout(10)
        got = send_and_collect(client, data)
    thread.join(10)
    assert not thread.is_alive() and not errors, errors
    return split_frames(got)


# ------------------------------------------------------------------ golden vectors

@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_frames_encode_and_decode(name):
    literal, opcode, body, payload = GOLDEN[name]
    raw = bytes.fromhex(literal)
    a, b = socket.socketpair()
    with a, b:
        FrameWriter(a).send(opcode, body, (payload,) if payload else ())
        a.shutdown(socket.SHUT_WR)
        sent = b"".join(iter(lambda: b.recv(65536), b""))
    assert sent == raw
    a, b = socket.socketpair()
    with a, b:
        a.sendall(raw)
        reader = FrameReader(b, MAX)
        header, got = reader.read_frame()
        data = bytearray(header.payload_len)
        reader.recv_exact(data)
    assert (header.opcode, got, bytes(data)) == (opcode, body, payload)


def test_channel_requests_are_the_golden_bytes():
    """A real TcpChannel against a scripted peer that answers only the golden requests."""
    replies = {bytes.fromhex(GOLDEN[req][0]): bytes.fromhex(GOLDEN[rep][0]) for req, rep in [
        ("hello", "hello_ok"), ("write", "write_ok"), ("read", "read_ok"), ("read_generations", "error"),
        ("call", "call_ok"), ("write_many", "write_many_ok")]}
    seen, unexpected = [], []
    listener = socket.create_server(("127.0.0.1", 0))

    def peer(conn):
        with conn:
            while header := conn.recv(20, socket.MSG_WAITALL):
                if len(header) < 20:
                    return
                body_len, payload_len = struct.unpack("!IQ", header[8:])
                rest = conn.recv(body_len + payload_len, socket.MSG_WAITALL) if body_len + payload_len else b""
                request = header + rest
                if request not in replies:
                    unexpected.append(request.hex())
                    return
                seen.append(request)
                conn.sendall(replies[request])

    def accept():
        with listener:
            for _ in range(2):  # the read/call lane and the write lane
                conn, _ = listener.accept()
                threading.Thread(target=peer, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    address = {"transport": "tcp", "unit": "su-0", "host": "127.0.0.1", "port": listener.getsockname()[1]}
    with TcpChannel(address, token="tok", max_frame_bytes=MAX, timeout=5) as ch:
        assert (ch.unit, ch.incarnation) == ("su-0", INC)
        assert ch.write("k", b"abc") == GOLDEN["write_ok"][2]["receipt"]
        dest = bytearray(3)
        assert ch.read(["a", "b"], dest) == [1, 2] and dest == b"xyz"
        with pytest.raises(UnknownKeyError, match="unknown key 'a'"):
            ch.read(["a"], dest, generations=[7], incarnation=INC)
        assert ch.call("stats") == 1
        receipt, refused = ch.write_many([("k", b"abc", {}), ("k", b"", {})])
        assert receipt == GOLDEN["write_ok"][2]["receipt"]
        assert isinstance(refused, DuplicateKeyError) and "key 'k' exists" in str(refused)
    acceptor.join(5)
    assert not unexpected
    assert len(seen) == 7  # two HELLOs, one of each request


def test_server_replies_match_the_golden_layout():
    with make_unit(1 << 16, name="su-0") as unit:
        out = serve_pair(bytes.fromhex(GOLDEN["write"][0]) + bytes.fromhex(GOLDEN["call"][0])
                         + frame(Op.READ, {"keys": ["k", "nope"]}), unit)
        greeting, written, called, failed = out
        assert greeting == (Op.OK, {"unit": "su-0", "incarnation": unit.incarnation}, b"")
        assert written[0] == Op.OK and set(written[1]["receipt"]) >= {"offset", "nbytes", "generation"}
        assert called[0] == Op.OK and called[1]["result"]["keys"] == 1
        assert failed[0] == Op.ERROR and failed[1] == {"error": "UnknownKeyError",
                                                       "message": "unit su-0: unknown key 'nope'"}


# ------------------------------------------------------------------ pure functions

def test_write_window_ends_strictly_inside_the_reservation():
    from gputq.transport.handler import WRITE_WINDOW_SHARE, write_window

    assert WRITE_WINDOW_SHARE < 1
    assert write_window(60.0, 60.0) == 30.0 and write_window(1.0) == 0.5
    assert write_window(60.0, 10.0) == 10.0 and write_window(None, 5.0) == 5.0
    assert write_window(None) is None and write_window(None, None) is None


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


# ------------------------------------------------------------------ reader / writer over socket pairs

@pytest.mark.parametrize("sizes", [[], [0], [7], [100, 3], [200_000, 1, 70_000]])
def test_frame_round_trip(sizes):
    a, b = socket.socketpair()
    rng = np.random.default_rng(len(sizes))
    payloads = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    sender = threading.Thread(target=FrameWriter(a).send, args=(Op.OK, {"lengths": sizes}, payloads))
    sender.start()  # more than a socket buffer: send while receiving
    with a, b:
        reader = FrameReader(b, MAX)
        header, body = reader.read_frame()
        assert header.opcode == Op.OK and body == {"lengths": sizes}
        assert header.payload_len == sum(sizes)
        got = bytearray(header.payload_len)
        reader.recv_exact(got)
        sender.join(5)
    assert bytes(got) == b"".join(p.tobytes() for p in payloads)


def test_eof_between_frames_is_peer_lost():
    a, b = socket.socketpair()
    a.close()
    with b, pytest.raises(PeerLostError, match="closed"):
        FrameReader(b, MAX).read_header()


@pytest.mark.parametrize("cut, error", [(7, ProtocolError), (-2, PeerLostError)])
def test_truncated_header_and_body(cut, error):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(hello()[:cut])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(error, match="truncated"):  # a server's flavour, then a client's
            FrameReader(b, MAX, truncated_error=error).read_frame()


def test_reader_deadline_times_out():
    a, b = socket.socketpair()
    with a, b:
        reader = FrameReader(b, MAX)
        reader.deadline = Deadline(0.05)
        with pytest.raises(GputqTimeoutError):
            reader.read_header()


def test_writer_frame_timeout_bounds_a_peer_that_stops_reading():
    a, b = socket.socketpair()
    with a, b:
        writer = FrameWriter(a, frame_timeout=0.2)
        with pytest.raises(GputqTimeoutError):
            writer.send(Op.OK, {}, (np.zeros(16 << 20, np.uint8),))  # nobody reads b
        assert a.gettimeout() is None  # the next receive is not bounded by the send deadline


def test_writer_maps_closed_peer():
    a, b = socket.socketpair()
    b.close()
    with a, pytest.raises(PeerLostError):
        FrameWriter(a).send(Op.CALL, {"method": "stats"})


def test_unpackable_body_sends_nothing():
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(TypeError):
            FrameWriter(a).send(Op.OK, {"result": object()})
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)


# ------------------------------------------------------------------ the handshake, byte by byte

def test_handshake_accepts_a_hello_fed_byte_by_byte():
    hs = Handshake()
    raw = bytes.fromhex(GOLDEN["hello"][0])
    results = [hs.feed(raw[i:i + 1]) for i in range(len(raw))]
    assert results[:-1] == [None] * (len(raw) - 1) and results[-1] == {"token": "tok"}
    assert hs.missing() == 0


@pytest.mark.parametrize("raw, error, match", [
    (frame(Op.READ, {"keys": []}), AuthenticationError, "HELLO"),
    (frame(Op.HELLO, {}, payload_len=1), ProtocolError, "payload"),
    (HEADER.pack(MAGIC, VERSION, Op.HELLO, 1 << 20, 0), ProtocolError, "body"),  # a 1 MiB HELLO body
    (HEADER.pack(MAGIC, VERSION, Op.HELLO, PRE_AUTH_BODY_BYTES + 1, 0), ProtocolError, "body"),
    (b"GET / HTTP/1.1\r\nHost: x\r\n", ProtocolError, "magic"),
])
def test_handshake_refuses_before_reading_more(raw, error, match):
    hs = Handshake()
    with pytest.raises(error, match=match):
        while hs.missing() > 0:
            hs.feed(raw[len(hs.buf):len(hs.buf) + hs.missing()])
    assert len(hs.buf) <= HEADER.size  # nothing after the header was asked for


# ------------------------------------------------------------------ serving one authenticated connection

def test_serve_connection_good_session():
    with make_unit(1 << 16, name="su-0") as unit:
        data = (frame(Op.WRITE, {"key": "k", "nbytes": 5, "meta": {}}, b"hello")
                + frame(Op.READ, {"keys": ["k"]}) + frame(Op.CALL, {"method": "stats", "args": {}}))
        out = serve_pair(data, unit)
        assert [op for op, _, _ in out] == [Op.OK] * 4
        assert out[1][1]["receipt"]["nbytes"] == 5
        assert out[2][1:] == ({"lengths": [5]}, b"hello")
        assert out[3][1]["result"]["keys"] == 1 and out[3][1]["result"]["leases"] == 0


@pytest.mark.parametrize("data, error", [
    (frame(Op.WRITE, {"key": "k", "nbytes": MAX + 1}, payload_len=MAX + 1), "ProtocolError"),
    (frame(Op.READ, {"keys": []}, version=VERSION + 1), "ProtocolError"),
    (frame(Op.OK, {}), "ProtocolError"),  # a reply opcode from a client
    (frame(Op.HELLO, {"token": TOKEN}), "ProtocolError"),  # a second HELLO
    (frame(Op.READ, {"keys": []})[:-3], "ProtocolError"),  # truncated
    (frame(Op.CALL, {"method": "stats"}, b"xy"), "ProtocolError"),  # a payload where none belongs
])
def test_serve_connection_closes_on_framing_violations(data, error):
    with make_unit(1 << 16) as unit:
        out = serve_pair(data, unit)
    assert out[-1][0] == Op.ERROR and out[-1][1]["error"] == error


def test_truncated_write_payload_aborts_reservation():
    with make_unit(1 << 16) as unit:
        out = serve_pair(frame(Op.WRITE, {"key": "k", "nbytes": 100, "meta": {}}, b"x" * 40, payload_len=100),
                         unit)
        assert out[-1][1]["error"] == "ProtocolError"
        stats = unit.stats()
        assert (stats["used"], stats["reserved"], stats["keys"]) == (0, 0, 0)


def test_failed_begin_write_drains_payload_and_keeps_serving():
    with make_unit(256) as unit:
        data = (frame(Op.WRITE, {"key": "big", "nbytes": 300, "meta": {}}, b"y" * 300)
                + frame(Op.WRITE, {"key": "ok", "nbytes": 3, "meta": {}}, b"abc"))
        out = serve_pair(data, unit)
        assert out[1][0] == Op.ERROR and out[1][1]["error"] == "RequestTooLargeError"
        assert out[2][0] == Op.OK and out[2][1]["receipt"]["nbytes"] == 3
        assert unit.read(["ok"])[0].tobytes() == b"abc"


# ------------------------------------------------------------------ a real server survives bad clients

BAD_CLIENT_BYTES = {
    "truncated": hello()[:-3],
    "oversized": hello() + frame(Op.WRITE, {"key": "k", "nbytes": MAX + 1}, payload_len=MAX + 1),
    "bad_magic": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "wrong_token": hello("nope"),
    "no_hello": frame(Op.READ, {"keys": []}),
    "huge_hello": HEADER.pack(MAGIC, VERSION, Op.HELLO, 1 << 20, 0) + bytes(1 << 16),
}


@pytest.fixture
def server():
    with make_unit(1 << 20) as unit, TcpTransport().serve(unit, token=TOKEN, limits=LIMITS) as srv:
        yield srv


def raw_exchange(address: dict, data: bytes) -> bytes:
    """Send crafted bytes, half-close, and return everything until the server closes."""
    with socket.create_connection((address["host"], address["port"]), timeout=5) as sock:
        return send_and_collect(sock, data)


@pytest.mark.parametrize("case", sorted(BAD_CLIENT_BYTES))
def test_real_server_survives_bad_client(server, case):
    got = raw_exchange(server.address, BAD_CLIENT_BYTES[case])  # returns only once the server closed
    expected = "AuthenticationError" if case in ("wrong_token", "no_hello") else "ProtocolError"
    assert split_frames(got)[-1][1]["error"] == expected
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
