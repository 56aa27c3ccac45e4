"""Fault injection: StorageUnits in their own processes, killed (-9) or stopped, and what it costs.

``python -m bench.faults`` runs four scenarios and prints, for each, the
fault injected, the time until it was detected (a typed error, or the
controller marking the unit lost), the bytes checked bit-exact on the
units that survived, the data lost on them (the goal is zero) and the
longest single wait of a caller. ``--json`` ends with one JSON line.

1. ``kill-mid-read``: a reader loops over a shard on one unit; the unit
   gets SIGKILL mid-read; the other unit's keys are then read and checked.
2. ``stop-writes``: a unit gets SIGSTOP; four writes go to it in turn
   (a hung unit must cost one timeout, not four).
3. ``kill-release``: one of three units gets SIGKILL; the rollout is
   released anyway (the other two free their keys).
4. ``heartbeat``: one unit killed and one stopped under a controller
   heartbeat; both marked lost, the stopped one re-admitted after SIGCONT
   and the release it missed replayed.

:class:`UnitProcess` (one StorageUnit served over tcp in a child process)
is shared with ``tests/client/test_faults.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from bench.common import add_json_flag, emit_json, print_header, print_table

__all__ = ["UnitProcess", "unit_processes", "main"]

_CONFIG_ENV = "GPUTQ_FAULTS_UNIT_CONFIG"
_TOKEN_ENV = "GPUTQ_FAULTS_UNIT_TOKEN"  # apart: a config dict may redact it
_START_S = 60.0


class UnitProcess:
    """One StorageUnit served over tcp by a child Python process.

    The child gets its config (token included) through its environment,
    prints its address as one JSON line, and serves until its stdin closes
    or it is killed.

    Parameters
    ----------
    name:
        Unit name.
    config:
        A :class:`~gputq.config.GputqConfig` with a token; ``shm_dir``
        should be a private folder (a killed unit leaves its arena file).
    wrap:
        Turns the child's command line into the one to run (e.g. on another
        host's namespace: ``bench.hosts.Hosts.command``); the
        command must exec the child, so that :attr:`pid` is the unit's.
    """

    def __init__(self, name: str, config, wrap=None):
        settings = {k: v for k, v in config.to_dict().items() if k != "token"}
        env = dict(os.environ, **{_CONFIG_ENV: json.dumps(settings), _TOKEN_ENV: config.token})
        self.name = name
        argv = [sys.executable, "-m", "bench.faults", "--serve-unit", name]
        self.proc = subprocess.Popen(argv if wrap is None else wrap(argv),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._address: dict | None = None

    @property
    def address(self) -> dict:
        """The unit's tcp address; waits for the child to start serving (started children in parallel)."""
        if self._address is None:
            try:
                self._address = json.loads(_read_line(self.proc, _START_S))
            except BaseException:
                self.kill()
                raise
        return self._address

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: the process dies at once, sockets are reset, nothing is cleaned up."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGSTOP: the process hangs; its listening socket still accepts connections.

        Returns once the kernel reports the process stopped (delivery is not instant).
        """
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _state(self.proc.pid) not in ("T", "t"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"unit process {self.proc.pid} did not stop")
            time.sleep(0.001)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        """End the child. Idempotent. It is killed: its arena file lives in a folder the caller removes."""
        self.kill()
        self.proc.stdin.close()
        self.proc.stdout.close()


def _state(pid: int) -> str:
    """The process state letter from ``/proc/<pid>/stat`` (``T``: stopped)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            raise RuntimeError(f"unit process {proc.pid} did not start (exit code {proc.poll()})")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            return proc.stdout.readline().decode()


class unit_processes:
    """Context manager: ``n`` :class:`UnitProcess` es ``su-0..`` sharing a fresh token and shm folder, serving
    ``transport`` (tcp's control lane under shm and rdma too).

    Yields ``(config, {name: UnitProcess})``.
    """

    def __init__(self, n: int, capacity: int = 64 << 20, transport: str = "tcp", **overrides):
        from gputq.config import GputqConfig

        self._dir = tempfile.mkdtemp(prefix="gputq-faults-")
        self.config = GputqConfig(enabled=True, use_rollout_routing_replay=True, transport=transport, num_units=n,
                                  unit_capacity_bytes=capacity, host="127.0.0.1", shm_dir=self._dir,
                                  **overrides).with_token()
        self._n = n
        self.units: dict[str, UnitProcess] = {}

    def __enter__(self):
        try:
            for i in range(self._n):  # start every child, then wait: they import in parallel
                self.units[f"su-{i}"] = UnitProcess(f"su-{i}", self.config)
            for unit in self.units.values():
                unit.address
        except BaseException:
            self.__exit__()
            raise
        return self.config, self.units

    def __exit__(self, *exc):
        for unit in self.units.values():
            unit.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _serve_unit(name: str) -> None:
    from gputq.cluster.deploy import UnitService
    from gputq.config import GputqConfig

    config = GputqConfig.from_mapping(json.loads(os.environ[_CONFIG_ENV])).replace(token=os.environ[_TOKEN_ENV])
    with UnitService(name, config) as service:
        print(json.dumps(service.address()), flush=True)
        sys.stdin.read()  # serve until the parent closes our stdin


