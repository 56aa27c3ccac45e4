"""Hypothesis fuzz of the wire: frames before and after authentication, and leased regions.

Each property runs ~200 examples in the default suite and 10,000 under
``-m slow``. A property holds when every outcome is typed: the server
answers OK or a typed ERROR (never the untyped root), closes cleanly on
framing violations, and the unit keeps its stored bytes; the client refuses
any leased region outside the arena.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputq.errors import AuthenticationError, GputqError, ProtocolError
from gputq.transport.handler import ServerLimits
from gputq.transport.one_sided import leased_regions
from gputq.transport.tcp import TcpTransport
from gputq.transport.tcp_server import Handshake
from gputq.transport.wire import HEADER, MAGIC, PRE_AUTH_BODY_BYTES, VERSION, Op, encode_header, pack_body
from tests.transport.test_wire import TOKEN, send_and_collect, serve_pair
from tests.transport.units import make_unit

pytestmark = pytest.mark.timeout(900)

FAST = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))


def _subclasses(cls) -> set[str]:
    return {name for sub in cls.__subclasses__() for name in {sub.__name__} | _subclasses(sub)}


#: Every typed error a server may answer with: any GputqError subclass, not the untyped root.
_TYPED = _subclasses(GputqError)

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
                    st.floats(allow_nan=True), st.text(max_size=12), st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
FIELDS = ["keys", "key", "nbytes", "meta", "timeout", "method", "args", "generations", "incarnation",
          "lease_ids", "end", "token", "partition", "missing_ok"]
METHODS = ["stats", "release", "lease", "end_lease", "arena_file", "keys", "lookup", "delete", "add_ref",
           "transfer", "release_partition", "nixl_connect", "format_disk"]
bodies = st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=6)),
                         st.one_of(values, st.sampled_from(METHODS), st.lists(st.sampled_from(["fixed", "k"]))),
                         max_size=5)


@st.composite
def frames(draw) -> bytes:
    """One frame: a real or bogus opcode, a fuzzed body, a payload whose announced length may lie."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=64))  # not a frame at all
    opcode = draw(st.one_of(st.sampled_from([Op.HELLO, Op.WRITE, Op.READ, Op.CALL, Op.OK, Op.ERROR]),
                            st.integers(0, 255)))
    body = draw(bodies)
    if opcode == Op.CALL and draw(st.booleans()):
        body["method"] = draw(st.sampled_from(METHODS))
    payload = draw(st.binary(max_size=64))
    if opcode == Op.WRITE and draw(st.booleans()):
        body.update(key=draw(st.sampled_from(["k", "fixed", ""])), nbytes=len(payload))
    raw = pack_body(body)
    announced = len(payload) + draw(st.sampled_from([0, 0, 0, 1, -1])) if payload else len(payload)
    return encode_header(opcode, len(raw), max(announced, 0)) + raw + payload


# ------------------------------------------------------------------ before authentication

#: How a handshake fed fuzzed bytes may end.
PRE_AUTH_OUTCOMES = ("hello", "refused", "incomplete")


def _pre_auth(data: bytes, chunks: list[int]) -> tuple[str, Handshake]:
    """Feed ``data`` in ``chunks``; return how it ended and the handshake."""
    hs = Handshake()
    pos = 0
    try:
        for size in chunks + [len(data)]:
            while hs.missing() > 0 and pos < len(data):
                take = min(size or 1, hs.missing(), len(data) - pos)
                body = hs.feed(data[pos:pos + take])
                pos += take
                assert len(hs.buf) <= HEADER.size + PRE_AUTH_BODY_BYTES
                if body is not None:
                    assert isinstance(body, dict) and data[:4] == MAGIC and data[5] == Op.HELLO
                    return "hello", hs
    except (ProtocolError, AuthenticationError):
        return "refused", hs
    return "incomplete", hs


pre_auth_data = st.one_of(
    st.binary(max_size=256),
    st.builds(lambda body_len, tail: bytes(HEADER.pack(MAGIC, VERSION, Op.HELLO, body_len, 0)) + tail,
              st.integers(0, (1 << 32) - 1), st.binary(max_size=128)),
    st.builds(lambda body, tail: bytes(HEADER.pack(MAGIC, VERSION, Op.HELLO, len(pack_body(body)), 0))
              + pack_body(body) + tail, bodies, st.binary(max_size=32)))


@FAST
@given(pre_auth_data, st.lists(st.integers(0, 40), max_size=8))
def test_fuzz_handshake_parser(data, chunks):
    outcome, hs = _pre_auth(data, chunks)
    assert outcome in PRE_AUTH_OUTCOMES and len(hs.buf) <= HEADER.size + PRE_AUTH_BODY_BYTES
    assert outcome != "incomplete" or hs.missing() > 0  # it stopped only for want of bytes


@pytest.mark.slow
@SLOW
@given(pre_auth_data, st.lists(st.integers(0, 40), max_size=8))
def test_fuzz_handshake_parser_at_length(data, chunks):
    outcome, hs = _pre_auth(data, chunks)
    assert outcome in PRE_AUTH_OUTCOMES and len(hs.buf) <= HEADER.size + PRE_AUTH_BODY_BYTES
    assert outcome != "incomplete" or hs.missing() > 0  # it stopped only for want of bytes


