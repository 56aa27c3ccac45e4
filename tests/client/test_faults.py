"""Faults: StorageUnits killed (SIGKILL) or hung (SIGSTOP) in their own processes, and
the same rules in-process (a closed unit, a handler that blocks) for the fast suite.

The process tests are marked slow: starting three interpreters takes seconds.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from bench.faults import unit_processes
from gputq.client.clients import UnitClients
from gputq.client.lifecycle import on_units
from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.cluster.controller import Controller
from gputq.data.refs import Layout
from gputq.errors import (
    GputqTimeoutError,
    PartialFailureError,
    PeerLostError,
    UnitLostError,
    UnitTimeoutError,
)
from tests.conftest import TRANSPORT_PARAMS
from tests.transport.units import hung_control
from tests.waiting import wait_until


def _controller(config, units, **kwargs) -> Controller:
    controller = Controller(config, **kwargs)
    for name, unit in units.items():
        controller.register_unit(name, unit.address)
    return controller


def _write(clients, config, partition: str, n: int, rows: int = 256) -> list:
    with Writer(clients, config) as writer:
        refs = [writer.put(f"{partition}/s{i}/0", partition, {"logprobs": np.full(rows, i, np.float32)})
                for i in range(n)]
        writer.flush()
    return [r["logprobs"] for r in refs]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_release_partition_frees_the_survivors_when_one_of_three_units_is_killed():
    with unit_processes(3) as (config, units):
        controller = _controller(config, units, heartbeat=False)
        with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
            controller.open_partition("r0")
            refs = _write(clients, config, "r0", 40)
            on = {name: sum(ref.unit == name for ref in refs) for name in units}
            assert all(on.values())  # every unit holds some of the rollout
            units["su-0"].kill()  # the first unit fanned out to: the old loop stopped there
            with pytest.raises(PartialFailureError, match="su-0") as info:
                controller.release_partition("r0")
            assert info.value.result["freed"] == on["su-1"] + on["su-2"]
            assert set(info.value.result["unreachable"]) == {"su-0"}
            for name in ("su-1", "su-2"):
                assert clients.channel(name).call("stats", timeout=5)["keys"] == 0
            report = controller.check_invariants()
            assert report["violations"] == [] and set(report["unreachable"]) == {"su-0"}
            assert not report["ok"] and report["units_checked"] == 2
        controller.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_reader_of_keys_on_a_killed_unit_gets_a_typed_error_naming_unit_and_keys():
    with unit_processes(2) as (config, units):
        with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
            refs = _write(clients, config, "r0", 12)
            shard = [{"logprobs": Layout.from_ref(ref)} for ref in refs]
            with Reader(clients, config) as reader:
                reader.fetch(shard)  # connected and warm before the fault
                units["su-1"].kill()
                with pytest.raises(UnitLostError, match="su-1") as info:
                    reader.fetch(shard)
                lost_keys = {ref.key for ref in refs if ref.unit == "su-1"}
                assert isinstance(info.value, PeerLostError) and info.value.unit == "su-1"
                assert set(info.value.keys) == lost_keys and sorted(lost_keys)[0] in str(info.value)
                # The survivor's samples still restore bit-exact; the lost ones are what to skip.
                kept = on_units(shard, clients.live_units)
                assert kept == [i for i, ref in enumerate(refs) if ref.unit == "su-0"]
                got = reader.fetch([shard[i] for i in kept])
                for i, fields in zip(kept, got):
                    assert np.array_equal(fields["rollout_log_probs"], np.full(256, i, np.float32))
            assert clients.live_units == ["su-0"] and set(clients.lost) == {"su-1"}


def _on_both_units(clients, config) -> tuple[list, list, list, list]:
    """96 samples written over su-0 and su-1 (sample i's expert IDs all i + 1), as ``(refs, shard,
    micro-batches, order)``: micro-batches of two samples from each unit, shard position ``p`` being
    sample ``order[p]``. At least 20 of them: over shm the windows leased before a fault (8 micro-batches
    each, the next one ahead) must not cover the whole stream."""
    with Writer(clients, config) as writer:
        refs = [writer.put(f"s{i}", "p", {"routed_experts": np.full((200, 4, 2), i + 1, np.int32)})
                for i in range(96)]
        writer.flush()
    on = {unit: [i for i, r in enumerate(refs) if r["routed_experts"].unit == unit] for unit in ("su-0", "su-1")}
    order = [i for k in range(0, min(map(len, on.values())) - 1, 2) for i in on["su-0"][k:k + 2] + on["su-1"][k:k + 2]]
    shard = [{"routed_experts": Layout.from_ref(refs[i]["routed_experts"])} for i in order]
    batches = [list(range(k, k + 4)) for k in range(0, len(order), 4)]
    assert len(batches) >= 20, batches
    return refs, shard, batches, order


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_a_stream_whose_unit_is_killed_raises_unit_lost_naming_it(transport):
    """SIGKILL after micro-batch 1 of a stream reading both units, one micro-batch fetched ahead: the
    stream raises UnitLostError (a ConnectionError) naming su-0, which is marked lost, and the survivor's
    samples still read exactly. Over rdma the next micro-batch's lease is taken before the kill and its
    READ finds the process gone: NIXL's remote disconnect once surfaced as a bare TransferError, with the
    unit not marked lost."""
    from gputq.data.slices import ParallelSlice

    with unit_processes(2, transport=transport, read_timeout_s=5.0) as (config, units):
        with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
            refs, shard, batches, order = _on_both_units(clients, config)
            with Reader(clients, config) as reader:
                with pytest.raises(UnitLostError, match="su-0") as info, \
                        reader.stream(shard, batches, ParallelSlice(num_experts=16), prefetch=1) as stream:
                    for mb in stream:
                        assert (mb.routed_experts[0][:200] == order[batches[mb.index][0]] + 1).all()
                        if mb.index == 1:
                            if transport == "rdma":  # micro-batch 3's lease granted: its READ comes after the kill
                                wait_until(lambda: clients.channel("su-0").call("stats", timeout=5)["reads"] >= 4,
                                           10, "micro-batch 3's lease, taken ahead")
                            units["su-0"].kill()
                assert isinstance(info.value, ConnectionError) and info.value.unit == "su-0"
                assert clients.live_units == ["su-1"]
                kept = on_units(shard, clients.live_units)
                assert kept == [p for p, i in enumerate(order) if refs[i]["routed_experts"].unit == "su-1"]
                got = reader.fetch([shard[p] for p in kept])
                assert all((fields["rollout_routed_experts"] == order[p] + 1).all() for p, fields in zip(kept, got))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_a_stream_whose_unit_is_stopped_raises_within_the_read_timeout(transport):
    """SIGSTOP after micro-batch 2: what was yielded is exact and in order, and the first micro-batch
    that needs the unit raises UnitTimeoutError (a TimeoutError) within the read timeout and a small
    margin. Over shm the lost channel's close once sent its deferred lease ends first, for another 10 s;
    and micro-batches whose window was leased before the stop are still served (the leases keep their
    regions), so the stream is long enough that later ones need the unit. Over rdma the next micro-batch's
    lease, taken ahead, is what finds the unit hung: its read once leased again and raised "is lost"."""
    from gputq.data.slices import ParallelSlice

    timeout, margin = 1.0, 1.0
    with unit_processes(1, transport=transport, read_timeout_s=timeout) as (config, units):
        with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
            assert clients.transport_of("su-0")[0] == transport
            with Writer(clients, config) as writer:
                data = [np.full((200, 4, 2), i + 1, np.int32) for i in range(24)]
                refs = [writer.put(f"s{i}", "p", {"routed_experts": d}) for i, d in enumerate(data)]
                writer.flush()
            shard = [{"routed_experts": Layout.from_ref(r["routed_experts"])} for r in refs]
            seen = []
            with Reader(clients, config) as reader, \
                    reader.stream(shard, [[i] for i in range(24)], ParallelSlice(num_experts=16)) as stream:
                with pytest.raises(UnitTimeoutError, match="su-0"):
                    for mb in stream:
                        assert (mb.routed_experts[0][:200] == mb.index + 1).all()
                        seen.append(mb.index)
                        if mb.index == 2:
                            units["su-0"].stop()
                            stopped = time.monotonic()
                elapsed = time.monotonic() - stopped
            units["su-0"].cont()
    assert seen[:3] == [0, 1, 2] and seen == list(range(len(seen))) and len(seen) < 24
    assert elapsed < timeout + margin, elapsed


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_a_stream_whose_unit_is_stopped_ends_the_other_units_leases(transport):
    """Micro-batches read both units; su-0 is stopped after micro-batch 1. The stream raises
    UnitTimeoutError for su-0, and every lease it took on su-1 (over rdma the next micro-batch's, taken
    ahead beside the one that found su-0 hung) is ended, none left to expire on the unit."""
    from gputq.data.slices import ParallelSlice

    with unit_processes(2, transport=transport, read_timeout_s=1.0) as (config, units):
        with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
            _, shard, batches, _ = _on_both_units(clients, config)
            with Reader(clients, config) as reader:
                with pytest.raises(UnitTimeoutError, match="su-0"), \
                        reader.stream(shard, batches, ParallelSlice(num_experts=16)) as stream:
                    for mb in stream:
                        if mb.index == 1:
                            units["su-0"].stop()
                survivor = clients.channel("su-1")
                wait_until(lambda: survivor.call("stats", timeout=5)["leases"] == 0, 10, "su-1's leases to end")
                assert survivor.call("stats", timeout=5)["leases_expired"] == 0
            units["su-0"].cont()


def _paused_rank(clients, config, group: list, rank, batches: list, ended: list, started, fault) -> None:
    """One rank's stream of its group's segments with ``release``, paused after its first micro-batch until
    ``fault`` is set; ``(rank, error or None, when)`` in ``ended``."""
    from tests.client.test_stream_random import _rank_streams

    errors: list = []
    _rank_streams(clients, config, group, rank, batches, errors, first=lambda: (started.release(), fault.wait(30)))
    ended.append((rank, errors[0][1] if errors else None, time.monotonic()))
    started.release()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["kill", "stop"])
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_eight_ranks_streaming_with_release_when_one_of_three_units_fails(transport, fault):
    """Two DP groups of PP 2 x CP 2 ranks, each a Reader of its own on a thread of one process, stream timeline
    segments with ``release``; each pauses after its first micro-batch, and su-0 is then killed or stopped.
    Every rank ends within one timeout of the fault, exact or with UnitLostError naming su-0; the survivors
    are left no lease, none expired, and the rollout's release_partition frees all they hold. This is where
    three faults showed: eight paused tcp streams took a channel's eight read connections and the next
    call marked a healthy unit lost; a micro-batch's release raised PartialFailureError out of ``next()``; and
    with more requests than connections a waiter took a second timeout, long enough for the survivors' leases
    to expire."""
    from gputq.data.slices import ParallelSlice
    from gputq.data.trajectory import timeline_segments
    from gputq.tools.synthetic import SyntheticConfig, build_sessions
    from tests.client.test_stream_random import _split

    timeout, experts = 1.0, 16
    rng = np.random.default_rng(11)
    synth = SyntheticConfig(sessions=6, steps_per_session=4, layers=4, topk=4, num_experts=experts,
                            prompt_tokens=30, tokens_per_step=20, tool_tokens=5, branch_prob=0.4, seed=11)
    with unit_processes(3, transport=transport, read_timeout_s=timeout, control_timeout_s=timeout,
                        num_experts=experts) as (config, units):
        with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
            with Writer(clients, config) as writer:
                sessions = build_sessions(synth, fields=config.field_registry(4, 4), writer=writer, partition="r0")
                segments = [seg for session in sessions for seg in timeline_segments(session)]
                writer.finalize([seg.layouts for seg in segments], "r0", readers=4)
            ended, started, fault_set = [], threading.Semaphore(0), threading.Event()
            ranks = [threading.Thread(target=_paused_rank, args=(
                         clients, config, segments[dp::2],
                         ParallelSlice(layers=(2 * pp, 2 * pp + 1), cp_rank=cp, cp_size=2, num_experts=experts),
                         _split(rng, len(segments[dp::2])), ended, started, fault_set))
                     for dp in range(2) for pp in range(2) for cp in range(2)]
            for thread in ranks:
                thread.start()
            assert all(started.acquire(timeout=30) for _ in ranks)
            (units["su-0"].kill if fault == "kill" else units["su-0"].stop)()
            struck = time.monotonic()
            fault_set.set()
            for thread in ranks:
                thread.join(30)
            assert not any(thread.is_alive() for thread in ranks) and len(ended) == len(ranks)
            for rank, error, when in ended:
                assert error is None or (isinstance(error, UnitLostError) and error.unit == "su-0"), (rank, error)
                assert when - struck < 1.75 * timeout, (rank, error, when - struck)
            assert any(error is not None for _, error, _ in ended)
            for name in ("su-1", "su-2"):
                survivor = clients.channel(name)
                wait_until(lambda: survivor.call("stats", timeout=5)["leases"] == 0, 10, f"{name}'s leases to end")
                assert survivor.call("stats", timeout=5)["leases_expired"] == 0
                survivor.call("release_partition", timeout=5, partition="r0")
                wait_until(lambda: survivor.call("stats", timeout=5)["used"] == 0, 10, f"{name}'s bytes freed")
                assert survivor.call("stats", timeout=5)["keys"] == 0
            if fault == "stop":
                units["su-0"].cont()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hung_unit_costs_one_timeout_not_one_per_request():
    with unit_processes(2) as (config, units):
        with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
            clients.channel("su-0").call("stats", timeout=5)
            units["su-0"].stop()
            timeout = 0.5
            started = time.monotonic()
            with pytest.raises(UnitTimeoutError, match="su-0") as first:
                clients.channel("su-0").call("stats", timeout=timeout)
            assert isinstance(first.value, GputqTimeoutError)  # still a TimeoutError to callers
            one = time.monotonic() - started
            for _ in range(3):
                with pytest.raises(UnitLostError, match="su-0 is lost"):
                    clients.channel("su-0").call("release", timeout=timeout, keys=["k"], partition="p")
            four = time.monotonic() - started
            assert one >= timeout and four < one + 0.5 * timeout  # the old path: 4 x 0.5 s
            assert clients.live_units == ["su-1"]
            assert clients.channel("su-1").call("stats", timeout=5)["keys"] == 0  # others unaffected
            units["su-0"].cont()
            assert clients.ping("su-0") is True  # a probe re-admits it
            assert clients.live_units == ["su-0", "su-1"]
            assert clients.channel("su-0").call("stats", timeout=5)["keys"] == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_four_writes_to_a_stopped_unit_finish_in_about_one_timeout():
    with unit_processes(2, put_timeout_s=0.5) as (config, units):
        with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
            clients.channel("su-0").call("stats", timeout=5)
            units["su-0"].stop()
            payload = np.ones(1 << 16, np.uint8)
            waits = []
            for i in range(4):
                started = time.monotonic()
                with pytest.raises(UnitLostError, match="su-0"):
                    clients.channel("su-0").write(f"k{i}", payload, {"partition": "p"}, timeout=0.5)
                waits.append(time.monotonic() - started)
            # The first write waits its timeout plus the transport's reply grace; the rest fail fast
            # (before: four times that, 20 s with the default grace).
            assert waits[0] >= 0.5 and sum(waits[1:]) < 0.1 * waits[0]
            units["su-0"].cont()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_writers_puts_to_a_stopped_unit_fail_as_that_unit_lost():
    """Puts spread over two units, su-0 stopped: its first write times out (UnitTimeoutError) and the
    rest fail fast (UnitLostError). flush() raises them as one UnitLostError (a ConnectionError) naming
    su-0 and every key it did not store; a mix of the two once gave a bare TransferError. The keys on
    su-1 read back exactly."""
    with unit_processes(2, put_timeout_s=0.5) as (config, units):
        with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
            clients.channel("su-0").call("stats", timeout=5)
            units["su-0"].stop()
            with Writer(clients, config) as writer:
                refs = [writer.put(f"s{i}", "p", {"logprobs": np.full(1 << 16, i, np.float32)})["logprobs"]
                        for i in range(40)]
                with pytest.raises(UnitLostError, match="su-0") as info:
                    writer.flush()
            units["su-0"].cont()
            on_su0 = sorted(ref.key for ref in refs if ref.unit == "su-0")
            assert on_su0 and isinstance(info.value, ConnectionError)
            assert info.value.unit == "su-0" and list(info.value.keys) == on_su0
            kept = [ref for ref in refs if ref.unit == "su-1"]
            with Reader(clients, config) as reader:
                got = reader.fetch([{"logprobs": Layout.from_ref(ref)} for ref in kept])
            assert [int(fields["rollout_log_probs"][0]) for fields in got] == [int(ref.key[1:].split("/")[0])
                                                                                for ref in kept]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("su1_lost", ["beside su-0", "while su-0's probe hangs"])
def test_a_hung_units_probe_holds_up_no_other_lost_units_return(su1_lost):
    """su-0 hung and lost (its probe waits out the 10 s probe timeout); su-1 lost beside it, or only once su-0's
    probe is under way, while it still answers. su-1 is re-admitted at the next heartbeat, well before su-0's
    probe gives up: the probes once ran one after another, su-1's behind su-0's, and then a beat waited for its
    slowest probe, so a unit lost meanwhile waited for su-0's to give up."""
    with unit_processes(2, heartbeat_interval_s=0.1, probe_timeout_s=10.0) as (config, units):
        with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
            probing = threading.Event()
            ping = clients.ping

            def spied(unit, timeout=None):
                if unit == "su-0":
                    probing.set()
                return ping(unit, timeout)

            clients.ping = spied
            units["su-0"].stop()
            try:
                clients.mark_lost("su-0", "stopped by the test")
                if su1_lost != "beside su-0":
                    assert probing.wait(10), "su-0 was never probed"
                clients.mark_lost("su-1", "a blip the test made up")
                wait_until(lambda: clients.live_units == ["su-1"], 5, "su-1 re-admitted while su-0's probe hangs")
                assert set(clients.lost) == {"su-0"}
            finally:
                units["su-0"].cont()
            wait_until(lambda: clients.live_units == ["su-0", "su-1"], 30, "su-0 re-admitted once it answers")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_controller_marks_killed_and_hung_units_lost_within_the_heartbeat_bound():
    interval, probe = 0.2, 0.5
    with unit_processes(3, heartbeat_interval_s=interval, probe_timeout_s=probe) as (config, units):
        controller = _controller(config, units)
        with UnitClients({n: u.address for n, u in units.items()}, config) as clients:
            controller.open_partition("r0")
            refs = _write(clients, config, "r0", 30)
            on = {name: sum(ref.unit == name for ref in refs) for name in units}
            assert controller.heartbeat() == {} and controller.lost_units() == {}
            started = time.monotonic()
            units["su-0"].kill()
            units["su-1"].stop()
            wait_until(lambda: set(controller.lost_units()) == {"su-0", "su-1"}, 10, "both units marked lost")
            # Bound: one interval plus the probe timeout; the rest is margin for a loaded 2-core box.
            assert time.monotonic() - started < interval + probe + 2.0
            assert controller.live_units() == ["su-2"]
            with pytest.raises(PartialFailureError) as info:
                controller.release_partition("r0")  # lost units fail fast: no timeout is waited
            assert info.value.result["freed"] == on["su-2"]
            assert set(info.value.result["unreachable"]) == {"su-0", "su-1"}
            units["su-1"].cont()
            wait_until(lambda: set(controller.lost_units()) == {"su-0"}, 10, "su-1 re-admitted")
            # The release su-1 missed while stopped is replayed when it answers again.
            wait_until(lambda: clients.ping("su-1") and
                      clients.channel("su-1").call("stats", timeout=5)["keys"] == 0, 10, "su-1 released r0")
            report = controller.check_invariants()
            assert report["violations"] == [] and set(report["unreachable"]) == {"su-0"}
        controller.close()