# -- scenarios --------------------------------------------------------------------------

def _put(clients, config, unit: str, prefix: str, n: int, nbytes: int, partition: str = "r0") -> dict:
    """Write ``n`` blobs of ``nbytes`` straight to ``unit``; return key -> bytes."""
    rng = np.random.default_rng(len(prefix) + n)
    blobs = {f"{prefix}/{i}": rng.integers(0, 255, nbytes, dtype=np.uint8) for i in range(n)}
    for key, blob in blobs.items():
        clients.channel(unit).write(key, blob, {"partition": partition}, timeout=config.put_timeout_s)
    return blobs


def _check(clients, config, unit: str, blobs: dict) -> tuple[int, int]:
    """(bytes read back bit-exact, keys lost) of ``blobs`` on ``unit``."""
    from gputq.errors import GputqError

    ok = lost = 0
    for key, blob in blobs.items():
        dest = np.empty(blob.nbytes, np.uint8)
        try:
            clients.channel(unit).read([key], dest, timeout=config.read_timeout_s)
        except GputqError:
            lost += 1
            continue
        if np.array_equal(dest, blob):
            ok += blob.nbytes
        else:
            lost += 1
    return ok, lost


def kill_mid_read(size_mib: int = 16) -> dict:
    from gputq.client.clients import UnitClients
    from gputq.errors import GputqError, UnitLostError

    with unit_processes(2, capacity=(4 * size_mib) << 20, read_timeout_s=10.0) as (config, units):
        with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
            victim = _put(clients, config, "su-0", "victim", 4, (size_mib << 20) // 4)
            survivor = _put(clients, config, "su-1", "survivor", 4, (size_mib << 20) // 4)
            dest = np.empty(size_mib << 20, np.uint8)
            started, failed = threading.Event(), {}

            def loop():
                try:
                    while True:
                        started.set()
                        clients.channel("su-0").read(sorted(victim), dest, timeout=config.read_timeout_s)
                except GputqError as exc:
                    failed["at"], failed["error"] = time.monotonic(), exc

            reader = threading.Thread(target=loop, daemon=True)
            reader.start()
            started.wait(10)
            time.sleep(0.05)  # let reads be in flight
            killed = time.monotonic()
            units["su-0"].kill()
            reader.join(30)
            checked, lost = _check(clients, config, "su-1", survivor)
            error = failed.get("error")
            return {"scenario": "kill-mid-read", "fault": "SIGKILL su-0 during a 16 MiB read loop",
                    "detect_s": failed["at"] - killed, "typed": isinstance(error, UnitLostError),
                    "bytes_checked": checked, "data_lost": lost, "longest_wait_s": failed["at"] - killed,
                    "error": str(error)[:160]}


def _four_writes(channel, timeout_s: float) -> list[float]:
    from gputq.errors import GputqError

    waits, payload = [], np.ones(1 << 16, np.uint8)
    for i in range(4):
        t = time.monotonic()
        try:
            channel.write(f"hung/{i}", payload, {"partition": "r0"}, timeout=timeout_s)
        except GputqError:
            pass
        waits.append(time.monotonic() - t)
    return waits


def stop_writes(timeout_s: float = 0.5, baseline: bool = False) -> dict:
    from gputq.client.clients import UnitClients
    from gputq.transport import get_transport

    with unit_processes(3 if baseline else 2, put_timeout_s=timeout_s) as (config, units):
        with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
            survivor = _put(clients, config, "su-1", "survivor", 8, 1 << 20)
            clients.channel("su-0").call("stats", timeout=5)  # connected before the fault
            units["su-0"].stop()
            waits = _four_writes(clients.channel("su-0"), timeout_s)
            units["su-0"].cont()
            checked, lost = _check(clients, config, "su-1", survivor)
            row = {"scenario": "stop-writes", "fault": f"SIGSTOP su-0; 4 writes with put timeout {timeout_s} s",
                   "detect_s": waits[0], "bytes_checked": checked, "data_lost": lost,
                   "longest_wait_s": max(waits), "four_writes_s": sum(waits)}
            if baseline:  # the transport's channel alone: no loss detection, each write waits
                with get_transport("tcp").connect(units["su-2"].address, token=config.token,
                                                  max_frame_bytes=config.max_frame_bytes, timeout=5) as raw:
                    raw.call("stats", timeout=5)
                    units["su-2"].stop()
                    row["four_writes_transport_only_s"] = sum(_four_writes(raw, timeout_s))
                    units["su-2"].cont()
            return row


def kill_release() -> dict:
    from gputq.client.clients import UnitClients
    from gputq.cluster.controller import Controller
    from gputq.errors import PartialFailureError

    with unit_processes(3) as (config, units):
        controller = Controller(config, heartbeat=False)
        try:
            for name, unit in units.items():
                controller.register_unit(name, unit.address)
            controller.open_partition("r0")
            with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
                blobs = {name: _put(clients, config, name, name, 16, 1 << 20) for name in units}
                units["su-0"].kill()
                checks = [_check(clients, config, n, blobs[n]) for n in ("su-1", "su-2")]
                started = time.monotonic()
                try:
                    result = controller.release_partition("r0")
                except PartialFailureError as exc:
                    result = exc.result
                took = time.monotonic() - started
                left = sum(clients.channel(n).call("stats", timeout=5)["keys"] for n in ("su-1", "su-2"))
            return {"scenario": "kill-release", "fault": "SIGKILL su-0 of 3; release_partition",
                    "detect_s": took, "bytes_checked": sum(c[0] for c in checks),
                    "data_lost": sum(c[1] for c in checks), "keys_left_on_survivors": left,
                    "freed": result["freed"], "unreachable": sorted(result["unreachable"]), "longest_wait_s": took}
        finally:
            controller.close()


def heartbeat(interval_s: float = 0.2, probe_timeout_s: float = 0.5) -> dict:
    from gputq.client.clients import UnitClients
    from gputq.cluster.controller import Controller
    from gputq.errors import PartialFailureError

    with unit_processes(3, heartbeat_interval_s=interval_s, probe_timeout_s=probe_timeout_s) as (config, units):
        controller = Controller(config)
        try:
            for name, unit in units.items():
                controller.register_unit(name, unit.address)
            controller.open_partition("r0")
            with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
                blobs = {name: _put(clients, config, name, name, 8, 1 << 20) for name in units}
                if controller.heartbeat():  # one round first: connected, and all live
                    raise RuntimeError(f"units lost before any fault: {controller.lost_units()}")
                t0 = time.monotonic()
                units["su-0"].kill()
                units["su-1"].stop()
                marked = _wait_lost(controller, {"su-0", "su-1"}, 20)
                checked, lost = _check(clients, config, "su-2", blobs["su-2"])
                t1 = time.monotonic()
                try:
                    controller.release_partition("r0")  # the lost units fail fast
                except PartialFailureError:
                    pass
                release_s = time.monotonic() - t1
                t2 = time.monotonic()
                units["su-1"].cont()
                readmitted = _wait_lost(controller, {"su-0"}, 20)
                deadline = time.monotonic() + 20
                while clients.channel("su-1").call("stats", timeout=5)["keys"] and time.monotonic() < deadline:
                    time.sleep(interval_s / 4)
                replayed = clients.channel("su-1").call("stats", timeout=5)["keys"] == 0
            return {"scenario": "heartbeat", "fault": "SIGKILL su-0 and SIGSTOP su-1 under a "
                                                     f"{interval_s} s heartbeat, probe timeout {probe_timeout_s} s",
                    "detect_s": max(marked["su-0"], marked["su-1"]) - t0,
                    "detect_killed_s": marked["su-0"] - t0, "detect_stopped_s": marked["su-1"] - t0,
                    "readmit_s": readmitted["_done"] - t2, "missed_release_replayed": replayed,
                    "bytes_checked": checked, "data_lost": lost, "longest_wait_s": release_s}
        finally:
            controller.close()


def _wait_lost(controller, expected: set, timeout: float) -> dict:
    """Poll until ``lost_units()`` is exactly ``expected``; the time each unit first appeared."""
    seen: dict = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lost = set(controller.lost_units())
        for unit in lost:
            seen.setdefault(unit, time.monotonic())
        if lost == expected:
            seen["_done"] = time.monotonic()
            return seen
        time.sleep(0.01)
    raise TimeoutError(f"lost units {sorted(controller.lost_units())}, expected {sorted(expected)}")


SCENARIOS = {"kill-mid-read": kill_mid_read, "stop-writes": stop_writes, "kill-release": kill_release,
             "heartbeat": heartbeat}


def main(argv=None) -> int:
    parser = add_json_flag(argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__,
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--serve-unit", metavar="NAME", help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=sorted(SCENARIOS), action="append", help="run only these scenarios")
    parser.add_argument("--baseline", action="store_true",
                        help="stop-writes also times the same writes on a bare transport channel")
    args = parser.parse_args(argv)
    if args.serve_unit:
        _serve_unit(args.serve_unit)
        return 0
    rows = [SCENARIOS[name](baseline=True) if name == "stop-writes" and args.baseline else SCENARIOS[name]()
            for name in (args.only or SCENARIOS)]
    print_header("gputq faults")
    print_table(rows, ["scenario", "detect_s", "bytes_checked", "data_lost", "longest_wait_s"])
    for row in rows:
        extras = {k: v for k, v in row.items()
                  if k not in ("scenario", "detect_s", "bytes_checked", "data_lost", "longest_wait_s")}
        print(f"  {row['scenario']}: {json.dumps(extras, default=str)}")
    if args.json:
        emit_json({"faults": rows})
    return 0 if all(row["data_lost"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