@pytest.fixture(scope="module")
def live_server():
    with make_unit(1 << 20, name="su-fuzz") as unit, \
            TcpTransport().serve(unit, token=TOKEN,
                                 limits=ServerLimits(max_frame_bytes=1 << 20, handshake_timeout_s=2)) as srv:
        unit.put("fixed", b"fixed bytes")
        yield srv, unit


def _against_server(live, data: bytes) -> bytes:
    """Send ``data`` unauthenticated; return what came back, once the unit's key is checked intact."""
    srv, unit = live
    with socket.create_connection((srv.address["host"], srv.address["port"]), timeout=5) as sock:
        got = send_and_collect(sock, data)
    assert unit.read(["fixed"])[0].tobytes() == b"fixed bytes"
    return got


@FAST
@given(st.lists(frames(), min_size=1, max_size=3))
def test_fuzz_real_server_before_authentication(live_server, frame_list):
    got = _against_server(live_server, b"".join(frame_list))
    # Without the token, nothing but one ERROR frame ever comes back.
    assert not got or (got[:4] == MAGIC and got[5] == Op.ERROR), got[:32]


@pytest.mark.slow
@SLOW
@given(st.lists(frames(), min_size=1, max_size=3))
def test_fuzz_real_server_before_authentication_at_length(live_server, frame_list):
    got = _against_server(live_server, b"".join(frame_list))
    # Without the token, nothing but one ERROR frame ever comes back.
    assert not got or (got[:4] == MAGIC and got[5] == Op.ERROR), got[:32]


# ------------------------------------------------------------------ after authentication

def _post_auth(frame_list: list[bytes]) -> list[str]:
    """Serve ``frame_list`` to a real unit; return each reply as ``"OK"`` or its error's name.

    Checks the unit afterwards: no half-written key, the stored key intact.
    """
    with make_unit(1 << 16, name="su-fuzz", put_timeout_s=0) as unit:
        unit.put("fixed", b"fixed bytes")
        out = serve_pair(b"".join(frame_list), unit)
        assert out[0][0] == Op.OK  # the greeting
        answers = ["OK" if opcode == Op.OK else body.get("error") if opcode == Op.ERROR else f"opcode {opcode}"
                   for opcode, body, _ in out[1:]]
        assert unit.stats()["reserved"] == 0  # no half-written key left behind
        try:
            stored = unit.read(["fixed"])[0].tobytes()
        except GputqError:  # the fuzz may delete or release it, legitimately
            return answers
        assert stored == b"fixed bytes"
        return answers


@FAST
@given(st.lists(frames(), min_size=1, max_size=4))
def test_fuzz_frames_after_authentication(frame_list):
    answers = _post_auth(frame_list)
    assert set(answers) <= {"OK", *_TYPED}, answers  # OK or a typed error, never the untyped root


@pytest.mark.slow
@SLOW
@given(st.lists(frames(), min_size=1, max_size=4))
def test_fuzz_frames_after_authentication_at_length(frame_list):
    answers = _post_auth(frame_list)
    assert set(answers) <= {"OK", *_TYPED}, answers  # OK or a typed error, never the untyped root


# ------------------------------------------------------------------ leased regions

ARENA = 1 << 20
int64 = st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-2, ARENA + 2),
                  st.sampled_from([0, ARENA, ARENA - 1, (1 << 63) - 1, -(1 << 63)]))


@st.composite
def lease_replies(draw):
    nkeys = draw(st.integers(0, 6))
    if draw(st.integers(0, 4)) == 0:
        return nkeys, draw(st.one_of(st.binary(max_size=120), st.none(), st.integers(), st.text(max_size=8)))
    rows = draw(st.lists(st.tuples(int64, int64), min_size=nkeys, max_size=nkeys))
    return nkeys, np.array(rows, dtype="<i8").reshape(nkeys, 2).tobytes()


def _regions(reply) -> list | None:
    """The regions ``leased_regions`` accepted, as Python ints; None when it refused them (naming the unit)."""
    nkeys, raw = reply
    keys = [f"k{i}" for i in range(nkeys)]
    try:
        regions = leased_regions(raw, keys, ARENA, "su-fuzz")
    except ProtocolError as exc:
        assert "su-fuzz" in str(exc)
        return None
    assert regions.shape == (nkeys, 2)
    return regions.tolist()  # Python ints: no overflow in the check


def _inside_the_arena(regions: list) -> bool:
    return all(0 <= offset and 0 <= nbytes and offset + nbytes <= ARENA for offset, nbytes in regions)


@FAST
@given(lease_replies())
def test_fuzz_leased_regions_outside_the_arena_are_refused(reply):
    regions = _regions(reply)
    assert regions is None or _inside_the_arena(regions), regions


@pytest.mark.slow
@SLOW
@given(lease_replies())
def test_fuzz_leased_regions_at_length(reply):
    regions = _regions(reply)
    assert regions is None or _inside_the_arena(regions), regions
