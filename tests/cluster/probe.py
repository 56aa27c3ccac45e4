"""What another host sees of a unit: run on a host of :class:`bench.hosts.Hosts`.

``python -m tests.cluster.probe SCENARIO JSON`` prints one JSON line
(:func:`on_host` runs it there and returns that line).
Scenarios (the JSON holds their arguments):

- ``scan`` ``{"host", "last"}``: every tcp port of ``host`` up to ``last``
  (default 65535) that accepts a connection, and how many answered at all.
- ``path`` ``{"addresses", "token", "writer", "keys"}``: with ``auto``,
  the transport chosen for each unit and whether reads of every key come
  back bit-exact; the ``writer`` host first writes ``keys`` keys to each
  unit, and releases them at the end (``keys_left`` then).
- ``faults`` ``{"addresses", "token", "lossy", "timeout"}``: a reader and a
  controller (heartbeat on) on this host while the test breaks the link to
  unit ``lossy``; it reports each step as a JSON line and waits for the
  test's next line on stdin (see ``tests/cluster/test_host_faults.py``).
- ``exposure`` ``{"address", "token", "flood", "rounds"}``: as a token
  holder, write a key; as a peer without the token, try to read, write and
  get the NIXL metadata; then flood the unit with ``flood`` connections
  that never authenticate while token holders connect and read the key
  ``rounds`` times, each with fresh clients (a new connection each time).
"""

from __future__ import annotations

import contextlib
import errno
import json
import resource
import selectors
import socket
import sys
import threading
import time

import numpy as np

from bench.hosts import ROOT

__all__ = ["on_host", "open_ports", "path", "faults", "exposure"]