# -- in-process: the same rules without child processes ---------------------------------

def test_requests_to_a_lost_unit_fail_fast_until_a_probe_reaches_it():
    from tests.conftest import local_units

    with local_units("tcp", units=2, heartbeat_interval_s=0.05) as (config, services, clients):
        clients.channel("su-0").call("stats", timeout=5)
        clients.mark_lost("su-0", "operator says so")
        with pytest.raises(UnitLostError, match=r"unit su-0 is lost \(operator says so") as info:
            clients.channel("su-0").read(["a", "b"], np.empty(8, np.uint8), timeout=5)
        assert info.value.keys == ("a", "b") and "['a', 'b']" in str(info.value)
        assert clients.live_units == ["su-1"]
        # The background probe finds the unit answering and re-admits it.
        wait_until(lambda: clients.live_units == ["su-0", "su-1"], 10, "su-0 re-admitted")
        assert clients.channel("su-0").call("stats", timeout=5)["keys"] == 0
        services[1].close()  # a unit that is gone: refused connections
        with pytest.raises(UnitLostError, match="su-1"):
            clients.channel("su-1").call("stats", timeout=5)
        assert set(clients.lost) == {"su-1"} and clients.ping("su-1") is False


def test_a_full_unit_is_alive_and_its_capacity_error_passes_through():
    from gputq.errors import CapacityError
    from tests.conftest import local_units

    with local_units("tcp", units=1, capacity=1 << 20) as (config, services, clients):
        channel = clients.channel("su-0")
        channel.write("big", np.zeros(1 << 20, np.uint8), {"partition": "p"}, timeout=1)
        with pytest.raises(CapacityError):
            channel.write("more", np.zeros(1 << 10, np.uint8), {"partition": "p"}, timeout=0.05)
        assert clients.live_units == ["su-0"] and clients.lost == {}


