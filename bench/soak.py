"""Days of training in minutes: the whole loop across namespace hosts, with faults arriving at random.

``python -m bench.soak [--minutes 10] [--seed 1] [--hosts 3] [--json]`` (as root)

Builds ``--hosts`` hosts (:mod:`bench.hosts`), one StorageUnit process and
one Ray node on each (token authentication on), and runs the job
(:mod:`bench.soak_job`) on host 0: rollouts written through the SGLang ingest
path, segments, finalize, the data-parallel split, streamed training on
the other hosts, releases with two rollouts live at a time, again and again.

Meanwhile this harness injects one fault per iteration (all but one in
five), drawn by ``--seed`` from a deck that holds every kind, so each comes
once before any comes twice:

================  ===============================================  =========================
kind              what                                             healed by
================  ===============================================  =========================
``unit-kill``     SIGKILL a unit mid-stream                        a fresh unit, same host
``unit-stop``     SIGSTOP a unit mid-stream                        SIGCONT
``link-cut``      a trainer host's link down mid-stream            link up
``slow-link``     a trainer host's link shaped to ``--slow-rate``  the shaping removed
``partition``     the controller's host cut from one unit's        the routes removed
``trainer-kill``  SIGKILL a trainer rank mid-stream                a new rank (Ray actor)
``writer-kill``   SIGKILL the rollout's writer mid-put             a new writer; rolled again
``arena-full``    a unit's arena filled before a rollout           the filler released
``split-kill``    SIGKILL a unit before the data-parallel split    a fresh unit, same host
================  ===============================================  =========================

A unit killed before the split must be named there
(``unreachable_samples``): its samples are dropped and no trainer meets an error.

Every iteration checks every invariant (:mod:`bench.soak_checks`): the
bytes each trainer consumed equal what was written, each fault surfaces as
a typed error within its deadline and no call hangs, after each release the
units hold exactly the live rollouts' keys and no lease, and every process
(units, master, writer, trainers) stays within the drift bounds of its
baseline. The first violation stops the run: the report names the
iteration and what broke, and the seed is saved to ``soak-failure-<seed>.json``
with the command that replays it. Exit status 1 then, 0 on a clean run
(also where hosts cannot be built: it says why).

To see where a run stands: ``GPUTQ_SOAK_TRACE=1`` prints every request of
the job on stderr, ``kill -USR1`` of the harness prints its threads' stacks,
and a job past twice its phase limit (90 s; ``GPUTQ_SOAK_PHASE_S``) prints
its own.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

from bench.common import add_json_flag, emit_json, print_header, print_table

__all__ = ["KINDS", "Deck", "Injector", "run", "main"]

#: Fault kinds and the phase of the loop they are injected in.
KINDS = {"unit-kill": "train", "unit-stop": "train", "link-cut": "train", "slow-link": "train",
         "partition": "write", "trainer-kill": "train", "writer-kill": "write", "arena-full": "write",
         "split-kill": "split"}
_NONE_EVERY = 5  # one iteration in five runs without a fault: the steady state is checked too
_TOKEN = "token-of-the-soak"


class Deck:
    """The seeded fault schedule: every kind of ``kinds`` (and a fault-free turn) once per shuffled round."""

    def __init__(self, kinds, rng: random.Random):
        self._kinds, self._rng, self._cards = list(kinds), rng, []

    def draw(self) -> str | None:
        if not self._cards:
            rounds = max(1, len(self._kinds) // (_NONE_EVERY - 1))
            self._cards = self._kinds + [None] * rounds
            self._rng.shuffle(self._cards)
            if self._cards[0] is None and len(self._cards) > 1:  # a kind first, so a short run sees them all
                self._cards.append(self._cards.pop(0))
        return self._cards.pop(0)


class Injector:
    """Injects the faults the deck draws, at the phase each belongs to, and heals them on its timer."""

    def __init__(self, hosts, units: dict, unit_config: dict, args, rng: random.Random):
        self.hosts, self.units, self.unit_config, self.args, self.rng = hosts, units, unit_config, args, rng
        self.deck = Deck(args.kinds, rng)
        self._kind: str | None = None
        self._fault: dict = {}
        self._thread: threading.Thread | None = None

    def phase(self, msg: dict) -> dict:
        """The answer to the job's ``phase``: the fault it will meet (injected in a timer thread)."""
        if msg["phase"] == "write":
            self._kind = self.deck.draw()
        kind = self._kind
        if kind is None or KINDS[kind] != msg["phase"]:
            return {"fault": None}
        self._kind = None
        fault = self._fault = {"kind": kind, **self._target(kind, msg.get("pids", {}))}
        if kind == "split-kill":  # dead before the job asks which samples it can read
            fault["injected_at"] = time.monotonic()
            self.units[fault["unit"]].kill()
        if kind != "arena-full":  # the job fills the arena itself
            self._thread = threading.Thread(target=self._inject_and_heal, args=(fault,), daemon=True)
            self._thread.start()
        return {"fault": kind, **{k: v for k, v in fault.items() if k in ("unit", "host")}}

    def _target(self, kind: str, pids: dict) -> dict:
        trainers = sorted(int(h) for h in pids.get("trainers", {}))
        if kind in ("unit-kill", "unit-stop", "arena-full", "split-kill"):
            return {"unit": f"su-{self.rng.randrange(self.hosts.n)}"}
        if kind in ("link-cut", "slow-link", "partition"):
            host = self.rng.randrange(1, self.hosts.n)
            return {"host": host, "unit": f"su-{host}"}
        if kind == "trainer-kill":
            host = self.rng.choice(trainers)
            return {"host": host, "pid": pids["trainers"][str(host)]}
        return {"pid": pids["writer"]}

    def _inject_and_heal(self, fault: dict) -> None:
        kind = fault["kind"]
        unit = self.units.get(fault.get("unit"))
        if kind != "split-kill":
            time.sleep(self.rng.uniform(*self.args.delay_s) if kind != "partition" else 0.0)
            fault["injected_at"] = time.monotonic()
        if kind == "unit-kill":
            unit.kill()
        elif kind == "unit-stop":
            unit.stop()
        elif kind == "link-cut":
            self.hosts.cut(fault["host"])
        elif kind == "slow-link":
            self.hosts.shape(fault["host"], self.args.slow_rate)
        elif kind == "partition":
            self.hosts.partition(0, fault["host"])
        elif kind != "split-kill":  # trainer-kill, writer-kill: Ray sees the process die; the job makes a new one
            os.kill(fault["pid"], signal.SIGKILL)
            return
        time.sleep(self.args.hold_s)
        self._heal(fault, unit)

    def _heal(self, fault: dict, unit) -> None:
        from bench.faults import UnitProcess
        from gputq.config import GputqConfig

        kind = fault["kind"]
        if kind in ("unit-kill", "split-kill"):
            unit.close()
            name, host = fault["unit"], int(fault["unit"].split("-")[1])
            fresh = UnitProcess(name, GputqConfig(enabled=True, host=self.hosts.addresses[host], **self.unit_config),
                                wrap=lambda argv: self.hosts.command(host, argv))
            fault["address"] = fresh.address
            self.units[name] = fresh
        elif kind == "unit-stop":
            unit.cont()
        elif kind == "link-cut":
            self.hosts.restore(fault["host"])
        elif kind == "slow-link":
            self.hosts.unshape(fault["host"])
        elif kind == "partition":
            self.hosts.partition(0, fault["host"], heal=True)
        fault["healed_at"] = time.monotonic()

    def heal(self) -> dict:
        """The answer to the job's ``heal``: wait for the fault's heal; what it was and when it came."""
        fault, self._fault = self._fault, {}
        if self._thread is not None:
            self._thread.join(self.args.hold_s + 120)
            if self._thread.is_alive():
                raise RuntimeError(f"healing {fault} did not finish")
            self._thread = None
        if not fault or fault["kind"] == "arena-full":
            return {}
        return {k: v for k, v in fault.items() if k in ("kind", "unit", "host", "injected_at", "address")}

    def usage(self) -> dict:
        """Each unit's resources, and its pid (a restarted unit is a new process, with a baseline of its own)."""
        from bench.soak_roles import proc_usage

        return {"units": {name: proc_usage(unit.pid) for name, unit in self.units.items()},
                "pids": {name: unit.pid for name, unit in self.units.items()}}


