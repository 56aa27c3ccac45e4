"""The soak's job, on host 0 (the master): the training loop, run again and again while faults come and go.

``bench.soak`` starts it on host 0 of its namespace hosts, as a Ray driver,
with the units' addresses. Per iteration ``i``:

1. **write**: rollout ``r<i>`` through the SGLang ingest path by the rollout
   actor on the master; a failed rollout is rolled again once, after the
   fault healed;
2. **split**: the samples on units lost now are dropped
   (``unreachable_samples``), the rest split over the data-parallel ranks;
3. **train**: a trainer actor on every other host streams its shard;
   every sample consumed is checked against the writer's digest;
4. **release**: ``r<i-1>`` is released (two rollouts are live while ``r<i>``
   is written and trained, as in asynchronous training), then the keys,
   leases and every process's resources are checked.

Before each phase it asks the harness (a line on stdout, the answer on
stdin) which fault to expect; after it, the harness heals the fault and says
when it was injected. The job itself fills a unit's arena (``arena-full``)
and heals it. Every invariant (:mod:`bench.soak_checks`) is checked on every
iteration; the first violation ends the run. The last stdout line is the
report, as JSON.
"""

from __future__ import annotations

import copy
import faulthandler
import itertools
import json
import os
import sys
import threading
import time

import numpy as np

from bench.soak_checks import LEFT_ON_UNITS, Bounds, drift, key_violations, late_surface, untyped_errors, wrong_samples
from bench.soak_roles import RolloutRole, TrainerRole, error_report, usage

__all__ = ["MARK", "Soak", "main"]

#: Starts the job's own lines on stdout (Ray writes some lines there too).
MARK = "@gputq-soak "
#: The longest any phase may take before the soak calls it a hang.
PHASE_S = float(os.environ.get("GPUTQ_SOAK_PHASE_S", 90.0))
_FILLER = "soak-filler"


class Harness:
    """The job's side of the line protocol with ``bench.soak``."""

    def ask(self, event: str, **data) -> dict:
        self.tell(event, **data)
        line = sys.stdin.readline()
        if not line:
            raise RuntimeError("the harness went away")
        return json.loads(line)

    def tell(self, event: str, **data) -> None:
        # Each message is progress: the watchdog (see main) starts over, so only a job silent past twice
        # a phase's limit prints its threads' stacks.
        faulthandler.dump_traceback_later(2 * PHASE_S, repeat=True)
        print(MARK + json.dumps({"event": event, **data}), flush=True)
        if os.environ.get("GPUTQ_SOAK_TRACE"):
            print(f"soak job {time.monotonic():.2f}: {event} {data}", file=sys.stderr, flush=True)


class LostWatch:
    """When the controller marked units lost (polled in a thread: the heartbeat decides)."""

    def __init__(self, controller, interval_s: float = 0.02):
        self._controller, self._interval_s = controller, interval_s
        self.marks: list[tuple[str, float]] = []  # (unit, when it went from live to lost)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-lost-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        lost_before: set = set()
        while not self._stop.wait(self._interval_s):
            lost = set(self._controller.lost_units())
            self.marks += [(unit, time.monotonic()) for unit in sorted(lost - lost_before)]
            lost_before = lost

    def marked_since(self, since: float) -> float | None:
        """The earliest lost mark at or after ``since``."""
        times = [t for _, t in list(self.marks) if t >= since]
        return min(times) if times else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Violation(Exception):
    """An invariant broke: the soak stops here."""