def test_a_unit_whose_handler_hangs_costs_one_timeout():
    from tests.conftest import local_units

    with local_units("tcp", units=2) as (config, services, clients):
        clients.channel("su-0").call("stats", timeout=5)
        with hung_control(services[0].unit):
            started = time.monotonic()
            with pytest.raises(UnitTimeoutError, match="su-0"):
                clients.channel("su-0").call("stats", timeout=0.3)
            for _ in range(3):  # each would wait its 30 s for the hung unit again
                with pytest.raises(UnitLostError, match="su-0 is lost"):
                    clients.channel("su-0").call("stats", timeout=30)
            assert time.monotonic() - started < 2 * 0.3  # before: 4 x 0.3 s
            assert clients.live_units == ["su-1"]
        assert clients.ping("su-0") and clients.live_units == ["su-0", "su-1"]


def test_more_calls_than_a_channel_pools_connections_to_a_hung_unit_cost_one_timeout():
    """Eight calls of 0.5 s hold a channel's connections to a unit whose handler hangs; four of 20 s wait for
    one. The first to time out marks the unit lost, and every call ends then, the waiting ones too: one
    timeout in all. A waiter that took the connection slot the first freed connected as the channel closed,
    began its request on that closed channel and waited its own 20 s."""
    from gputq.transport.tcp import CHANNEL_CONNECTIONS
    from tests.conftest import local_units

    with local_units("tcp", units=1) as (config, services, clients):
        clients.channel("su-0").call("stats", timeout=5)
        took, errors = [], []

        def call(timeout):
            started = time.monotonic()
            try:
                clients.channel("su-0").call("stats", timeout=timeout)
            except UnitLostError as exc:
                errors.append(exc)
            took.append(time.monotonic() - started)

        holders = [threading.Thread(target=call, args=(0.5,)) for _ in range(CHANNEL_CONNECTIONS)]
        waiters = [threading.Thread(target=call, args=(20.0,)) for _ in range(4)]
        with hung_control(services[0].unit) as reached:
            for caller in holders:
                caller.start()
            assert wait_until(lambda: len(reached) == CHANNEL_CONNECTIONS, what="every connection's call hung")
            for caller in waiters:
                caller.start()
            for caller in holders + waiters:
                caller.join(30)
        assert len(errors) == CHANNEL_CONNECTIONS + 4 and all(exc.unit == "su-0" for exc in errors)
        assert max(took) < 10.0, sorted(took)  # ended with the first timeout, not at a waiter's own 20 s
        assert clients.ping("su-0") and clients.live_units == ["su-0"]