# -- the run ---------------------------------------------------------------------------

def _settings(args) -> dict:
    """What the job gets: the loop's shape, timeouts, deadlines and bounds (all from the flags)."""
    timeouts = {"read_timeout_s": 3.0, "put_timeout_s": 2.0, "control_timeout_s": 2.0,
                "heartbeat_interval_s": 0.5, "probe_timeout_s": 1.0, "reservation_timeout_s": 8.0}
    shape = {"sessions": args.sessions, "steps": 3, "tokens": args.tokens, "layers": 8, "topk": 4, "experts": 64,
             "dtype": args.dtype, "pace_s": 0.02, "compute_s": 0.1, "micro_batch": 1}
    calls_s = args.sessions * shape["steps"] * shape["pace_s"]
    # A unit fault surfaces by the heartbeat at the latest; a killed process by Ray at once.
    unit = timeouts["heartbeat_interval_s"] + timeouts["probe_timeout_s"] + args.slack_s
    deadlines = {"unit-kill": unit, "unit-stop": unit, "link-cut": unit, "partition": unit, "slow-link": None,
                 "split-kill": timeouts["probe_timeout_s"] + args.slack_s,
                 "trainer-kill": args.slack_s, "writer-kill": args.slack_s,
                 "arena-full": timeouts["put_timeout_s"] + calls_s + args.slack_s}
    return {"shape": shape, "timeouts": timeouts, "deadlines": deadlines, "seed": args.seed, "hosts": args.hosts,
            "iterations": args.iterations, "seconds": args.minutes * 60, "warmup": 2, "settle_s": 20.0,
            # a lease a killed reader left expires after twice the read timeout (a reservation after its own)
            "drain_s": max(2 * timeouts["read_timeout_s"], timeouts["reservation_timeout_s"]) + args.slack_s,
            "sabotage": args.sabotage, "bounds": {"rss_bytes": args.rss_bound_mib << 20, "fds": args.fd_bound,
                                                  "threads": args.thread_bound}}


