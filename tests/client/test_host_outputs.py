"""Whole-shard host restores write into memory of earlier fetches only once every array of it is gone."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from gputq.client.host_outputs import HostOutputs
from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.data.refs import Layout
from tests.conftest import local_units


def _address(array) -> int:
    return array.__array_interface__["data"][0]


def test_a_buffer_comes_back_only_when_its_last_view_is_gone():
    pool = HostOutputs()
    first = pool.take(1 << 20)
    address = _address(first)
    view = first[4096:8192].view(np.int32)
    del first
    gc.collect()
    assert pool.free_bytes == 0  # a view is alive
    other = pool.take(1 << 20)
    assert _address(other) != address  # so the next take is other memory
    del view
    assert pool.free_bytes >= 1 << 20
    assert _address(pool.take(1 << 20)) == address


def test_a_torch_tensor_of_an_output_keeps_it():
    torch = pytest.importorskip("torch", reason="torch tensors of restored arrays")
    pool = HostOutputs()
    out = pool.take(4096)
    out[:] = 7
    tensor = torch.from_numpy(out.view(np.int32))
    del out
    gc.collect()
    assert pool.free_bytes == 0
    pool.take(4096)[:] = 1  # other memory: the tensor's bytes stay
    assert int(tensor[0]) == 0x07070707
    del tensor
    assert pool.free_bytes >= 4096


def test_free_buffers_stay_within_twice_the_largest_taken_and_close_drops_them():
    pool = HostOutputs()
    for _ in range(6):  # six live at once, all given back together
        held = [pool.take(1 << 16) for _ in range(6)]
        del held
    assert pool.free_bytes == 6 << 16
    taken = pool.take(1 << 16)  # a take trims the free list to 2x the largest (the one taken leaves five)
    assert pool.free_bytes <= 2 << 16 and taken.nbytes == 1 << 16
    pool.close()
    pool.close()
    assert pool.free_bytes == 0
    pool.take(1 << 16)  # still usable; nothing is kept any more
    assert pool.free_bytes == 0


def test_a_buffer_given_back_while_take_holds_the_lock_does_not_deadlock():
    """The last view can die anywhere, the pool's own take included (a GC pass there)."""
    pool = HostOutputs()
    stash = [pool.take(1024)]
    original = pool._lock

    class DropsInside:
        def __enter__(self):
            original.acquire()
            stash.clear()  # the finalizer runs here, inside the locked region

        def __exit__(self, *exc):
            original.release()

    pool._lock = DropsInside()
    done = threading.Event()
    threading.Thread(target=lambda: (pool.take(1024), done.set()), daemon=True).start()
    assert done.wait(10)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_second_fetch_reuses_dropped_outputs_and_never_live_ones(transport):
    with local_units(transport, units=1, routed_experts_dtype="uint16") as (config, _, clients):
        rng = np.random.default_rng(5)
        experts = [rng.integers(0, 128, (300 + 50 * i, 4, 2)).astype(np.int32) for i in range(3)]
        log_probs = [rng.random(300 + 50 * i, dtype=np.float32) for i in range(3)]
        with Writer(clients, config) as writer:
            refs = [writer.put(f"s{i}", "p", {"routed_experts": e, "logprobs": lp})
                    for i, (e, lp) in enumerate(zip(experts, log_probs))]
            writer.flush()
        shard = [{name: Layout.from_ref(ref) for name, ref in r.items()} for r in refs]
        with Reader(clients, config) as reader:
            kept = reader.fetch(shard)
            kept_addresses = {_address(s["rollout_routed_experts"]) for s in kept}
            again = reader.fetch(shard)  # `kept` is alive: its memory must not be written
            assert kept_addresses.isdisjoint(_address(s["rollout_routed_experts"]) for s in again)
            for sample, want, want_lp in zip(kept, experts, log_probs):
                np.testing.assert_array_equal(sample["rollout_routed_experts"], want)
                np.testing.assert_array_equal(sample["rollout_log_probs"], want_lp)
            again_addresses = {_address(s["rollout_routed_experts"]) for s in again}
            del again
            third = reader.fetch(shard)
            assert {_address(s["rollout_routed_experts"]) for s in third} == again_addresses  # reused
            for sample, want, want_lp in zip(third, experts, log_probs):
                np.testing.assert_array_equal(sample["rollout_routed_experts"], want)
                np.testing.assert_array_equal(sample["rollout_log_probs"], want_lp)
        for sample, want in zip(kept, experts):  # a closed reader leaves its arrays valid
            np.testing.assert_array_equal(sample["rollout_routed_experts"], want)