def test_reader_of_keys_on_a_closed_unit_gets_a_typed_error_naming_unit_and_keys():
    from tests.conftest import local_units

    with local_units("tcp", units=2) as (config, services, clients):
        refs = _write(clients, config, "r0", 10)
        shard = [{"logprobs": Layout.from_ref(ref)} for ref in refs]
        services[1].close()
        with Reader(clients, config) as reader:
            with pytest.raises(UnitLostError, match="su-1") as info:
                reader.fetch(shard)
        assert info.value.unit == "su-1" and set(info.value.keys) == {r.key for r in refs if r.unit == "su-1"}
        kept = on_units(shard, clients.live_units)
        assert kept == [i for i, ref in enumerate(refs) if ref.unit == "su-0"]
        with Reader(clients, config) as reader:
            got = reader.fetch([shard[i] for i in kept])
        assert [float(g["rollout_log_probs"][0]) for g in got] == [float(i) for i in kept]


def test_writer_places_new_keys_on_live_units_only():
    from tests.conftest import local_units

    with local_units("tcp", units=3) as (config, services, clients):
        clients.mark_lost("su-1", "test")
        refs = _write(clients, config, "r0", 30)
        assert {ref.unit for ref in refs} == {"su-0", "su-2"}


def test_the_first_timeout_ends_the_other_requests_in_flight_to_the_hung_unit():
    from concurrent.futures import ThreadPoolExecutor

    from tests.conftest import local_units

    with local_units("tcp", units=1) as (config, services, clients):
        clients.channel("su-0").call("stats", timeout=5)

        def call(timeout):
            started = time.monotonic()
            with pytest.raises(UnitLostError, match="su-0"):
                clients.channel("su-0").call("stats", timeout=timeout)
            return time.monotonic() - started

        with hung_control(services[0].unit), ThreadPoolExecutor(4) as pool:
            patient = [pool.submit(call, 20.0) for _ in range(3)]
            assert call(0.3) >= 0.3
            waits = [f.result(timeout=10) for f in patient]
        assert max(waits) < 5.0  # ended with the first timeout, not at their own 20 s