def _serve(job: subprocess.Popen, injector: Injector, minutes: float) -> dict:
    """Answer the job's requests until it says ``done``; its report. Each iteration done is shown on stderr
    (with ``--json`` too: stdout carries the JSON), against the run's ``minutes``."""
    from bench.soak_job import MARK

    lines: queue.Queue = queue.Queue()

    def read() -> None:  # a thread reads: select on a buffered pipe misses lines already read into the buffer
        for line in job.stdout:
            lines.put(line)
        lines.put("")  # the job ended

    threading.Thread(target=read, daemon=True).start()
    started = time.monotonic()
    deadline = started + minutes * 60 + 600  # the last iteration, then the job's own checks and teardown
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = ""
        if not line:
            raise RuntimeError(f"the soak job ended or went silent (exit code {job.poll()})")
        if not line.startswith(MARK):
            continue  # Ray's own lines
        msg = json.loads(line[len(MARK):])
        event = msg["event"]
        if event == "done":
            return msg["report"]
        if event == "iteration":
            print(f"soak: iteration {msg['iteration']} done at {(time.monotonic() - started) / 60:.1f} of "
                  f"{minutes:g} min, {msg['verified']} samples verified, faults {msg['faults']}", file=sys.stderr,
                  flush=True)
            continue
        answer = {"phase": injector.phase, "heal": lambda _: injector.heal(),
                  "usage": lambda _: injector.usage()}[event](msg)
        job.stdin.write(json.dumps(answer) + "\n")
        job.stdin.flush()