class Soak:
    """The loop and its bookkeeping (see the module docstring)."""

    def __init__(self, ray, config, args: dict, harness: Harness):
        from gputq.cluster.controller import Controller

        self.ray, self.config, self.args, self.harness = ray, config, args, harness
        self.shape = args["shape"]
        self.controller = Controller(config)
        for unit, address in args["addresses"].items():
            self.controller.register_unit(unit, address)
        self.watch = LostWatch(self.controller)
        self.bounds = Bounds(**args["bounds"])
        self.report = {"iterations": 0, "faults": {}, "detect_s": {}, "bytes_verified": 0, "samples_verified": 0,
                       "wrong_bytes": 0, "leaked_keys": 0, "rolled_again": 0, "dropped_samples": 0,
                       "errors_seen": {}, "drift": {}, "violation": None}
        self.baselines: dict[str, tuple[int, dict]] = {}  # process name -> (its pid, its baseline usage)
        self.live: dict[str, dict] = {}  # partition -> {"samples", "written_at"}
        self.opened: dict[int, list[str]] = {}  # iteration -> the rollouts it opened
        self._held_fds: list[int] = []
        self.restarted: dict[str, float] = {}  # unit -> when it came back empty
        self.writer = self._actor(RolloutRole, 0)
        self.trainers = {h: self._actor(TrainerRole, h) for h in range(1, args["hosts"])}

    # -- actors --

    def _actor(self, role, host: int):
        actor = self.ray.remote(num_cpus=0, max_restarts=0)(role).options(
            resources={f"host{host}": 0.01}).remote(self.config, self.shape)
        return actor, self.ray.get(actor.pid.remote(), timeout=PHASE_S)

    def _clients(self):
        """Channels to the units as the controller knows them now (for one use; close them)."""
        from gputq.client.clients import UnitClients

        return UnitClients(self.controller.membership(), self.config)

    def _get(self, refs, what: str):
        try:
            return self.ray.get(refs, timeout=PHASE_S)
        except self.ray.exceptions.GetTimeoutError:
            raise Violation(f"{what} hung: no answer within {PHASE_S:.0f} s") from None

    # -- one iteration --

    def iteration(self, i: int, sabotage: str | None = None) -> None:
        """One pass of the loop; ``sabotage`` breaks one invariant on purpose (see :meth:`sabotaged`)."""
        written = self._write(i)
        if written is not None:
            self._train(i, written, sabotage == "bytes")
        if i:
            for part in self.opened.pop(i - 1, []):
                self._release(part)
        if sabotage == "leak":
            self._leak()
        if sabotage == "fds":
            self._held_fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(2 * self.bounds.fds)]
        self._check_keys()
        self._check_usage(i)
        self.report["iterations"] = i + 1
        self.harness.tell("iteration", iteration=i, verified=self.report["samples_verified"],
                          faults=self.report["faults"])

    def _write(self, i: int) -> dict | None:
        plan = self.harness.ask("phase", phase="write", iteration=i, pids={"writer": self.writer[1]})
        filled_at = self._fill(plan["unit"]) if plan.get("fault") == "arena-full" else None
        result = self._rollout(i, f"r{i}")
        healed = self.harness.ask("heal")
        if plan.get("fault") == "arena-full":
            self.controller.release_partition(_FILLER)
            healed = {"kind": "arena-full", "injected_at": filled_at}
        self._settle(healed)
        if healed.get("kind"):
            self._surfaced(healed, [result.get("error")])
        if "error" in result:  # rolled again under a rollout of its own: the failed one's keys stay until its release
            self.report["rolled_again"] += 1
            result = self._rollout(i, f"r{i}.again")
            if "error" in result:
                self._count_error(result["error"])
                return None
        result["written_at"] = time.monotonic()
        return result

    def _rollout(self, i: int, part: str) -> dict:
        actor, _ = self.writer
        self.controller.open_partition(part)
        self.opened.setdefault(i, []).append(part)
        try:
            result = self._get(actor.rollout.remote(self.controller.membership(), part,
                                                    self.args["seed"] * 100_003 + 2 * i + part.endswith("again"),
                                                    self.controller.lost_units()), "the rollout")
        except self.ray.exceptions.RayActorError as exc:
            self.writer = self._actor(RolloutRole, 0)
            return {"error": {**error_report(exc), "typed": True}}
        if "error" in result:
            self._count_error(result["error"])
            if untyped_errors([result["error"]]):
                raise Violation(untyped_errors([result["error"]])[0])
        return result

    def _split(self, i: int, written: dict) -> tuple[list, dict]:
        """Drop the samples on units lost now, asked before the split; the kept positions, and the fault met.

        A unit killed at the split (``split-kill``) must be named here: the
        trainers then meet no error at all.
        """
        from gputq.client.reachability import unreachable_samples, units_of
        from gputq.data.trajectory import Segment

        plan = self.harness.ask("phase", phase="split", iteration=i)
        layouts = [Segment.from_sample(s).layouts for s in written["samples"]]
        with self._clients() as clients:
            down = unreachable_samples(layouts, clients)
        named_at = time.monotonic()
        if plan.get("fault"):
            on_victim = {j for j, sample in enumerate(layouts) if plan["unit"] in units_of(sample)}
            if set(down) != on_victim:
                raise Violation(f"iteration {i}: {plan['unit']} was killed before the split, which named samples "
                                f"{sorted(down)}, not the {sorted(on_victim)} it held")
            plan["named_at"] = named_at
        self.report["dropped_samples"] += len(down)
        keep = [j for j in range(len(layouts)) if j not in down]
        self.live[self.opened[i][-1]] = {"samples": [written["samples"][j] for j in keep],
                                         "written_at": written["written_at"]}
        return keep, plan

    def _train(self, i: int, written: dict, flip: bool = False) -> None:
        keep, split = self._split(i, written)
        samples, ranks = written["samples"], sorted(self.trainers)
        shards = [keep[r::len(ranks)] for r in range(len(ranks))]
        per_mb = self.shape["micro_batch"]
        self.harness.ask("phase", phase="train", iteration=i,
                         pids={"trainers": {h: self.trainers[h][1] for h in ranks}})
        if flip:
            self._get(self.trainers[ranks[0]][0].sabotage.remote(), "sabotage")
        refs = {h: self.trainers[h][0].train.remote(
            self.controller.membership(), [samples[j] for j in shard],
            [list(range(k, min(k + per_mb, len(shard)))) for k in range(0, len(shard), per_mb)],
            self.controller.lost_units()) for h, shard in zip(ranks, shards)}
        outcomes = {h: self._outcome(h, ref) for h, ref in refs.items()}
        healed = self.harness.ask("heal")
        self._settle(healed)
        errors = [o["error"] for o in outcomes.values() if o["error"]]
        for error in errors:
            self._count_error(error)
        if untyped_errors(errors):
            raise Violation(untyped_errors(errors)[0])
        if split.get("fault"):
            if errors:
                raise Violation(f"iteration {i}: a trainer failed after the split dropped the lost unit's samples: "
                                f"{errors[0]['type']}: {errors[0]['message']}")
            self._surfaced({**healed, "kind": split["fault"]}, [{"at": split["named_at"]}])
        elif healed.get("kind"):
            self._surfaced(healed, errors)
        for h, shard in zip(ranks, shards):
            self._verify(i, [written["digests"][j] for j in shard], outcomes[h])

    def _outcome(self, host: int, ref) -> dict:
        try:
            return self._get(ref, f"trainer on host {host}")
        except self.ray.exceptions.RayActorError as exc:
            self.trainers[host] = self._actor(TrainerRole, host)
            return {"digests": {}, "bytes": 0, "error": {**error_report(exc), "typed": True}}

    def _verify(self, i: int, expected: list, outcome: dict) -> None:
        wrong = wrong_samples(expected, outcome["digests"])
        self.report["samples_verified"] += len(outcome["digests"]) - len(wrong)
        self.report["bytes_verified"] += outcome["bytes"]
        if wrong:
            self.report["wrong_bytes"] += outcome["bytes"]  # the rank's bytes: no finer count is kept
            raise Violation(f"iteration {i}: samples at shard positions {wrong} restored wrong bytes")

    def _surfaced(self, healed: dict, errors: list) -> None:
        """Record when fault ``healed`` surfaced (a typed error or a lost mark) and check its deadline."""
        kind, injected = healed["kind"], healed["injected_at"]
        self.report["faults"][kind] = self.report["faults"].get(kind, 0) + 1
        times = [e["at"] for e in errors if e and e["at"] >= injected]
        marked = self.watch.marked_since(injected)
        if marked is not None and kind not in ("trainer-kill", "writer-kill", "arena-full"):
            times.append(marked)
        surfaced = min(times) if times else None
        if surfaced is not None:
            took = surfaced - injected
            self.report["detect_s"][kind] = max(self.report["detect_s"].get(kind, 0.0), took)
        deadline = self.args["deadlines"].get(kind)
        broken = late_surface(kind, injected, surfaced, deadline)
        if broken:
            raise Violation(broken[0])

    def _settle(self, healed: dict) -> None:
        """After a heal: a restarted unit re-registered, and every unit live again within the deadline."""
        if healed.get("address"):
            unit = healed["unit"]
            self.controller.register_unit(unit, healed["address"])
            self.restarted[unit] = time.monotonic()
        deadline = time.monotonic() + self.args["settle_s"]
        while self.controller.lost_units():
            if time.monotonic() > deadline:
                raise Violation(f"units {sorted(self.controller.lost_units())} still lost "
                                f"{self.args['settle_s']} s after the fault healed")
            time.sleep(0.05)

    def _fill(self, unit: str) -> float:
        """Fill ``unit``'s arena to the last free byte with keys of a rollout of their own; when it was full."""
        from gputq.errors import CapacityError

        self.controller.open_partition(_FILLER)
        with self._clients() as clients:
            channel = clients.channel(unit)
            for n in itertools.count():
                largest = int(channel.call("stats", timeout=self.config.control_timeout_s)["largest_free"])
                if not largest:
                    break
                try:
                    channel.write(f"{_FILLER}/{n}", np.zeros(largest, np.uint8), {"partition": _FILLER},
                                  timeout=self.config.put_timeout_s)
                except CapacityError:
                    break
        return time.monotonic()

    # -- after an iteration --

    def _release(self, part: str) -> None:
        from gputq.errors import PartialFailureError

        try:
            self.controller.release_partition(part)
        except PartialFailureError as exc:
            raise Violation(f"release of {part} failed after the faults healed: {exc}") from None
        self.live.pop(part, None)

    def _check_keys(self) -> None:
        from gputq.data.trajectory import Segment

        layouts = [Segment.from_sample(s).layouts for live in self.live.values() for s in live["samples"]]
        written = [live["written_at"] for live in self.live.values() for _ in live["samples"]]
        referenced = [s for s, at in zip(layouts, written) if not self._on_restarted(s, at)]
        report = self.controller.check_invariants(referenced=referenced)
        found = key_violations(report, self._drained_stats())
        if found:
            self.report["leaked_keys"] += sum(1 for v in found if "not live" in v)
            raise Violation("; ".join(found[:3]))

    def _drained_stats(self) -> dict:
        """Every unit's stats once its leases and reservations are gone, or at their deadline.

        A reader or writer killed mid-call leaves its lease or reservation for
        the unit to expire (a lease after twice the read timeout).
        """
        deadline = time.monotonic() + self.args["drain_s"]
        with self._clients() as clients:
            while True:
                stats = {u: clients.channel(u).call("stats", timeout=self.config.control_timeout_s)
                         for u in clients.units}
                if time.monotonic() > deadline or not any(s.get(n) for s in stats.values() for n in LEFT_ON_UNITS):
                    return stats
                time.sleep(0.1)

    def sabotaged(self, i: int, kind: str) -> str | None:
        """Run iteration ``i`` with one invariant broken on purpose; the violation caught, or None.

        ``bytes``: a trainer flips a bit of what it consumed; ``leak``: a key
        stored under a rollout nobody opened; ``fds``: the master holds
        descriptors it never closes. Undone afterwards, so the next one starts clean.
        """
        tallies = {k: copy.deepcopy(self.report[k]) for k in ("wrong_bytes", "leaked_keys", "drift")}
        try:
            self.iteration(i, sabotage=kind)
            caught = None
        except Violation as exc:
            caught = str(exc)
        self.report.update(tallies)  # the sabotage's own damage is not the system's
        if kind == "leak":
            with self._clients() as clients:
                clients.channel(clients.units[0]).call("release_partition", timeout=self.config.control_timeout_s,
                                                       partition="leaked")
        for fd in self._held_fds:
            os.close(fd)
        self._held_fds = []
        return caught

    def _leak(self) -> None:
        """Store one key under a rollout nobody opened: the soak's key check must catch it."""
        with self._clients() as clients:
            unit = clients.units[0]
            clients.channel(unit).write("leaked/0", np.ones(64, np.uint8), {"partition": "leaked"},
                                        timeout=self.config.put_timeout_s)

    def _on_restarted(self, layouts: dict, written_at: float) -> bool:
        from gputq.client.reachability import units_of

        return any(self.restarted.get(u, 0.0) > written_at for u in units_of(layouts))

    def _check_usage(self, i: int) -> None:
        """Every process against its baseline: taken at the warm-up's end, or at a new process's first check."""
        units = self.harness.ask("usage")
        now = {"master": usage(), **{f"unit:{u}": v for u, v in units["units"].items()}}
        now["writer"] = self._get(self.writer[0].usage.remote(), "the writer's usage")
        for h, (actor, _) in self.trainers.items():
            now[f"trainer{h}"] = self._get(actor.usage.remote(), f"trainer {h}'s usage")
        pids = {"master": os.getpid(), "writer": self.writer[1], **{f"unit:{u}": p for u, p in units["pids"].items()},
                **{f"trainer{h}": t[1] for h, t in self.trainers.items()}}
        for name, value in now.items():
            if i < self.args["warmup"] or self.baselines.get(name, (None,))[0] != pids[name]:
                self.baselines[name] = (pids[name], value)
                continue
            base = self.baselines[name][1]
            self.report["drift"][name] = {k: now[name][k] - base[k] for k in base}
            found = drift(name, base, value, self.bounds)
            if found:
                raise Violation("; ".join(found))

    def _count_error(self, error: dict) -> None:
        self.report["errors_seen"][error["type"]] = self.report["errors_seen"].get(error["type"], 0) + 1

    def finish(self) -> None:
        """Release what is live; the units must then hold nothing."""
        for parts in list(self.opened.values()):
            for part in parts:
                self._release(part)
        self.opened.clear()
        self._check_keys()
        left = self.controller.stats()["totals"]
        if left["keys"] or left["used"]:
            raise Violation(f"the units hold {left['keys']} keys ({left['used']} bytes) after every release")

    def close(self) -> None:
        self.watch.close()
        self.controller.close()