@pytest.mark.timeout(60)
def test_a_reader_over_shm_of_a_closed_unit_marks_it_lost_like_tcp():
    """The shm path's lease requests go through the loss rule too: a closed unit's server
    gives UnitLostError naming the unit and the keys, and the unit is marked lost."""
    from tests.conftest import local_units

    with local_units("shm", units=2, capacity=1 << 20) as (config, services, clients):
        refs = _write(clients, config, "r0", 10)
        shard = [{"logprobs": Layout.from_ref(ref)} for ref in refs]
        on_lost = {ref.key for ref in refs if ref.unit == "su-1"}
        assert on_lost and clients.transport_of("su-1")[0] == "shm"
        with Reader(clients, config) as reader:
            reader.fetch(shard)  # connected, arenas mapped, before the fault
            assert clients.channel("su-1").mapping is not None  # read in place from the mapping
            services[1].close()
            with pytest.raises(UnitLostError, match="unit su-1 is lost") as info:
                reader.fetch(shard)
            assert info.value.unit == "su-1" and info.value.keys and set(info.value.keys) <= on_lost
            assert set(clients.lost) == {"su-1"}
            with pytest.raises(UnitLostError, match="su-1") as info:  # fails fast from now on, keys named
                reader.fetch(shard)
            assert set(info.value.keys) == on_lost
            kept = on_units(shard, clients.live_units)
            got = reader.fetch([shard[i] for i in kept])
        assert [float(g["rollout_log_probs"][0]) for g in got] == [float(i) for i in kept]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hold", [False, True], ids=["released-by-next", "held"])
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_a_streams_release_that_misses_a_lost_unit_ends_no_step_the_survivors_can_serve(transport, hold):
    """A stream with ``release`` whose earlier micro-batches read su-0: su-0 is lost once they are consumed.
    Their release reaches su-1 and frees its keys there; su-0's references are left to the rollout's
    release_partition, and the stream reads its later micro-batches (all on su-1) exactly, naming what it could
    not release in ``unreleased``. The release (by ``next()``, or by a held micro-batch's ``release()`` after
    its backward) once raised PartialFailureError, which ended a step that nothing kept from finishing, with
    an error that is not a ConnectionError as a lost unit's is."""
    from gputq.data.slices import ParallelSlice
    from tests.conftest import local_units

    with local_units(transport, units=2, capacity=4 << 20) as (config, services, clients):
        with Writer(clients, config) as writer:
            refs = [writer.put(f"s{i}", "p", {"routed_experts": np.full((20, 2, 2), i + 1, np.int32)})["routed_experts"]
                    for i in range(24)]
            writer.flush()
            order = sorted(range(24), key=lambda i: refs[i].unit)  # su-0's samples first
            shard = [{"routed_experts": Layout.from_ref(refs[i])} for i in order]
            writer.finalize(shard, "p")
        on_lost = sum(refs[i].unit == "su-0" for i in order)
        batches = [[p] for p in range(24)]
        assert 2 <= on_lost <= 20, on_lost
        with Reader(clients, config) as reader, \
                reader.stream(shard, batches, ParallelSlice(num_experts=16), prefetch=2, release="p",
                              hold=hold) as stream:
            for mb in stream:
                assert (mb.routed_experts[0][:20] == order[mb.index] + 1).all()
                if mb.index == on_lost - 1:  # su-0's last micro-batch: released when the next is asked for
                    # The one before it was released in the background: it reached su-0 before su-0 closed.
                    wait_until(lambda: services[0].stats()["keys"] == 1, 20, f"micro-batch {mb.index - 1}'s release")
                    services[0].close()
                if hold:
                    mb.release()
            assert stream.released == list(range(24))
            assert list(stream.unreleased) == [on_lost - 1] and "su-0" in stream.unreleased[on_lost - 1]
        assert set(clients.lost) == {"su-0"}
        assert services[1].stats()["keys"] == 0  # every survivor's key released by its micro-batch