def run(args) -> dict:
    """Build the hosts, units and Ray, run the job under faults, tear all down; the job's report."""
    from bench.hosts import GCS_PORT, ROOT, Hosts, start_ray, units_on_hosts

    settings = _settings(args)
    capacity = args.capacity_mib << 20
    unit_config = {"transport": "tcp", "unit_capacity_bytes": capacity, "token": _TOKEN, **settings["timeouts"]}
    with Hosts(args.hosts, shm_bytes=capacity + (256 << 20)) as hosts:
        units = units_on_hosts(hosts, range(args.hosts), **unit_config)
        try:
            # Ray may not call a node dead during a fault's hold (a cut link, a partition).
            env = start_ray(hosts, health={"RAY_health_check_period_ms": "1000",
                                           "RAY_health_check_failure_threshold": "60"})
            settings.update(addresses={name: unit.address for name, unit in units.items()}, token=_TOKEN,
                            ray_address=f"{hosts.addresses[0]}:{GCS_PORT}")
            job = hosts.popen(0, [sys.executable, "-m", "bench.soak_job", json.dumps(settings)], cwd=ROOT, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            injector = Injector(hosts, units, unit_config, args, random.Random(args.seed))
            report = _serve(job, injector, args.minutes)
            job.wait(60)
        finally:
            for unit in units.values():
                unit.close()
    return {**report, "seed": args.seed, "hosts": args.hosts, "kinds": list(args.kinds)}


def _print(report: dict) -> None:
    rows = [{"fault": kind, "injected": report["faults"].get(kind, 0),
             "longest_detect_s": report["detect_s"].get(kind)} for kind in report["kinds"]]
    print_table(rows, ["fault", "injected", "longest_detect_s"])
    drift = report["drift"]
    worst = {what: max((d[what] for d in drift.values()), default=0) for what in ("rss", "fds", "threads")}
    print(f"iterations {report['iterations']} in {report['seconds']:.0f} s; samples verified "
          f"{report['samples_verified']} ({report['bytes_verified'] / 2**20:.1f} MiB); wrong bytes "
          f"{report['wrong_bytes']}; leaked keys {report['leaked_keys']}; rolled again {report['rolled_again']}; "
          f"dropped before the split {report['dropped_samples']}")
    print(f"largest drift over a baseline: RSS {worst['rss'] / 2**20:+.1f} MiB, descriptors {worst['fds']:+d}, "
          f"threads {worst['threads']:+d}; errors seen {report['errors_seen']}")
    for kind, caught in report.get("sabotage", {}).items():
        print(f"sabotage {kind}: {'caught: ' + caught if caught else 'NOT CAUGHT'}")
    if report["violation"]:
        print(f"VIOLATION at iteration {report['violation']['iteration']}: {report['violation']['what']}")


def _save_failure(report: dict, argv: list) -> str:
    path = f"soak-failure-{report['seed']}.json"
    with open(path, "w") as out:
        json.dump({"seed": report["seed"], "violation": report["violation"],
                   "command": "python -m bench.soak " + " ".join(argv)}, out, indent=1)
    return path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the loop runs")
    parser.add_argument("--iterations", type=int, default=1_000_000, help="stop after this many iterations")
    parser.add_argument("--seed", type=int, default=1, help="draws the fault schedule and the rollouts")
    parser.add_argument("--hosts", type=int, default=3, help="namespace hosts, a unit and a Ray node each (>= 3)")
    parser.add_argument("--kinds", type=lambda s: s.split(","), default=list(KINDS),
                        help=f"comma-separated fault kinds (default: all of {','.join(KINDS)})")
    parser.add_argument("--sessions", type=int, default=8, help="sessions per rollout (3 model calls each)")
    parser.add_argument("--tokens", type=int, default=1024, help="mean tokens per model call")
    parser.add_argument("--capacity-mib", type=int, default=64, help="each unit's arena")
    parser.add_argument("--dtype", choices=("uint8", "uint16", "int32", "packed"), default="uint16",
                        help="stored expert IDs (packed: 6 bits, the rollout's 64 experts)")
    parser.add_argument("--hold-s", type=float, default=6.0, help="how long a fault lasts before it heals")
    parser.add_argument("--delay-s", type=lambda s: tuple(map(float, s.split(","))), default=(0.05, 0.3),
                        help="a fault comes this long into its phase (uniform in LO,HI)")
    parser.add_argument("--slow-rate", default="8mbit", help="the slow link's rate (tc tbf)")
    parser.add_argument("--slack-s", type=float, default=3.0, help="added to each detection deadline")
    parser.add_argument("--rss-bound-mib", type=int, default=64, help="resident memory drift allowed")
    parser.add_argument("--fd-bound", type=int, default=8, help="open-descriptor drift allowed")
    parser.add_argument("--thread-bound", type=int, default=4, help="thread drift allowed")
    # The tests' mutations: after the loop, one iteration per kind with that invariant broken on purpose.
    parser.add_argument("--sabotage", type=lambda s: s.split(","), default=[], help=argparse.SUPPRESS)
    return add_json_flag(parser)


def main(argv=None) -> int:
    from bench.hosts import unavailable

    argv = sys.argv[1:] if argv is None else list(argv)
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 prints where a stuck harness waits
    parser = _parser()
    args = parser.parse_args(argv)
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown or args.hosts < 3 or args.minutes <= 0 or args.iterations < 1:
        parser.error(f"unknown fault kinds {unknown}" if unknown else "--hosts >= 3, --minutes > 0, --iterations >= 1")
    reason = unavailable()
    if reason is not None:
        print(f"skipped: {reason}")
        if args.json:
            emit_json({"bench": "soak", "skipped": reason})
        return 0
    print_header("soak: the loop under faults", hosts=args.hosts, minutes=args.minutes, seed=args.seed,
                 kinds=",".join(args.kinds), cpus=os.cpu_count())
    report = run(args)
    if report["violation"]:
        report["saved"] = _save_failure(report, argv)
    _print(report)
    if args.json:
        emit_json({"bench": "soak", **report})
    return 1 if report["violation"] else 0


if __name__ == "__main__":
    sys.exit(main())
