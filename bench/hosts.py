"""Many hosts on one machine: network namespaces joined by veth pairs to a bridge, one Ray node each.

:class:`Hosts` builds ``n`` hosts. Each has its own network namespace with
one interface ``eth0`` and its own address on a private /24, its own
hostname (a UTS namespace) and its own ``/dev/shm`` (a tmpfs in a private
mount namespace). A small init process per host holds those namespaces;
every process started on the host (:meth:`Hosts.popen`) enters all three,
so processes of one host share its /dev/shm as on a real machine. The
bridge sits in a namespace of its own, the *switch*, so nothing of the
harness touches the machine's own network stack: traffic
flows only between namespaces the harness made, and deleting them deletes
every veth with them. Cutting a host's link (:meth:`Hosts.cut`) downs its
port on the switch; :meth:`Hosts.partition` cuts two hosts apart only;
:meth:`Hosts.shape` rate-limits what a host sends with ``tc``.

Teardown (:meth:`Hosts.close`, the context manager, or SIGTERM/SIGINT
while it is open) kills every process in the hosts' namespaces by id,
deletes the namespaces and the harness's temporary folder (Ray's temp dir
included, with any ``ray_current_cluster`` pointer), and
:meth:`Hosts.leftovers` says what, if anything, survived.

Names carry a random tag, so parallel runs do not clash. Building hosts
needs CAP_NET_ADMIN and CAP_SYS_ADMIN; :func:`unavailable` says why not.

:func:`start_ray` starts one Ray node per host: a head on host 0,
``ray start --address`` on the others. Token authentication is on
(``RAY_AUTH_MODE=token``, one ``RAY_AUTH_TOKEN`` for every node and
driver). Every Ray process of the cluster keeps its files, its
``ray_current_cluster`` pointer included, under the hosts' temp folder
(``RAY_TMPDIR`` and ``--temp-dir``), which teardown removes: the machine's
default ``/tmp/ray`` is neither read nor written, and no other Ray user of
the machine is disturbed. Nodes go with the hosts (every process in their
namespaces is killed by id), never with ``ray stop``, which would stop
every Ray of the machine.

:func:`driver` builds the hosts, starts Ray on them, runs a job (a
benchmark's own module) on host 0, the master, and tears all down;
:func:`bench_on_hosts` wraps it for a benchmark's ``main`` (skip with the
reason, Ctrl-C). The tests in ``tests/cluster`` and ``python -m bench.cluster``
and ``python -m bench.memory --hosts N`` share this one harness.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from bench.faults import UnitProcess
from gputq.config import GputqConfig

__all__ = ["Hosts", "unavailable", "netns_names", "units_on_hosts", "start_ray", "ray_env", "wait_nodes", "ray_logs",
           "driver", "processes_naming", "ray_pointer", "bench_on_hosts", "run_torn_down", "TEARDOWN_GRACE_S", "ROOT",
           "GCS_PORT"]

_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_KILL_S = 10.0
#: Seconds a command that builds hosts has, after its SIGTERM, to tear them down before it is killed.
TEARDOWN_GRACE_S = 60.0
_PREFIX = "gqh"
# A host's init: set its hostname, mount its /dev/shm, say so, and hold the namespaces.
_INIT = ('hostname "$0" && mount -t tmpfs -o size="$1",mode=1777 gputq-shm /dev/shm && echo ready '
         '&& exec sleep 2147483647')
#: The repository root: the working directory (and ``PYTHONPATH``) of what runs on the hosts.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The head's GCS port, inside host 0's own network namespace (nothing else listens there).
GCS_PORT = 6379
# Node death is noticed after period x threshold (Ray's defaults: 3 s x 5).
_HEALTH = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4",
           "RAY_health_check_timeout_ms": "500"}


def units_on_hosts(hosts: "Hosts", on: Sequence[int], **config) -> dict[str, UnitProcess]:
    """A StorageUnit process ``su-<i>`` on each host ``i`` of ``on``, bound to that host's address.

    ``config`` holds the other :class:`~gputq.config.GputqConfig` fields
    (transport, capacity, token); nothing starts until each unit's ``address``
    or ``start`` is asked for (see :class:`bench.faults.UnitProcess`).
    """
    return {f"su-{i}": UnitProcess(f"su-{i}", GputqConfig(enabled=True, host=hosts.addresses[i], **config),
                                   wrap=lambda argv, i=i: hosts.command(i, argv)) for i in on}


def _effective_caps() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def unavailable() -> str | None:
    """Why hosts cannot be built here (for ``pytest.skip``), or ``None``."""
    caps = _effective_caps()
    if not caps >> _CAP_NET_ADMIN & 1:
        return "needs CAP_NET_ADMIN (run as root) to create network namespaces and veth pairs"
    if not caps >> _CAP_SYS_ADMIN & 1:
        return "needs CAP_SYS_ADMIN (run as root) for a private hostname and /dev/shm per host"
    missing = [tool for tool in ("ip", "unshare", "nsenter", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (iproute2, util-linux)"
    return None


def netns_names() -> set[str]:
    """The network namespaces that exist now (``ip netns list``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """``n`` hosts with their own network stack, address, hostname and /dev/shm.

    Parameters
    ----------
    n : int
        How many hosts (``0 .. n-1``).
    shm_bytes : int
        Size of each host's ``/dev/shm`` (a tmpfs: pages count only when written).

    Attributes
    ----------
    tag : str
        The random part of every name (namespaces ``<tag>-h0``, ..., ``<tag>-sw``).
    addresses : list of str
        Host ``i``'s IPv4 address.
    hostnames : list of str
        Host ``i``'s hostname, as its processes see it.
    tmp : str
        A private temporary folder, removed at teardown (give Ray its temp dir here).
    """

    def __init__(self, n: int, shm_bytes: int = 512 << 20):
        if n < 1:
            raise ValueError("at least one host")
        self.n = n
        self.shm_bytes = int(shm_bytes)
        self.tag = f"{_PREFIX}{secrets.token_hex(3)}"
        net = f"10.{secrets.randbelow(190) + 64}.{secrets.randbelow(256)}"
        self.addresses = [f"{net}.{i + 1}" for i in range(n)]
        self.hostnames = [f"{self.tag}-host{i}" for i in range(n)]
        self.namespaces = [f"{self.tag}-h{i}" for i in range(n)]
        self.switch = f"{self.tag}-sw"
        self.tmp = ""
        self._procs: list[subprocess.Popen] = []
        self._inits: list[subprocess.Popen] = []
        self._closed = False
        self._signals: dict = {}

    # -- building and tearing down --

    def __enter__(self) -> "Hosts":
        self._catch_signals()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix=f"{self.tag}-")
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            _ip("netns", "add", ns)
            _ip("-n", self.switch, "link", "add", f"port{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            init = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "--propagation",
                                     "private", "sh", "-c", _INIT, self.hostnames[i], str(self.shm_bytes)],
                                    stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
            self._inits.append(init)
            if init.stdout.readline() != b"ready\n":
                raise RuntimeError(f"host {i} did not start (exit code {init.wait(_KILL_S)})")

    def _catch_signals(self) -> None:
        # SIGTERM would end the process without unwinding: turn it into an exception that does.
        def interrupted(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        try:
            self._signals = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
        except ValueError:  # not the main thread: the caller's own handling applies
            self._signals = {}

    def pids(self) -> list[int]:
        """Every process in the hosts' (and the switch's) network namespaces."""
        pids = []
        for ns in [*self.namespaces, self.switch]:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
            pids += [int(p) for p in out.split()]
        return pids

    def kill(self, host: int) -> list[int]:
        """SIGKILL every process on ``host`` but its init (a crashed machine whose network stays); their pids."""
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[host]], capture_output=True, text=True).stdout
        pids = [int(p) for p in out.split() if int(p) != self._inits[host].pid]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def _kill_all(self) -> None:
        # Only processes inside our namespaces: started by this harness (or by those it started).
        deadline = time.monotonic() + _KILL_S
        while True:
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} in {self.tag}'s namespaces survived SIGKILL")
            time.sleep(0.05)
        for proc in [*self._procs, *self._inits]:
            proc.wait(_KILL_S)
            if proc.stdout is not None:
                proc.stdout.close()

    def close(self) -> None:
        """Kill every process on the hosts, delete the namespaces and the temp folder. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            existing = netns_names()
            try:
                if self.switch in existing or any(ns in existing for ns in self.namespaces):
                    self._kill_all()
            finally:  # the namespaces and files go even if a process would not
                for ns in [*self.namespaces, self.switch]:
                    if ns in existing:
                        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
                if self.tmp:
                    shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            for sig, previous in self._signals.items():
                signal.signal(sig, previous)

    def leftovers(self) -> dict:
        """What of this harness still exists: namespaces, processes, the temp folder (all empty after close)."""
        names = netns_names()
        return {
            "namespaces": sorted(n for n in names if n.startswith(self.tag)),
            "processes": [p.pid for p in [*self._procs, *self._inits] if p.poll() is None],
            "tmp": [self.tmp] if self.tmp and os.path.exists(self.tmp) else [],
        }

    # -- running things on a host --

    def command(self, host: int, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """``argv`` as it runs on ``host``: in its network, UTS and mount namespaces (nsenter execs it).

        It runs in ``cwd`` (default: this process's working directory): entering
        a mount namespace would otherwise start it in the init's, ``/``.
        """
        return ["nsenter", "-t", str(self._inits[host].pid), "--net", "--uts", "--mount",
                f"--wd={cwd or os.getcwd()}", "--", *argv]

    def popen(self, host: int, argv: Sequence[str], cwd: str | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in ``cwd`` (other ``subprocess.Popen`` keyword arguments pass through)."""
        if self._closed:
            raise RuntimeError("hosts are torn down")
        proc = subprocess.Popen(self.command(host, argv, cwd), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: int, argv: Sequence[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` to its end (output captured as text; ``stderr=None`` lets it through)."""
        proc = self.popen(host, argv, **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **kwargs})
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise RuntimeError(f"{argv} on host {host} ran past {timeout} s; stderr: {(err or '')[-2000:]}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # -- links --

    def cut(self, host: int) -> None:
        """Take ``host``'s link down (its port on the switch): its packets go nowhere."""
        _ip("-n", self.switch, "link", "set", f"port{host}", "down")

    def restore(self, host: int) -> None:
        """Bring ``host``'s link back up."""
        _ip("-n", self.switch, "link", "set", f"port{host}", "up")

    def shape(self, host: int, rate: str) -> None:
        """Limit what ``host`` sends to ``rate`` (``tc`` syntax: ``"100mbit"``), a token bucket on its eth0."""
        subprocess.run(["tc", "-n", self.namespaces[host], "qdisc", "replace", "dev", "eth0", "root", "tbf",
                        "rate", rate, "burst", "64kb", "latency", "50ms"], check=True, capture_output=True)

    def unshape(self, host: int) -> None:
        """Remove :meth:`shape`'s limit from ``host``."""
        subprocess.run(["tc", "-n", self.namespaces[host], "qdisc", "del", "dev", "eth0", "root"],
                       check=True, capture_output=True)

    def partition(self, a: int, b: int, *, heal: bool = False) -> None:
        """Drop every packet between hosts ``a`` and ``b`` (blackhole routes on both); the others still reach both.

        ``heal=True`` removes the routes again.
        """
        for here, there in ((a, b), (b, a)):
            _ip("-n", self.namespaces[here], "route", "del" if heal else "add", "blackhole",
                f"{self.addresses[there]}/32")


# -- Ray across the hosts ------------------------------------------------------
def ray_env(hosts: Hosts, token: str, health: dict | None = None) -> dict:
    """The environment of every Ray process and driver of ``hosts``' cluster.

    ``health`` replaces the node health-check settings (``RAY_health_check_*``);
    by default a node is declared dead about 2 s after it stops answering.
    """
    return dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_TMPDIR=hosts.tmp,
                RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=ROOT, **(_HEALTH if health is None else health))


def start_ray(hosts: Hosts, *, num_cpus: int = 1, object_store_bytes: int = 80 << 20,
              health: dict | None = None) -> dict:
    """Start a node on every host (each with a ``host<i>`` resource); return the drivers' environment.

    The nodes start in the background; a driver waits for them to be alive
    (:func:`wait_nodes`). Each node has its own temp dir, ``<hosts.tmp>/ray<i>``:
    nodes started at once in one dir race for the same socket names. Their
    logs go to ``<hosts.tmp>/ray-host<i>.log``. ``health``: see :func:`ray_env`.
    """
    env = ray_env(hosts, secrets.token_hex(16), health)
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    for i in range(hosts.n):
        role = (["--head", "--include-dashboard=false", f"--port={GCS_PORT}"] if i == 0
                else [f"--address={hosts.addresses[0]}:{GCS_PORT}"])
        with open(os.path.join(hosts.tmp, f"ray-host{i}.log"), "w") as log:
            hosts.popen(i, [ray, "start", *role, f"--node-ip-address={hosts.addresses[i]}",
                            f"--num-cpus={num_cpus}", "--num-gpus=0", f"--resources={json.dumps({f'host{i}': 1})}",
                            f"--object-store-memory={object_store_bytes}", f"--temp-dir={hosts.tmp}/ray{i}",
                            "--disable-usage-stats", "--block"],
                        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return env


def wait_nodes(ray, alive: int, limit_s: float) -> float:
    """Wait (in a driver) until exactly ``alive`` nodes are alive; when that was (monotonic)."""
    deadline = time.monotonic() + limit_s
    while sum(n["Alive"] for n in ray.nodes()) != alive:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not {alive} alive nodes within {limit_s} s: {ray.nodes()}")
        time.sleep(0.1)
    return time.monotonic()


def ray_logs(hosts: Hosts, tail: int = 2000) -> str:
    """The end of every node's log (for an error message when a driver fails)."""
    parts = []
    for i in range(hosts.n):
        try:
            with open(os.path.join(hosts.tmp, f"ray-host{i}.log")) as log:
                parts.append(f"--- ray on host {i}:\n{log.read()[-tail:]}")
        except OSError:
            continue
    return "\n".join(parts)


def driver(n: int, module: str, argv: Sequence[str], *, limit_s: float, shm_bytes: int = 512 << 20,
           object_store_bytes: int = 80 << 20) -> dict:
    """Build ``n`` hosts with a Ray node each, run ``python -m module *argv`` on host 0, tear all down.

    The job gets ``--ray-address`` (the head's) appended, inherits stderr
    (progress shows), and must end its stdout with one JSON line, returned
    here with ``"leftovers"`` added: what of the hosts survived teardown
    (:meth:`Hosts.leftovers`, any Ray process naming the hosts' temp folder,
    the machine's Ray pointer if it changed), all empty when nothing did,
    and ``"harness"``: seconds to build the hosts and to tear them down.

    Raises
    ------
    RuntimeError
        If the job fails or prints no JSON line (the nodes' logs are in the message).
    """
    pointer = ray_pointer()
    started = time.monotonic()
    with Hosts(n, shm_bytes) as hosts:
        built = time.monotonic()
        print(f"bench.hosts: {n} hosts up, tag {hosts.tag}, temp folder {hosts.tmp}", file=sys.stderr, flush=True)
        env = start_ray(hosts, object_store_bytes=object_store_bytes)
        done = hosts.run(0, [sys.executable, "-m", module, *argv, "--ray-address", f"{hosts.addresses[0]}:{GCS_PORT}"],
                         limit_s, cwd=ROOT, env=env, stderr=None)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines or not lines[-1].startswith("{"):
            raise RuntimeError(f"{module} on host 0 exited {done.returncode}; its output ends:\n"
                               f"{done.stdout[-3000:]}\n{ray_logs(hosts)}")
        result = json.loads(lines[-1])
        tmp, ending = hosts.tmp, time.monotonic()
    result["harness"] = {"build_s": built - started, "teardown_s": time.monotonic() - ending}
    result["leftovers"] = {**hosts.leftovers(), "ray_processes": processes_naming(tmp),
                           "ray_pointer": [] if ray_pointer() == pointer else [pointer[0]]}
    return result


def bench_on_hosts(bench: str, n: int, argv: Sequence[str], *, json_line: bool, **kwargs) -> dict | None:
    """:func:`driver` for ``python -m bench.<bench>``'s main: its job's result, torn down.

    Where hosts cannot be built it prints why (and, with ``json_line``, a
    ``{"bench", "skipped"}`` JSON line) and returns ``None``. Ctrl-C tears
    the hosts down, then exits with status 130. ``kwargs`` go to :func:`driver`.
    """
    reason = unavailable()
    if reason is not None:
        print(f"skipped: {reason}")
        if json_line:
            print(json.dumps({"bench": bench, "skipped": reason}), flush=True)
        return None
    try:
        return driver(n, f"bench.{bench}", argv, **kwargs)
    except KeyboardInterrupt:
        print("interrupted: the hosts are torn down", file=sys.stderr)
        sys.exit(130)


def run_torn_down(argv: Sequence[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout)`` for a command that builds hosts.

    Past ``timeout`` the command gets SIGTERM, which its :class:`Hosts` turn
    into an orderly teardown, and only :data:`TEARDOWN_GRACE_S` later
    SIGKILL: ``subprocess.run`` kills at once, and a command killed so
    leaves its namespaces, Ray nodes and temp folder behind. Other keyword
    arguments go to ``subprocess.Popen``.

    Raises
    ------
    subprocess.TimeoutExpired
        Once the command ended, its output attached.
    """
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                out, err = proc.communicate(timeout=TEARDOWN_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def ray_pointer() -> tuple[str, int | None]:
    """The machine's default ``ray_current_cluster`` pointer and its mtime (``None``: absent).

    The hosts' nodes keep theirs under their temp folder: this one must not change.
    """
    path = os.path.join(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir(), "ray", "ray_current_cluster")
    try:
        return path, os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return path, None


def processes_naming(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (every Ray process of a node names its temp dir)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if text.encode() in cmdline.read():
                    found.append(int(pid))
        except OSError:  # gone meanwhile
            continue
    return found