@pytest.mark.timeout(60)
def test_a_mapped_source_of_a_closed_unit_raises_unit_lost_and_marks_it():
    from tests.conftest import local_units

    with local_units("shm", units=1, capacity=1 << 20) as (config, services, clients):
        (ref,) = _write(clients, config, "r0", 1)
        channel = clients.channel("su-0")
        with channel.mapped_source([ref.key], 5, generations=[ref.generation], device=False) as regions:
            assert regions.shape == (1, 2) and int(regions[0, 1]) == 256 * 4
        assert channel.device_mappable() in (True, False) and channel.mapping is not None
        services[0].close()
        with pytest.raises(UnitLostError, match="unit su-0 is lost") as info:
            with channel.mapped_source([ref.key], 5, generations=[ref.generation], device=False,
                                       ahead=False):
                pass
        assert info.value.unit == "su-0" and info.value.keys == (ref.key,)
        assert set(clients.lost) == {"su-0"}
        assert channel.mapping is None and channel.device_mappable() is False  # a lost unit maps nothing
        with pytest.raises(UnitLostError, match="su-0 is lost"):
            with channel.mapped_source([ref.key], 5, device=False):
                pass


def test_a_unit_at_its_connection_cap_is_busy_not_lost():
    """Slots held by other clients make a new client wait and retry; the unit stays live throughout."""
    from gputq.errors import UnitBusyError
    from gputq.transport.tcp import TcpTransport
    from tests.conftest import local_units

    # A request's connect is bounded by control_timeout_s (not by the request's own timeout).
    with local_units("tcp", units=1, max_connections=2, control_timeout_s=1.0) as (config, services, clients):
        address = services[0].address()
        hogs = [TcpTransport().connect(address, token=config.token, max_frame_bytes=config.max_frame_bytes,
                                       timeout=5) for _ in range(2)]
        started = time.monotonic()
        with pytest.raises(UnitBusyError, match="su-0"):
            clients.channel("su-0").call("stats", timeout=30)
        assert time.monotonic() - started < 2.0  # the connect's control_timeout_s (1 s), not the request's 30 s
        assert clients.lost == {} and clients.live_units == ["su-0"]
        answered = threading.Event()
        caller = threading.Thread(target=lambda: clients.channel("su-0").call("stats", timeout=5)
                                  and answered.set())
        caller.start()
        assert wait_until(lambda: services[0]._server.refused >= 4, what="the caller retrying")
        hogs.pop().close()  # a slot frees: the waiting caller takes it within its timeout
        assert answered.wait(5) and clients.lost == {}
        caller.join(5)
        for hog in hogs:
            hog.close()