def on_host(hosts, host: int, scenario: str, args: dict, timeout: float = 60) -> dict:
    """Run ``scenario`` on ``host`` of ``hosts`` (a :class:`bench.hosts.Hosts`); its JSON line."""
    done = hosts.run(host, [sys.executable, "-m", "tests.cluster.probe", scenario, json.dumps(args)], timeout,
                     cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


# Connects in flight at once: well under the open-file limit (a scan of 65535 ports takes ~5 s).
_BATCH = max(64, min(8192, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 256))
_CONNECT_S = 2.0
_KEY_BYTES = 256 << 10


def open_ports(host: str, ports=range(1, 65536)) -> tuple[list[int], int]:
    """The ports of ``host`` that accept a tcp connection, and how many ports answered (accept or refuse).

    Non-blocking connects, many at once; a port that does not answer within
    a short deadline counts as neither.
    """
    found, answered, ports = [], 0, list(ports)
    for start in range(0, len(ports), _BATCH):
        selector, socks = selectors.DefaultSelector(), {}
        for port in ports[start:start + _BATCH]:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.connect_ex((host, port))
            selector.register(sock, selectors.EVENT_WRITE, port)
            socks[port] = sock
        deadline = time.monotonic() + _CONNECT_S
        while socks and time.monotonic() < deadline:
            for key, _ in selector.select(deadline - time.monotonic()):
                sock = key.fileobj
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error == 0:
                    found.append(key.data)
                answered += error in (0, errno.ECONNREFUSED)
                selector.unregister(sock)
                sock.close()
                socks.pop(key.data)
        for sock in socks.values():  # no answer at all within the deadline: not open either
            sock.close()
        selector.close()
    return sorted(found), answered


def _raw_attempts(host: str, port: int) -> dict:
    """Frames sent without a HELLO: what the unit answers each (its error class, then a close)."""
    from gputq.transport.wire import FrameReader, FrameWriter, Op

    attempts = {"read": (Op.READ, {"keys": ["secret"]}, ()),
                "write": (Op.WRITE, {"key": "planted", "nbytes": 4, "meta": {}, "timeout": 1}, (b"evil",)),
                "nixl_connect": (Op.CALL, {"method": "nixl_connect", "args": {}}, ())}
    answers = {}
    for what, (op, body, payload) in attempts.items():
        with socket.create_connection((host, port), timeout=5) as sock:
            FrameWriter(sock).send(op, body, payload)
            header, reply = FrameReader(sock, 1 << 20).read_frame()
            rest = sock.recv(1 << 16)
            answers[what] = {"opcode": int(header.opcode), "error": reply.get("error"), "then": rest.hex()}
    return answers


def _flood(host: str, port: int, n: int, stop: threading.Event, counts: dict) -> None:
    """Keep ``n`` silent connections open to the unit, opening a new one for each it closes."""
    selector = selectors.DefaultSelector()

    def one():
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex((host, port))
        selector.register(sock, selectors.EVENT_READ)
        counts["opened"] += 1

    for _ in range(n):
        one()
    while not stop.is_set():
        for key, _ in selector.select(0.05):
            sock = key.fileobj
            try:
                closed = sock.recv(1 << 12) == b""
            except OSError:
                closed = True
            if closed:
                selector.unregister(sock)
                sock.close()
                counts["closed_by_unit"] += 1
                one()
    for key in list(selector.get_map().values()):
        key.fileobj.close()
    selector.close()


def _blob(unit: str, i: int) -> np.ndarray:
    seed = int.from_bytes(f"{unit}/{i}".encode()[-8:], "little")
    return np.random.default_rng(seed).integers(0, 256, _KEY_BYTES, dtype=np.uint8)


def path(addresses: dict, token: str, write: bool, keys: int, release: bool) -> dict:
    """Write (``write``), read back and check, release (``release``): from the host this runs on."""
    from gputq.client.clients import UnitClients
    from gputq.config import GputqConfig

    config = GputqConfig(transport="auto", token=token, host="127.0.0.1")
    result: dict = {"hostname": socket.gethostname(), "choices": {}, "exact": 0, "read": 0}
    with UnitClients(addresses, config) as clients:
        for unit in sorted(addresses):
            if write:
                for i in range(keys):
                    clients.channel(unit).write(f"{unit}/{i}", _blob(unit, i), {"partition": "p"}, timeout=10)
            dest = np.empty(keys * _KEY_BYTES, np.uint8)
            lengths = clients.channel(unit).read([f"{unit}/{i}" for i in range(keys)], dest, timeout=10)
            result["read"] += len(lengths)
            result["exact"] += sum(np.array_equal(dest[i * _KEY_BYTES:(i + 1) * _KEY_BYTES], _blob(unit, i))
                                   for i in range(keys))
            # an shm channel that could not map the arena reads over another lane and says why
            result["choices"][unit] = [*clients.transport_of(unit), clients.channel(unit).fallback_reason]
        if release:
            for unit in sorted(addresses):
                clients.channel(unit).call("release_partition", timeout=10, partition="p")
            result["keys_left"] = {u: clients.channel(u).call("stats", timeout=10)["keys"] for u in addresses}
    return result


_BIG_BYTES = 8 << 20


def _say(**event) -> None:
    print(json.dumps(event), flush=True)


def _exact(clients, unit: str, keys: int, timeout: float) -> int:
    """Keys of ``unit`` read back bit-exact (``{unit}/{i}``, as :func:`path` writes them)."""
    dest = np.empty(keys * _KEY_BYTES, np.uint8)
    clients.channel(unit).read([f"{unit}/{i}" for i in range(keys)], dest, timeout=timeout)
    return sum(np.array_equal(dest[i * _KEY_BYTES:(i + 1) * _KEY_BYTES], _blob(unit, i)) for i in range(keys))


def _until(predicate, limit_s: float) -> float | None:
    """When ``predicate`` first held (monotonic), polling every 10 ms; None if not within ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(0.01)
    return None


def faults(addresses: dict, token: str, lossy: str, timeout: float, keys: int = 8) -> None:
    """The reader's and the controller's side of the link faults; one JSON line per step."""
    from gputq.client.clients import UnitClients
    from gputq.cluster.controller import Controller
    from gputq.config import GputqConfig
    from gputq.errors import GputqError

    config = GputqConfig(transport="tcp", token=token, host="127.0.0.1", heartbeat_interval_s=0.25,
                         control_timeout_s=1.0, read_timeout_s=timeout)
    survivors = sorted(u for u in addresses if u != lossy)
    big = np.random.default_rng(3).integers(0, 256, _BIG_BYTES, dtype=np.uint8)
    with UnitClients(addresses, config) as clients, contextlib.closing(Controller(config)) as controller:
        for unit in sorted(addresses):
            controller.register_unit(unit, addresses[unit])
            for i in range(keys):
                clients.channel(unit).write(f"{unit}/{i}", _blob(unit, i), {"partition": "p"}, timeout=30)
        clients.channel(lossy).write("big", big, {"partition": "p"}, timeout=30)

        def survivors_exact() -> int:
            return sum(_exact(clients, u, keys, timeout) for u in survivors)

        # 1. the link is cut while reads of `big` stream: a typed error within the timeout
        dest, said, started = np.empty(_BIG_BYTES, np.uint8), False, 0.0
        while True:
            started = time.monotonic()
            try:
                clients.channel(lossy).read(["big"], dest, timeout=timeout)
            except GputqError as exc:
                failed = time.monotonic()
                _say(event="failed", started=started, at=failed, waited=failed - started,
                     error=type(exc).__name__, lost=sorted(clients.lost), survivors_exact=survivors_exact(),
                     survivors_keys=keys * len(survivors))
                break
            if not said:
                _say(event="reading", exact=bool(np.array_equal(dest, big)))
                said = True
        # 2. the link is back: the prober re-admits the unit, which kept its keys
        sys.stdin.readline()
        back = _until(lambda: lossy in clients.live_units, 30)
        back_controller = _until(lambda: lossy in controller.live_units(), 30)
        _say(event="readmitted", at=back, controller_at=back_controller, exact=_exact(clients, lossy, keys, timeout),
             keys=keys)
        # 3. a partition between this host (the controller's) and the unit only
        sys.stdin.readline()
        lost = _until(lambda: lossy in controller.lost_units(), 30)
        _say(event="partitioned", at=lost, reason=controller.lost_units().get(lossy))
        sys.stdin.readline()
        healed = _until(lambda: lossy in controller.live_units(), 30)
        _say(event="healed", at=healed)
        # 4. a slow link: a read that cannot finish in time fails in time; the others are whole
        sys.stdin.readline()
        clients.ping(lossy)
        started = time.monotonic()
        try:
            clients.channel(lossy).read(["big"], dest, timeout=timeout)
            error = None
        except GputqError as exc:
            error = type(exc).__name__
        _say(event="slow", waited=time.monotonic() - started, error=error, survivors_exact=survivors_exact(),
             survivors_keys=keys * len(survivors))


def exposure(address: dict, token: str, flood: int, rounds: int) -> dict:
    from gputq.client.clients import UnitClients
    from gputq.config import GputqConfig
    from gputq.errors import GputqError
    from gputq.transport import get_transport

    config = GputqConfig(transport="tcp", token=token, host="127.0.0.1")
    control = address.get("control", address)
    host, port, unit = control["host"], control["port"], address["unit"]
    secret = np.random.default_rng(7).integers(0, 256, _KEY_BYTES, dtype=np.uint8)
    result: dict = {}
    with UnitClients({unit: address}, config) as clients:
        clients.channel(unit).write("secret", secret, {"partition": "p"}, timeout=10)
        before = clients.channel(unit).call("stats", timeout=10)
    try:
        get_transport("tcp").connect(control, token="x" * 32, max_frame_bytes=1 << 20, timeout=5)
        result["wrong_token"] = "connected"
    except GputqError as exc:
        result["wrong_token"] = type(exc).__name__
    result["without_hello"] = _raw_attempts(host, port)
    with UnitClients({unit: address}, config) as clients:
        after = clients.channel(unit).call("stats", timeout=10)
    counters = ("keys", "used", "reads", "bytes_read", "puts", "bytes_written")
    result["stats_unchanged"] = {k: (before[k], after[k]) for k in counters}

    stop, counts = threading.Event(), {"opened": 0, "closed_by_unit": 0}
    flooder = threading.Thread(target=_flood, args=(host, port, flood, stop, counts), daemon=True)
    flooder.start()
    reads = {"exact": 0, "errors": [], "lost": [], "seconds": []}
    try:
        while counts["opened"] < flood:  # the whole flood is in before the first legitimate client
            time.sleep(0.01)
        for _ in range(rounds):
            with UnitClients({unit: address}, config) as clients:
                dest = np.empty(_KEY_BYTES, np.uint8)
                start = time.monotonic()
                try:
                    clients.channel(unit).read(["secret"], dest, timeout=5)
                    reads["exact"] += int(np.array_equal(dest, secret))
                except GputqError as exc:
                    reads["errors"].append(f"{type(exc).__name__}: {exc}")
                reads["seconds"].append(time.monotonic() - start)
                reads["lost"] += sorted(clients.lost)
    finally:
        stop.set()
        flooder.join(10)
    result["flood"] = {**counts, **reads, "longest_s": max(reads["seconds"]), "rounds": rounds}
    return result


def main(argv: list[str]) -> int:
    scenario, args = argv[0], json.loads(argv[1])
    if scenario == "scan":
        found, answered = open_ports(args["host"], range(1, args.get("last", 65535) + 1))
        print(json.dumps({"open": found, "answered": answered}), flush=True)
    elif scenario == "path":
        print(json.dumps(path(args["addresses"], args["token"], args.get("write", False), args["keys"],
                              args.get("release", False))), flush=True)
    elif scenario == "faults":
        faults(args["addresses"], args["token"], args["lossy"], args["timeout"])
    elif scenario == "exposure":
        print(json.dumps(exposure(args["address"], args["token"], args["flood"], args["rounds"])), flush=True)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