def main(args: dict) -> dict:
    from bench.hosts import wait_nodes
    from gputq.cluster.names import import_ray
    from gputq.config import GputqConfig

    # A hang past every phase's limit prints where each thread waits, then again each period, until the
    # job next tells the harness something (Harness.tell starts the watchdog over).
    faulthandler.dump_traceback_later(2 * PHASE_S, repeat=True)
    ray = import_ray()
    ray.init(address=args["ray_address"], log_to_driver=False)
    wait_nodes(ray, args["hosts"], 120)
    config = GputqConfig(enabled=True, use_rollout_routing_replay=True, transport="auto",
                         routed_experts_dtype=args["shape"]["dtype"], num_experts=args["shape"]["experts"],
                         token=args["token"], **args["timeouts"])
    harness = Harness()
    soak = Soak(ray, config, args, harness)
    started, i = time.monotonic(), 0
    try:
        while i < args["iterations"] and time.monotonic() - started < args["seconds"]:
            soak.iteration(i)
            i += 1
        soak.report["sabotage"] = {}
        for kind in args["sabotage"]:
            soak.report["sabotage"][kind] = soak.sabotaged(i, kind)
            i += 1
        soak.finish()
    except Violation as exc:
        soak.report["violation"] = {"iteration": i, "what": str(exc)}
    finally:
        soak.close()
    soak.report["seconds"] = time.monotonic() - started
    harness.tell("done", report=soak.report)
    return soak.report


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
