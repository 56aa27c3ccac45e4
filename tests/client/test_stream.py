"""Streamed micro-batches: exactly a rank's slice on the wire, slime's layout out, memory bounded."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="make test installs torch: these tests state slime's rows with it")

from gputq.client.lease_window import LEASED_ALONE, window_bounds
from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.data.packing import bits_for, packed_row_bytes
from gputq.data.refs import Layout
from gputq.data.slices import ParallelSlice
from gputq.errors import ClosedError, InvalidInputError, LayoutError, StaleReadError, UnknownKeyError
from tests.conftest import TRANSPORT_PARAMS, local_units
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

LAYERS, TOPK, EXPERTS = 6, 4, 16


def _pad(experts: torch.Tensor, pad: int, experts_count: int) -> torch.Tensor:
    """slime's pad block: arange(pad * L * K) % num_experts, after the rows."""
    if pad == 0:
        return experts
    _, layers, topk = experts.shape
    block = torch.arange(pad * layers * topk, dtype=experts.dtype).reshape(pad, layers, topk) % experts_count
    return torch.cat([experts, block])


def slime_replay_rows(samples: list[torch.Tensor], rank: ParallelSlice, *, experts: int = EXPERTS) -> torch.Tensor:
    """What slime hands Megatron for one micro-batch (thd, no allgather CP): ``[tokens, L, K]``.

    Written from slime's documented steps on whole tensors: one pad row per
    sample, zigzag CP chunks of the padded sample, the batch padded to
    ``tp_size * pad_multiple``, the sequence-parallel share.
    """
    parts = []
    for routes in samples:
        routes = _pad(routes, 1, experts)
        if rank.cp_size > 1:
            n = len(routes)
            chunk = (n + 2 * rank.cp_size - 1) // (2 * rank.cp_size)
            routes = _pad(routes, 2 * rank.cp_size * chunk - n, experts)
            r = rank.cp_rank
            routes = torch.cat([routes[r * chunk:(r + 1) * chunk],
                                routes[(2 * rank.cp_size - r - 1) * chunk:(2 * rank.cp_size - r) * chunk]])
        parts.append(routes)
    rows = torch.cat(parts)
    size = rank.tp_size * rank.pad_multiple
    rows = _pad(rows, (size - len(rows) % size) % size, experts)
    if rank.sequence_parallel:
        share = len(rows) // rank.tp_size
        rows = rows[share * rank.tp_rank:share * (rank.tp_rank + 1)]
    return rows


def slime_log_probs(log_probs: torch.Tensor, total: int, rank: ParallelSlice) -> torch.Tensor:
    """slime's CP cut of response logprobs, by the logits offsets of the two chunks."""
    if rank.cp_size == 1:
        return log_probs
    chunk = (total + 2 * rank.cp_size - 1) // (2 * rank.cp_size)
    prompt = total - len(log_probs)
    out = []
    for start, stop in ((rank.cp_rank * chunk, (rank.cp_rank + 1) * chunk),
                        ((2 * rank.cp_size - rank.cp_rank - 1) * chunk, (2 * rank.cp_size - rank.cp_rank) * chunk)):
        lo, hi = max(start, prompt - 1), min(stop, total - 1)
        if lo < hi:
            out.append(log_probs[lo - (prompt - 1):hi - (prompt - 1)])
    return torch.cat(out) if out else log_probs[:0]


def _rollout(writer, rng, lengths, dtype=np.uint16, *, layers=LAYERS, topk=TOPK):
    """Samples of one step each (R3 rows T-1, logprobs over the response's last half)."""
    shard, data = [], []
    for i, total in enumerate(lengths):
        experts = rng.integers(0, EXPERTS, (total - 1, layers, topk)).astype(np.int32)
        log_probs = rng.standard_normal(total // 2).astype(np.float32)
        refs = writer.put(f"s{i}/0", "p", {"routed_experts": experts, "logprobs": log_probs})
        shard.append({name: Layout.from_ref(ref) for name, ref in refs.items()})
        data.append((experts, log_probs, total))
    writer.flush()
    return shard, data


@contextlib.contextmanager
def _stored(seed: int, lengths, *, finalize: bool = False, transport: str = "tcp", **overrides):
    """One in-process unit over ``transport`` holding a rollout of ``lengths``; yields (config, units, clients,
    shard, data)."""
    with local_units(transport, units=1, **overrides) as (config, units, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, np.random.default_rng(seed), lengths)
            if finalize:
                writer.finalize(shard, "p")
        yield config, units, clients, shard, data


#: The names the threads of a Reader and its streams start with.
READ_THREADS = ("gputq-prefetch", "gputq-restore", "gputq-release", "gputq-reader", "gputq-reaper")


def _threads_since(before: set, prefixes: tuple = READ_THREADS) -> list:
    """The names (less their numbers) of the threads started since ``before`` that start with ``prefixes``."""
    return sorted(t.name.rstrip("_0123456789") for t in set(threading.enumerate()) - before
                  if t.name.startswith(prefixes))


def _bytes_read(units) -> int:
    return sum(unit.stats()["bytes_read"] for unit in units)


#: Stored bytes of one layer's row of TOPK IDs below EXPERTS: uint16, and packed (4 bits an ID).
ROW_BYTES = {"uint16": TOPK * 2, "packed": packed_row_bytes(TOPK, bits_for(EXPERTS))}

#: Stored formats read in place over shm: whole-byte IDs widened, and packed IDs unpacked, where they lie.
IN_PLACE_FORMATS = {"uint16": {"routed_experts_dtype": "uint16"},
                    "packed": {"routed_experts_dtype": "packed", "num_experts": EXPERTS}}


@pytest.mark.parametrize("dtype", sorted(ROW_BYTES))
@pytest.mark.parametrize("transport", ["tcp", "shm", pytest.param("rdma", marks=pytest.mark.rdma)])
def test_stream_matches_slime_and_moves_exactly_the_slice(transport, dtype):
    if transport == "rdma":
        from tests.conftest import nixl_usable

        if nixl_usable():
            pytest.skip(nixl_usable())
    rng = np.random.default_rng(7)
    lengths = [37, 50, 64, 23, 41, 58]
    with local_units(transport, units=2, routed_experts_dtype=dtype, num_experts=EXPERTS) as (config, units, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, rng, lengths)
        batches = [[0, 1], [2], [3, 4, 5]]
        for stage in (range(0, 3), range(3, 6)):
            for cp_rank in range(2):
                rank = ParallelSlice(layers=stage, cp_rank=cp_rank, cp_size=2, num_experts=EXPERTS, tp_size=2,
                                     pad_multiple=4)
                before = _bytes_read(units)
                expected_bytes = 0
                with Reader(clients, config) as reader, reader.stream(shard, batches, rank) as stream:
                    consumed = [mb.index for mb in stream if _check(mb, batches[mb.index], data, stage, rank)]
                moved = _bytes_read(units) - before
                assert consumed == [0, 1, 2]
                for batch in batches:
                    for i in batch:  # the slice: stored rows the CP chunks hold, of this stage's layers
                        rows = data[i][2] - 1
                        chunk = -(-(rows + 1) // 4)
                        chunks = ((cp_rank * chunk, (cp_rank + 1) * chunk), ((3 - cp_rank) * chunk, (4 - cp_rank) * chunk))
                        kept = sum(max(0, min(b, rows) - a) for a, b in chunks)
                        expected_bytes += kept * len(stage) * ROW_BYTES[dtype]
                        expected_bytes += 4 * len(slime_log_probs(torch.from_numpy(data[i][1]), data[i][2], rank))
                assert moved == expected_bytes


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_over_tcp_on_the_host_micro_batches_land_widened_with_no_staging(monkeypatch, dtype):
    """Each chunk of a reply is widened as it lands (no compact buffer, no staged read), and gives the
    micro-batches the staged path gives; a long sample's runs (a layer's tokens) end chunks where they end."""
    from gputq.client.unit_channel import UnitChannel, UnitReadPipeline

    rng = np.random.default_rng(3)
    lengths = [37, 50, 64, 23, 41, 40_000]  # the last: a run of 20,000 tokens per layer, at least a quarter chunk
    breaks = []
    receive = UnitReadPipeline.receive

    def spied(self, sink, timeout=None, **kwargs):
        breaks.extend(kwargs.get("breaks", ()))
        return receive(self, sink, timeout, **kwargs)
    with local_units("tcp", units=2, routed_experts_dtype=np.dtype(dtype).name) as (config, _, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, rng, lengths, dtype)
        batches = [[0, 1], [2], [3, 4, 5]]
        rank = ParallelSlice(layers=range(1, 4), cp_rank=1, cp_size=2, num_experts=EXPERTS)

        def consume(reader):
            with reader.stream(shard, batches, rank) as stream:
                held = stream.buffer_bytes
                restored = [([np.array(layer) for layer in mb.routed_experts], [np.array(lp) for lp in mb.log_probs])
                            for mb in stream if _check(mb, batches[mb.index], data, range(1, 4), rank)]
            return restored, held

        with Reader(clients, config) as reader:
            with monkeypatch.context() as patch:
                patch.setattr(UnitChannel, "read", lambda *a, **k: pytest.fail("a staged read over tcp"))
                patch.setattr(UnitReadPipeline, "receive", spied)
                landed, held = consume(reader)
            assert len(breaks) >= 3  # the long sample's layers, each a run that ends a chunk
            with monkeypatch.context() as patch:
                patch.setattr(UnitChannel, "pipelines_reads", property(lambda self: False))
                staged, _ = consume(reader)
        for (experts, log_probs), (want_experts, want_log_probs) in zip(landed, staged, strict=True):
            assert all(np.array_equal(a, b) for a, b in zip(experts, want_experts, strict=True))
            assert all(np.array_equal(a, b) for a, b in zip(log_probs, want_log_probs, strict=True))
        # Three output buffers (the consumed micro-batch and two in flight), sized for the largest
        # micro-batch, and nothing else: its 3 layers of int32 IDs and its float32 logprobs.
        largest = (max(sum(e.nbytes for e in experts) for experts, _ in landed)
                   + max(sum(lp.nbytes for lp in log_probs) for _, log_probs in landed))
        assert held == 3 * largest


def test_a_read_that_fails_to_go_ahead_is_sent_again_by_its_own_micro_batch(monkeypatch):
    """A send ahead that fails (here a unit at its connection cap, once) costs the micro-batch behind
    nothing: its own fetch sends the read again and restores it exactly."""
    from gputq.client.fetch import ReadsAhead
    from gputq.errors import UnitBusyError
    from gputq.transport.tcp_pipeline import ReadPipeline

    rng = np.random.default_rng(11)
    lengths = [37, 50, 64, 23, 41, 58]
    batches = [[0, 1], [2, 3], [4, 5]]
    rank = ParallelSlice(layers=range(0, 3), cp_rank=0, cp_size=2, num_experts=EXPERTS)
    refused, sending_ahead = [], threading.Event()
    real_send, real_ahead = ReadPipeline.send, ReadsAhead.send_ahead

    def ahead(reads, plan):
        sending_ahead.set()
        try:
            real_ahead(reads, plan)
        finally:
            sending_ahead.clear()

    def send(pipe, *args, **kwargs):
        if not refused and sending_ahead.is_set():
            refused.append(pipe.unit)
            raise UnitBusyError(f"unit {pipe.unit} is at its connection cap")
        return real_send(pipe, *args, **kwargs)

    monkeypatch.setattr(ReadsAhead, "send_ahead", ahead)
    monkeypatch.setattr(ReadPipeline, "send", send)
    with local_units("tcp", units=2, routed_experts_dtype="uint16") as (config, _, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, rng, lengths)
        with Reader(clients, config) as reader:
            with reader.stream(shard, batches, rank) as stream:
                consumed = [mb.index for mb in stream if _check(mb, batches[mb.index], data, range(0, 3), rank)]
    assert consumed == [0, 1, 2] and len(refused) == 1


def test_over_tcp_on_the_host_the_fetch_after_the_prefetched_ones_starts_while_the_consumer_waits(monkeypatch):
    """A consumer waiting for a micro-batch holds none: the fetch after the prefetched ones is queued then,
    not once the consumer has woken up with its micro-batch (on a busy host, milliseconds after it landed),
    and it lands in the buffer the consumer gave back: never more than prefetch + 1 output buffers."""
    import gputq.client.fetch_ways as ways_module
    import gputq.client.stream as stream_module
    from gputq.client.stream_buffers import StreamBuffers

    lengths = [37, 50, 64, 23, 41, 58]
    batches = [[0, 1], [2, 3], [4, 5]]
    rank = ParallelSlice(layers=range(0, 3), cp_rank=1, cp_size=2, num_experts=EXPERTS)
    first_may_land, second_queued, second_landed = threading.Event(), threading.Event(), threading.Event()
    real_land, real_submit = ways_module.land_replies, stream_module.MicroBatchStream._submit
    real_outputs = StreamBuffers.new_outputs
    made, queued = [], []

    def land(plan, *args, **kwargs):
        if plan.index == 0:
            assert first_may_land.wait(30)
        real_land(plan, *args, **kwargs)
        if plan.index == 1:
            second_landed.set()

    def submit(stream):
        queued.append(stream._submitted)
        if stream._submitted == 1:
            second_queued.set()
        real_submit(stream)

    def new_outputs(buffers):
        made.append(1)
        return real_outputs(buffers)

    monkeypatch.setattr(ways_module, "land_replies", land)
    monkeypatch.setattr(stream_module.MicroBatchStream, "_submit", submit)
    monkeypatch.setattr(StreamBuffers, "new_outputs", new_outputs)
    with _stored(2, lengths) as (config, _, clients, shard, data), Reader(clients, config) as reader:
        with reader.stream(shard, batches, rank, prefetch=1) as stream:
            consumed, first = [], threading.Thread(target=lambda: consumed.append(next(stream).index))
            first.start()
            try:
                assert second_queued.wait(10), "the next fetch waited for the consumer to take its micro-batch"
            finally:
                first_may_land.set()
                first.join(30)
            assert consumed == [0]
            # While the consumer holds the first, one fetch is in flight (prefetch 1), however long it holds it.
            assert second_landed.wait(30)
            assert queued == [0, 1]
            consumed += [mb.index for mb in stream if _check(mb, batches[mb.index], data, range(0, 3), rank)]
    assert consumed == [0, 1, 2]
    assert len(made) == 2  # prefetch + 1, made up front: the third micro-batch landed in the first's buffer


def _check(mb, batch, data, stage, rank) -> bool:
    """The micro-batch as slime would build it from the whole samples (its tensors live until the next)."""
    want = slime_replay_rows([torch.from_numpy(data[i][0]) for i in batch], rank)
    assert mb.samples == tuple(batch) and mb.layers == tuple(stage) and len(mb.routed_experts) == len(stage)
    for j, layer in enumerate(stage):
        got = torch.as_tensor(mb.routed_experts[j])
        assert got.dtype == torch.int32
        assert torch.equal(got, want[:, layer])
    for i, lp in zip(batch, mb.log_probs):
        assert torch.equal(torch.as_tensor(lp), slime_log_probs(torch.from_numpy(data[i][1]), data[i][2], rank))
    return True


def _stale(layout: Layout) -> Layout:
    """``layout`` naming a generation of its keys one past the stored one (a reference gone stale)."""
    frags = tuple(dataclasses.replace(f, ref=dataclasses.replace(f.ref, generation=f.ref.generation + 1))
                  for f in layout.fragments)
    return dataclasses.replace(layout, fragments=frags)


def _leases_taken(unit) -> int:
    return unit.stats()["reads"]  # a one-sided reader's lease is the unit's read


def _streamed_over_shm(seed: int, batches: list, lengths=(37, 50, 64, 23), dtype: str = "uint16") -> tuple[list, int]:
    """A stream of ``batches`` of samples of ``lengths`` on one shm unit, every micro-batch checked against
    slime's rows: (the micro-batches consumed, the leases the unit granted beyond one per window)."""
    rank = ParallelSlice(layers=range(0, LAYERS), num_experts=EXPERTS)
    with local_units("shm", units=1, **IN_PLACE_FORMATS[dtype]) as (config, units, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, np.random.default_rng(seed), list(lengths))
        before = _leases_taken(units[0])
        with Reader(clients, config) as reader, reader.stream(shard, batches, rank) as stream:
            consumed = [mb.index for mb in stream if _check(mb, batches[mb.index], data, range(0, LAYERS), rank)]
        return consumed, _leases_taken(units[0]) - before - len(window_bounds(len(batches)))


def test_window_bounds_grow_to_the_most_and_cover_every_micro_batch_once():
    assert LEASED_ALONE == 2
    assert window_bounds(0) == []
    assert window_bounds(1) == [(0, 1)]
    assert window_bounds(20) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 20)]
    assert window_bounds(6, most=2) == [(0, 1), (1, 2), (2, 4), (4, 6)]


def test_in_place_a_fetch_places_only_its_own_window_and_the_windows_ahead_are_placed_after_it(monkeypatch):
    """Over shm a fetch returns once its own micro-batch's window is placed; the windows ahead are placed by
    the task queued behind it on the fetch thread (none behind the two fetches leased alone), four
    micro-batches at a time, while it is restored: a fetch never waits for a window ahead to be placed."""
    from gputq.client import lease_window, plan as planning

    doing, placed = [None], []
    for name in ("__call__", "place_ahead"):
        def labelled(self, plan, _name=name, _work=getattr(lease_window.LeaseWindows, name)):
            doing[0] = (_name, plan.index)
            try:
                return _work(self, plan)
            finally:
                doing[0] = None
        monkeypatch.setattr(lease_window.LeaseWindows, name, labelled)
    finish = planning.MicroPlan.finish

    def recorded(self):
        if self.requests is None and doing[0] is not None:
            placed.append((*doing[0], self.index))
        return finish(self)
    monkeypatch.setattr(planning.MicroPlan, "finish", recorded)
    batches = [[i] for i in range(10)]  # windows [0] [1] [2, 4) [4, 8) [8, 10)
    consumed, _ = _streamed_over_shm(5, batches, (37, 50, 64, 23, 41, 19, 33, 28, 45, 30))
    assert consumed == list(range(10))
    assert placed == [("__call__", 0, 0), ("__call__", 1, 1), ("__call__", 2, 2), ("__call__", 2, 3),
                      *(("place_ahead", 2, i) for i in range(4, 8)), ("place_ahead", 3, 8), ("place_ahead", 3, 9)]


def test_in_place_close_waits_for_the_placement_under_way_on_the_fetch_thread(monkeypatch):
    """A stream closed while a window ahead is being placed returns only once that placement has ended (it
    sees the stream closed), so nothing of the closed stream still runs on the reader's fetch thread."""
    from gputq.client import lease_window

    place_ahead, started, go, order = lease_window.LeaseWindows.place_ahead, threading.Event(), threading.Event(), []

    def held(self, plan):
        if plan.index == LEASED_ALONE:
            started.set()
            assert go.wait(10)
            order.append("placed")
        return place_ahead(self, plan)
    monkeypatch.setattr(lease_window.LeaseWindows, "place_ahead", held)
    lengths = [37, 50, 64, 23, 41, 19, 33, 28]
    batches = [[i] for i in range(len(lengths))]
    rank = ParallelSlice(layers=range(0, LAYERS), num_experts=EXPERTS)
    with local_units("shm", units=1, routed_experts_dtype="uint16") as (config, units, clients):
        with Writer(clients, config) as writer:
            shard, _ = _rollout(writer, np.random.default_rng(17), lengths)
        with Reader(clients, config) as reader:
            stream = reader.stream(shard, batches, rank)
            # Queues micro-batch 2's fetch and its placement behind it, the last task of the fetch thread: no
            # fetch behind it, whose future close() would wait for anyway.
            assert next(stream).index == 0
            assert started.wait(10)
            closing = threading.Thread(target=lambda: (stream.close(), order.append("closed")))
            closing.start()
            closing.join(0.2)
            assert closing.is_alive() and order == []  # still placing: close waits for it
            go.set()
            closing.join(10)
            assert order == ["placed", "closed"]
            wait_until(lambda: units[0].stats()["leases"] == 0, 10, "the leases of a closed stream to end")


@pytest.mark.parametrize("dtype", sorted(IN_PLACE_FORMATS))
def test_in_place_a_window_of_micro_batches_shares_one_lease_and_every_lease_ends(dtype):
    """Over shm one lease per unit covers a window of micro-batches (after the first two, 2, 4, 8 ...): the
    unit grants one per window, not one per micro-batch, the bytes are exact, and once the stream is closed (here before
    its end, with windows leased ahead) the unit holds no lease."""
    rng = np.random.default_rng(13)
    lengths = [37, 50, 64, 23, 41, 19, 33, 28, 45, 30]
    batches = [[i] for i in range(len(lengths))]
    rank = ParallelSlice(layers=range(0, LAYERS), num_experts=EXPERTS)
    with local_units("shm", units=1, **IN_PLACE_FORMATS[dtype]) as (config, units, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, rng, lengths)
        before = _leases_taken(units[0])
        with Reader(clients, config) as reader:
            with reader.stream(shard, batches, rank) as stream:
                consumed = [mb.index for mb in stream if _check(mb, batches[mb.index], data, range(0, LAYERS), rank)]
            assert consumed == list(range(len(batches)))
            assert _leases_taken(units[0]) - before == len(window_bounds(len(batches))) == 5
            wait_until(lambda: units[0].stats()["leases"] == 0, 10, "the windows' leases to end")
            with reader.stream(shard, batches, rank) as stream:
                assert next(stream).index == 0 and next(stream).index == 1  # windows [1, 3) and [3, 7) leased
            wait_until(lambda: units[0].stats()["leases"] == 0, 10, "the leases of a closed stream to end")


def _hinted_first(monkeypatch) -> None:
    """Hold every window's leases back until a micro-batch of it was restored on the key directory's regions
    (so that micro-batch always finds its window's leases on their way)."""
    from gputq.client import lease_window

    hinted, take, looked = lease_window.LeaseWindows._hinted, lease_window._Lease.take, threading.Event()

    def hinting(self, window, plan):
        try:
            return hinted(self, window, plan)
        finally:
            looked.set()

    def after_a_hint(self, context):
        assert looked.wait(10)
        return take(self, context)

    monkeypatch.setattr(lease_window.LeaseWindows, "_hinted", hinting)
    monkeypatch.setattr(lease_window._Lease, "take", after_a_hint)


@pytest.mark.parametrize("path", ["window", "hinted"])
def test_in_place_a_restore_its_window_did_not_cover_is_leased_alone_and_restored_again(monkeypatch, path):
    """A restore that ended past its window's proven lease lifetime may have read another key's bytes: the
    micro-batch is leased on its own and restored again, and the consumer sees the right bytes; whether
    its window's leases were in when it was fetched (``window``) or on their way (``hinted``)."""
    from gputq.client import lease_window
    from gputq.transport.one_sided import HeldLease

    covered, missed = HeldLease.covered, []

    def late_once(self, now=None):
        if not missed:
            missed.append(True)
            return False
        return covered(self, now)

    monkeypatch.setattr(HeldLease, "covered", late_once)
    if path == "window":
        monkeypatch.setattr(lease_window.LeaseWindows, "_hinted", lambda self, window, plan: None)
    else:
        _hinted_first(monkeypatch)
    consumed, extra = _streamed_over_shm(14, [[0], [1, 2], [3]])
    assert consumed == [0, 1, 2] and missed and extra == 1  # the one leased alone


def _expired(unit, granted: int) -> None:
    """Wait until ``unit`` granted a lease past ``granted`` and then expired every lease it held."""
    wait_until(lambda: _leases_taken(unit) > granted, 10, "the unit to grant the lease")
    wait_until(lambda: unit.stats()["leases"] == 0, 10, "the unit to expire the lease")


@pytest.mark.parametrize("consumer", ["iterated", "replayed"])
def test_in_place_a_consumer_that_comes_after_its_first_leases_expired_gets_them_leased_again(consumer):
    """``prefetch=1``: micro-batch 0 is leased (alone, as a stream's first are) when the stream opens and restored
    when first asked for. A trainer that asks only after the unit expired that lease (it waited at a barrier,
    say) gets it leased again and restored exactly, iterated or through slime's replay handles: one lease more
    than an unstalled stream of the same shard, and no error."""
    rank, batches = ParallelSlice(num_experts=EXPERTS), [[i] for i in range(4)]
    with _stored(23, [40, 30, 50, 20], transport="shm", routed_experts_dtype="uint16", read_timeout_s=1.0) as \
            (config, units, clients, shard, data):
        stalled = []
        for stall in (False, True):
            granted = _leases_taken(units[0])
            with Reader(clients, config) as reader, reader.stream(shard, batches, rank, prefetch=1) as stream:
                handles = stream.replay_handles() if consumer == "replayed" else None
                if stall:
                    _expired(units[0], granted)
                if handles is None:
                    seen = [mb.index for mb in stream if _check(mb, batches[mb.index], data, range(LAYERS), rank)]
                else:
                    seen = []
                    for index, layers in enumerate(handles):
                        want = slime_replay_rows([torch.from_numpy(data[index][0])], rank)
                        for direction in ("forward", "backward"):
                            for layer, handle in enumerate(layers):
                                got = torch.as_tensor(handle.materialize_for_routing_replay(direction))
                                assert torch.equal(got, want[:, layer])
                        seen.append(index)
            assert seen == [0, 1, 2, 3]
            stalled.append(_leases_taken(units[0]) - granted)
        assert stalled[1] == stalled[0] + 1, stalled
        wait_until(lambda: units[0].stats()["leases"] == 0, 10, "every lease to end")


@pytest.mark.parametrize("prefetch", [1, 2])
def test_in_place_a_restore_that_outlasts_its_lease_taken_again_too_is_a_stale_read_that_returns_nothing(
        monkeypatch, prefetch):
    """Micro-batch 0's restore reads the mapping until the unit expired its lease, and again under the lease
    taken again (a host stalled inside the restore itself): the consumer gets ``LeaseExpiredError`` (a
    ``StaleReadError``) and no bytes, then ``ClosedError`` naming it; the leases end, and the Reader's next
    stream is whole. Restored by the consumer (``prefetch=1``) or ahead on the restore thread (2)."""
    from gputq.errors import LeaseExpiredError
    from gputq.kernels import MappedSource

    real, held = MappedSource.widen_scatter, []
    rank, batches = ParallelSlice(num_experts=EXPERTS), [[i] for i in range(4)]
    with _stored(23, [40, 30, 50, 20], transport="shm", routed_experts_dtype="uint16", read_timeout_s=1.0) as \
            (config, units, clients, shard, data):

        def past_its_lease(source, plan, width, out, *args, **kwargs):
            if out.dtype == np.int32 and len(held) < 2:  # micro-batch 0's R3, under its lease, then the next
                held.append(True)
                # Its first lease and those fetched beside it (``prefetch``); then the one taken again.
                _expired(units[0], granted + prefetch - 1 if len(held) == 1 else granted + prefetch)
            return real(source, plan, width, out, *args, **kwargs)

        granted = _leases_taken(units[0])
        with Reader(clients, config) as reader:
            monkeypatch.setattr(MappedSource, "widen_scatter", past_its_lease)
            with reader.stream(shard, batches, rank, prefetch=prefetch) as stream:
                got = None
                with pytest.raises(LeaseExpiredError, match="expired before the copy finished"):
                    got = next(stream)
                assert got is None and len(held) == 2
                with pytest.raises(ClosedError, match=r"micro-batch 0 raised LeaseExpiredError: micro-batches 0\.\. "
                                                      r"of 4 were not read"):
                    next(stream)
            monkeypatch.setattr(MappedSource, "widen_scatter", real)
            with reader.stream(shard, batches, rank) as stream:
                assert [mb.index for mb in stream if _check(mb, batches[mb.index], data, range(LAYERS), rank)] \
                    == [0, 1, 2, 3]
        wait_until(lambda: units[0].stats()["leases"] == 0, 10, "every lease to end")


@pytest.mark.parametrize("dtype", sorted(ROW_BYTES))
@pytest.mark.parametrize("shifted", [1, 3])
def test_in_place_a_stale_directory_costs_a_lease_of_its_own_not_wrong_bytes(monkeypatch, shifted, dtype):
    """A micro-batch is restored on the regions the key directory names while its lease (micro-batch 0's own: the
    first lookup, or micro-batch 2's window's: the third) is on its way; where those are other bytes (here: that
    lookup is shifted by a row, uint16 or packed), the lease disagrees, and the micro-batch is leased alone and
    restored again: the consumer sees the right bytes."""
    from gputq.transport.directory import DirectoryView

    lookup, lookups = DirectoryView.lookup, []

    def stale_once(self, keys, generations, *, within=None):
        regions = lookup(self, keys, generations, within=within)
        lookups.append(True)
        if regions is not None and len(lookups) == shifted:
            regions = regions.copy()
            regions[:, 0] += ROW_BYTES[dtype]  # a row of IDs further on: other bytes of the arena
        return regions

    monkeypatch.setattr(DirectoryView, "lookup", stale_once)
    _hinted_first(monkeypatch)
    consumed, extra = _streamed_over_shm(16, [[0, 1], [2], [3]], dtype=dtype)
    assert consumed == [0, 1, 2] and len(lookups) >= shifted and extra == 1  # the one leased alone


def test_in_place_streams_leasing_their_windows_at_once_never_wait_on_each_other(monkeypatch):
    """Each stream leases its windows on the reader's pool, a window's leases in parallel (here one per key: a
    request limit of 1 splits each window). Four streams leasing at once on a one-unit reader (a pool of two
    threads) each read every micro-batch. Before, two windows filled the pool, each waiting for its other
    leases queued behind them, and every stream hung for ever."""
    import gputq.client.lease_window as lease_window

    monkeypatch.setattr(lease_window, "READ_BATCH_KEYS", 1)
    rank = ParallelSlice(layers=range(0, 2), num_experts=EXPERTS)
    batches = [[i, i + 16] for i in range(16)]
    with local_units("shm", units=1, routed_experts_dtype="uint16") as (config, units, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, np.random.default_rng(25), [40, 30, 50, 20, 60, 35, 45, 25] * 4)
        reader, consumed = Reader(clients, config), []

        def one_step():
            with reader.stream(shard, batches, rank) as stream:
                consumed.append([_check(mb, batches[mb.index], data, range(0, 2), rank) for mb in stream])
        steps = [threading.Thread(target=one_step, daemon=True) for _ in range(4)]
        for step in steps:
            step.start()
        wait_until(lambda: not any(step.is_alive() for step in steps), 60, "the streams leasing at once to end",
                   interval=0.05)  # else the reader is left as it is: closing it would wait for them
        reader.close()
        assert consumed == [[True] * 16] * 4
        wait_until(lambda: units[0].stats()["leases"] == 0, 10, "the streams' leases to end")


def test_in_place_a_stale_key_fails_its_own_micro_batch_not_the_others_of_its_window():
    """Micro-batch 3's reference is stale: the lease of its window ([2, 4)) is refused, micro-batch 2 is
    leased alone and yielded exactly, and micro-batch 3 raises the unit's StaleReadError at its own turn."""
    rng = np.random.default_rng(15)
    lengths, batches = [37, 50, 64, 23], [[0], [1], [2], [3]]
    rank = ParallelSlice(layers=range(0, LAYERS), num_experts=EXPERTS)
    with local_units("shm", units=1, routed_experts_dtype="uint16") as (config, _, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, rng, lengths)
        shard[3] = {name: _stale(layout) for name, layout in shard[3].items()}
        consumed = []
        with Reader(clients, config) as reader, reader.stream(shard, batches, rank) as stream:
            with pytest.raises(StaleReadError, match="generation"):
                for mb in stream:
                    assert _check(mb, batches[mb.index], data, range(0, LAYERS), rank)
                    consumed.append(mb.index)
        assert consumed == [0, 1, 2]


@pytest.mark.parametrize("restore_threads", [1, 3])
@pytest.mark.parametrize("transport, dtype", [("shm", "uint16"), ("shm", "packed"), ("tcp", "packed")])
def test_a_large_micro_batch_is_widened_in_shares(monkeypatch, transport, dtype, restore_threads):
    """Each micro-batch's R3 widen runs in ``restore_threads`` shares where every share restores at least
    MIN_SHARE_BYTES (shrunk here, so that these small micro-batches are shared): slime's rows all the same,
    read in place (shm) or staged (packed over tcp)."""
    from gputq.client import shape, widen_shares

    monkeypatch.setattr(widen_shares, "MIN_SHARE_BYTES", 256)
    widened = []
    real_restore = shape.restore_scatter
    monkeypatch.setattr(shape, "restore_scatter",
                        lambda compact, plan, width, *a, **k: (widened.append(width), real_restore(
                            compact, plan, width, *a, **k))[1])
    lengths = [37, 50, 64, 23, 41, 58, 30, 45]
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    rank = ParallelSlice(layers=range(1, 4), cp_rank=1, cp_size=2, num_experts=EXPERTS)
    with local_units(transport, units=2, restore_threads=restore_threads, **IN_PLACE_FORMATS[dtype]) as \
            (config, _, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, np.random.default_rng(9), lengths)
        with Reader(clients, config) as reader:
            with reader.stream(shard, batches, rank) as stream:
                assert [mb.index for mb in stream if _check(mb, batches[mb.index], data, range(1, 4), rank)] == \
                    [0, 1, 2, 3]
    # R3's widen (rows of TOPK IDs) of each micro-batch in restore_threads shares; logprobs' whole.
    assert widened.count(TOPK) == 4 * restore_threads and widened.count(1) == 4


@pytest.mark.parametrize("dtype", sorted(IN_PLACE_FORMATS))
def test_in_place_on_the_host_micro_batches_are_restored_ahead_while_the_consumer_holds_one(monkeypatch, dtype):
    """Read where they lie (shm), micro-batches need no compact buffer, packed IDs neither: the restore thread
    widens the prefetched ones into prefetch + 1 output buffers while the consumer holds one, never waiting for
    the buffer it gives back, and it is the fetch, not the consumer, that queues each restore."""
    from gputq.client.read_context import ReadContext
    from gputq.client.restores import Restores
    from gputq.client.stream_buffers import StreamBuffers

    lengths = [37, 50, 64, 23, 41, 58, 30, 45]
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    rank = ParallelSlice(layers=range(0, 3), cp_rank=0, cp_size=2, num_experts=EXPERTS)
    restored = {i: threading.Event() for i in range(len(batches))}
    real_restore, real_outputs, real_threads = Restores.restore, StreamBuffers.new_outputs, ReadContext.stream_threads
    made, queuing = [], []

    def restored_then_told(restores, plan, *args):
        shaped = real_restore(restores, plan, *args)
        restored[plan.index].set()
        return shaped

    def new_outputs(buffers):
        made.append(1)
        return real_outputs(buffers)

    def watched_threads(context):
        fetcher, restorer, releaser = real_threads(context)
        real_submit = restorer.submit
        restorer.submit = lambda *a, **k: (queuing.append(threading.current_thread()), real_submit(*a, **k))[1]
        return fetcher, restorer, releaser

    monkeypatch.setattr(Restores, "restore", restored_then_told)
    monkeypatch.setattr(StreamBuffers, "new_outputs", new_outputs)
    monkeypatch.setattr(ReadContext, "stream_threads", watched_threads)
    with local_units("shm", units=2, **IN_PLACE_FORMATS[dtype]) as (config, _, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, np.random.default_rng(8), lengths)
        with Reader(clients, config) as reader:
            with reader.stream(shard, batches, rank, prefetch=2) as stream:
                assert stream.buffer_bytes == 3 * stream.output_bytes  # prefetch + 1 outputs, nothing compact
                first = next(stream)
                # Held: the two prefetched ones are restored meanwhile, each into a buffer of its own.
                assert restored[1].wait(10) and restored[2].wait(10), "a restore waited for the consumer's buffer"
                assert _check(first, batches[0], data, range(0, 3), rank)
                consumed = [0] + [mb.index for mb in stream if _check(mb, batches[mb.index], data, range(0, 3), rank)]
    assert consumed == [0, 1, 2, 3]
    assert len(made) == 3
    assert len(queuing) == 4 and threading.main_thread() not in queuing


def test_stream_validates_before_reading():
    with _stored(1, [20, 30]) as (config, units, clients, shard, _):
        with Reader(clients, config) as reader:
            before = _bytes_read(units)
            with pytest.raises(InvalidInputError,
                               match=r"field .routed_experts.: layers 6..7 are past the 6 stored layers \(0..5\)"):
                reader.stream(shard, [[0], [1]], ParallelSlice(layers=range(4, 8), num_experts=EXPERTS))
            with pytest.raises(InvalidInputError, match="partition"):
                reader.stream(shard, [[0], [0, 1]])
            with pytest.raises(InvalidInputError, match="no micro-batch"):
                reader.stream(shard, [[1]])
            with pytest.raises(InvalidInputError, match="prefetch"):
                reader.stream(shard, [[0], [1]], prefetch=0)
            with pytest.raises(InvalidInputError, match=r"sample 1: token range \[25, 31\) is outside its 29 rows"):
                reader.stream(shard, [[0], [1]], token_ranges=[[(0, 4)], [(25, 31)]])
            with pytest.raises(InvalidInputError, match="sample 0: R3 has 19 rows"):
                reader.stream(shard, [[0], [1]], total_lengths=[21, 30])
            assert _bytes_read(units) == before  # nothing was read


def test_a_shard_mixing_stored_formats_or_fills_is_refused_by_name_and_read_apart():
    """Samples stored as uint8 and as uint16 IDs (two writers' configs), or logprobs with two fill values: one
    micro-batch (or whole-shard fetch) of both is refused naming the field, the formats and where; micro-batches
    that keep them apart read exactly."""
    rank = ParallelSlice(num_experts=EXPERTS)
    with _stored(4, [20, 30], routed_experts_dtype="uint16") as (config, units, clients, shard, data):
        with Writer(clients, dataclasses.replace(config, routed_experts_dtype="uint8")) as writer:
            narrow = np.random.default_rng(5).integers(0, EXPERTS, (24, LAYERS, TOPK)).astype(np.int32)
            refs = writer.put("narrow/0", "p", {"routed_experts": narrow})
        mixed = [{"routed_experts": shard[0]["routed_experts"]},
                 {"routed_experts": Layout.from_ref(refs["routed_experts"])}]
        filled = [shard[0], {**shard[1], "logprobs": dataclasses.replace(shard[1]["logprobs"], fill=-1.0)}]
        formats = r"mixes stored formats in {}: uint16\[6, 4\], uint8\[6, 4\]; read them apart$"
        with Reader(clients, config) as reader:
            before = _bytes_read(units)
            with pytest.raises(LayoutError, match="^field 'routed_experts' " + formats.format("the shard")):
                reader.fetch(mixed)
            with pytest.raises(LayoutError, match="^field 'routed_experts' " + formats.format("micro-batch 0")):
                reader.stream(mixed, [[0, 1]], rank)
            fills = r"^field 'logprobs' has several fill values in {}: \[-1\.0, 0\.0\]$"
            with pytest.raises(LayoutError, match=fills.format("the shard")):
                reader.fetch(filled)
            with pytest.raises(LayoutError, match=fills.format("micro-batch 0")):
                reader.stream(filled, [[0, 1]], rank)
            assert _bytes_read(units) == before
            with reader.stream(mixed, [[0], [1]], rank) as stream:
                restored = [np.stack(mb.routed_experts, axis=1) for mb in stream]
            # slime's one pad row after each sample (no CP, TP 1): the stored rows come first
            np.testing.assert_array_equal(restored[0][:19], data[0][0])
            np.testing.assert_array_equal(restored[1][:24], narrow)
            with reader.stream(filled, [[0], [1]], rank) as stream:  # a micro-batch's tensors live until the next
                assert [np.array_equal(mb.log_probs[0], data[mb.index][1]) for mb in stream] == [True, True]


@pytest.mark.parametrize("dtype", sorted(ROW_BYTES))
def test_a_rank_naming_other_experts_than_its_ids_were_stored_for_is_refused(dtype):
    """Pad rows hold ``arange % num_experts``: a rank whose count differs from the one its IDs were stored for
    (packed for it, or whole bytes checked below it; a wrong --num-experts) would get other pads than slime's.
    Refused before reading, where pads are needed; without pads the rank's own count stands."""
    with _stored(3, [20, 30], routed_experts_dtype=dtype, num_experts=EXPERTS) as (config, units, clients, shard,
                                                                                     data):
        assert {f.ref.num_experts or f.ref.id_limit for f in shard[0]["routed_experts"].fragments} == {EXPERTS}
        with Reader(clients, config) as reader:
            before = _bytes_read(units)
            with pytest.raises(InvalidInputError, match=r"micro-batch 0, field 'routed_experts': ParallelSlice"
                                                        r"\.num_experts is 64, but its IDs were stored for 16"):
                reader.stream(shard, [[0], [1]], ParallelSlice(num_experts=64))
            assert _bytes_read(units) == before
            rank = ParallelSlice(num_experts=EXPERTS)
            with reader.stream(shard, [[0], [1]], rank) as stream:
                assert all(_check(mb, [mb.index], data, range(LAYERS), rank) for mb in stream)
            # token ranges with no pad rows need no count at all
            with reader.stream(shard, [[0, 1]], ParallelSlice(), token_ranges=[[(0, 5)], [(2, 9)]]) as stream:
                np.testing.assert_array_equal(next(stream).routed_experts[0][:5], data[0][0][:5, 0])


def test_a_lost_key_raises_at_its_micro_batch_not_before_and_the_stream_never_ends_after_it():
    """The micro-batches before the lost key's are yielded; its own raises the unit's error; asked again, the
    stream raises ClosedError naming what was not read (from that error), never the end: a consumer that
    caught the error would otherwise train on part of its shard without knowing."""
    with _stored(2, [20, 30, 40, 25]) as (config, units, clients, shard, data):
        clients.channel(units[0].name).call("delete", keys=[shard[2]["routed_experts"].fragments[0].ref.key])
        with Reader(clients, config) as reader, reader.stream(shard, [[0], [1], [2], [3]],
                                                              ParallelSlice(num_experts=EXPERTS)) as stream:
            first = next(stream)
            np.testing.assert_array_equal(first.routed_experts[0][:19], data[0][0][:, 0])
            next(stream)
            with pytest.raises(UnknownKeyError):
                next(stream)
            for _ in range(2):
                with pytest.raises(ClosedError, match=r"micro-batch 2 raised UnknownKeyError: micro-batches 2\.\. "
                                                      r"of 4 were not read") as info:
                    next(stream)
                assert isinstance(info.value.__cause__, UnknownKeyError)


def test_a_lost_key_fails_its_lazy_handles_and_those_of_every_later_micro_batch_name_it():
    """slime's lazy handles: the lost key's micro-batch raises the unit's error at its first layer's replay;
    a later micro-batch's handle raises ClosedError naming the failed one (and its error as the cause)."""
    with _stored(2, [20, 30, 40, 25]) as (config, units, clients, shard, data):
        clients.channel(units[0].name).call("delete", keys=[shard[1]["routed_experts"].fragments[0].ref.key])
        with Reader(clients, config) as reader, reader.stream(shard, [[0], [1], [2], [3]],
                                                              ParallelSlice(num_experts=EXPERTS)) as stream:
            handles = stream.replay_handles()
            first = handles[0][0].materialize_for_routing_replay("forward")
            np.testing.assert_array_equal(np.asarray(first)[:19], data[0][0][:, 0])
            with pytest.raises(UnknownKeyError):
                handles[1][0].materialize_for_routing_replay("forward")
            with pytest.raises(ClosedError, match=r"micro-batch 1 raised UnknownKeyError: micro-batches 1\.\. of 4 "
                                                  r"were not read") as info:
                handles[2][0].materialize_for_routing_replay("forward")
            assert isinstance(info.value.__cause__, UnknownKeyError)


@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_closing_the_clients_under_a_live_stream_raises_closed_error_and_keeps_raising_it(transport):
    """Clients closed while micro-batches are prefetched: whatever was restored before is yielded whole, then
    ``ClosedError``, however the read in flight failed (a dropped connection, NIXL's dropped agent), never a
    lost unit or a transfer error, and never the end."""
    rng = np.random.default_rng(21)
    lengths = [37, 50, 64, 23, 41, 19, 33, 28]
    batches = [[i] for i in range(len(lengths))]
    rank = ParallelSlice(layers=range(0, LAYERS), num_experts=EXPERTS)
    with local_units(transport, units=2, routed_experts_dtype="uint16") as (config, _, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, rng, lengths)
        with Reader(clients, config) as reader, reader.stream(shard, batches, rank, prefetch=3) as stream:
            assert _check(next(stream), batches[0], data, range(0, LAYERS), rank)
            clients.close()
            errors = []
            for index in range(1, len(batches) + 2):
                try:
                    mb = next(stream)
                except ClosedError as exc:
                    errors.append(str(exc))
                    if len(errors) == 2:
                        break
                else:
                    assert not errors and mb.index == index and _check(mb, batches[index], data, range(0, LAYERS),
                                                                       rank)
            assert len(errors) == 2 and errors[1].endswith(f"of {len(batches)} were not read")


def test_release_per_micro_batch_frees_consumed_steps_only():
    with _stored(3, [20, 30, 40], finalize=True) as (config, units, clients, shard, _):
        with Reader(clients, config) as reader:
            stream = reader.stream(shard, [[0], [1], [2]], ParallelSlice(num_experts=EXPERTS), release="p")
            next(stream)
            next(stream)  # moving on consumed micro-batch 0: released in the background
            assert stream.released == [0]
            wait_until(lambda: units[0].stats()["keys"] == 4, 20, "micro-batch 0's release")
            stream.close()  # micro-batch 1 was handed out, never moved past: kept
            assert units[0].stats()["keys"] == 4
            assert stream.released == [0] and stream.unreleased == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hold", [False, True], ids=["released-by-next", "held"])
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_a_consumer_never_waits_for_a_micro_batchs_release(monkeypatch, transport, hold):
    """Every release call hangs at the unit: the consumer still reads the whole shard, its releases issued
    and none answered. Once the unit answers, the stream's end waits for them and every key is freed. The
    consumer once waited for each release's answer: a round trip per micro-batch, here a control timeout."""
    from tests.transport.units import hung_control

    with _stored(9, [20, 30, 40, 25], finalize=True, transport=transport, control_timeout_s=20) as (
            config, units, clients, shard, data):
        rank, stored = ParallelSlice(layers=range(0, 2), num_experts=EXPERTS), units[0].stats()["keys"]
        calls, control = [], units[0].unit.control
        monkeypatch.setattr(units[0].unit, "control", lambda method, args=None: (calls.append(method),
                                                                                 control(method, args))[1])
        with Reader(clients, config) as reader, \
                reader.stream(shard, [[0], [1], [2], [3]], rank, release="p", hold=hold) as stream:
            with hung_control(units[0].unit, methods=("release",)) as reached:
                for index in range(4):
                    mb = next(stream)
                    assert mb.index == index and _check(mb, [index], data, range(0, 2), rank)
                    if hold:
                        mb.release()
                wait_until(lambda: reached, 20, "the first release to reach the unit")
                assert stream.released == list(range(4 if hold else 3))
                assert reached == ["release"] and units[0].stats()["keys"] == stored  # the rest queue behind it
            with pytest.raises(StopIteration):
                next(stream)
            assert stream.released == [0, 1, 2, 3] and stream.unreleased == {}
            assert units[0].stats()["keys"] == 0
            # Those handed over while the first hung went together: fewer calls than micro-batches (held: the
            # first may have taken all four before it started; else micro-batch 3, handed over at the end, may
            # come after the second started).
            assert calls.count("release") in ((1, 2) if hold else (2, 3))
        assert clients.lost == {}


def test_a_release_the_unit_refuses_is_named_in_unreleased_and_logged(monkeypatch, caplog):
    """A release runs on the stream's thread, where an error would reach no one: a unit answering one (here,
    refusing the call) leaves the stream reading on, and the micro-batch names the unit and the error."""
    from gputq.errors import InvalidInputError as Refused

    with _stored(10, [20, 30], finalize=True) as (config, units, clients, shard, data):
        original = units[0].unit.control

        def refusing(method, args=None):
            if method == "release":
                raise Refused("release_id: not understood")
            return original(method, args)

        monkeypatch.setattr(units[0].unit, "control", refusing)
        rank = ParallelSlice(layers=range(0, 2), num_experts=EXPERTS)
        with Reader(clients, config) as reader, reader.stream(shard, [[0], [1]], rank, release="p") as stream:
            assert [mb.index for mb in stream if _check(mb, [mb.index], data, range(0, 2), rank)] == [0, 1]
        # One release each, or both in one where the second was handed over before the first started.
        assert stream.released == [0, 1]
        assert stream.unreleased == {i: {"su-0": "InvalidInputError: release_id: not understood"} for i in (0, 1)}
        assert "their release failed" in caplog.text and clients.lost == {}
        assert units[0].stats()["keys"] > 0


def test_memory_is_bounded_by_the_prefetch_depth_not_the_shard():
    """Traced peak while streaming shards of 4 and 12 micro-batches: the same, under (prefetch + 1) slices."""
    import tracemalloc

    rng = np.random.default_rng(4)
    tokens = 12_000
    peaks = {}
    with local_units("tcp", units=2, capacity=256 << 20) as (config, _, clients):
        with Writer(clients, config) as writer:
            shard, _ = _rollout(writer, rng, [tokens] * 12)
        rank = ParallelSlice(layers=range(0, 3), cp_rank=0, cp_size=2, num_experts=EXPERTS)
        # One micro-batch's slice, widened: half the tokens (plus pads) of 3 layers, int32, and its logprobs.
        slice_bytes = tokens // 2 * 3 * TOPK * 4 + tokens // 2 * 4
        for samples in (4, 12):
            part = shard[:samples]
            with Reader(clients, config) as reader:  # a new one: its buffers are made, not reused
                tracemalloc.start()
                try:
                    with reader.stream(part, [[i] for i in range(samples)], rank, prefetch=2) as stream:
                        for mb in stream:
                            assert mb.routed_experts[0].shape == (tokens // 2, TOPK)  # 2 of 4 CP chunks
                    peaks[samples] = tracemalloc.get_traced_memory()[1]
                finally:
                    tracemalloc.stop()
    fixed = 1 << 20
    assert 2 * slice_bytes <= peaks[12] <= 3 * slice_bytes + fixed, (peaks, slice_bytes)
    assert peaks[12] <= peaks[4] * 1.1 + (64 << 10), peaks  # flat in the shard size


@pytest.mark.parametrize("dtype", ["uint8", "packed"])
@pytest.mark.parametrize("cp_rank", [0, 1])  # 0: two runs of tokens per sample (zigzag chunks 0 and 3)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_stream_into_device_memory_under_the_cuda_stand_in(host_cuda, transport, cp_rank, dtype):
    """device="cuda": compact staging and the widened layers live in device memory; the kernel runs there
    (packed IDs: the unpack kernel)."""
    from tests.host_cuda import DEVICE

    rng = np.random.default_rng(5)
    with local_units(transport, units=2, routed_experts_dtype=dtype, num_experts=EXPERTS) as (config, _, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, rng, [33, 47, 21])
        rank = ParallelSlice(layers=range(2, 5), cp_rank=cp_rank, cp_size=2, num_experts=EXPERTS)
        with Reader(clients, config, device="cuda") as reader, reader.stream(shard, [[0, 2], [1]], rank) as stream:
            consumed = [mb.index for mb in stream if _check(mb, [[0, 2], [1]][mb.index], data, range(2, 5), rank)]
        assert consumed == [0, 1]
    launches = [entry for entry in host_cuda.log if entry[0] == "launch"]
    assert launches and {launch[5] for launch in launches} == {DEVICE}
    assert ("unpack" in {launch[7] for launch in launches}) == (dtype == "packed")


def test_held_micro_batches_stay_valid_until_released():
    with _stored(6, [20, 30, 40], finalize=True) as (config, _, clients, shard, data):
        rank = ParallelSlice(layers=range(0, 2), num_experts=EXPERTS)
        with Reader(clients, config) as reader, reader.stream(shard, [[0], [1], [2]], rank, hold=True,
                                                              release="p") as stream:
            first, second = next(stream), next(stream)  # two forwards before the first backward
            assert _check(first, [0], data, range(0, 2), rank) and _check(second, [1], data, range(0, 2), rank)
            assert stream.released == []
            first.release()
            first.release()  # idempotent
            third = next(stream)  # restored into the buffers micro-batch 0 gave back
            assert _check(second, [1], data, range(0, 2), rank) and _check(third, [2], data, range(0, 2), rank)
            second.release()
            stream.close()  # waits for the releases issued; a pipeline's last backward runs after it
            assert _check(third, [2], data, range(0, 2), rank)
            third.release()  # released at once: nothing would wait for it now
            assert stream.released == [0, 1, 2] and clients.channel("su-0").call("stats")["keys"] == 0
            with pytest.raises(StopIteration):
                next(stream)


@pytest.mark.parametrize("ending", ["exhausted", "closed"])
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_micro_batches_held_past_their_streams_end_are_not_overwritten_by_the_next_stream(monkeypatch, transport,
                                                                                          ending):
    """A pipeline schedule's last backwards run after its stream ended: ``hold=True`` micro-batches collected
    with ``list(stream)`` (the stream ends itself), or still held when the step closes it. The Reader's next
    stream (another shard) must not restore into their buffers before they are released; once they are, it
    reuses them (no new memory)."""
    from gputq.client.read_context import Buffers

    rank, batches = ParallelSlice(num_experts=EXPERTS), [[i] for i in range(4)]
    with _stored(26, [40, 30, 50, 20], transport=transport, routed_experts_dtype="uint16") as \
            (config, _, clients, shard, data):
        with Writer(clients, config) as writer:
            other = [{name: Layout.from_ref(ref) for name, ref in writer.put(
                f"other/{i}", "p", {"routed_experts": np.full((n - 1, LAYERS, TOPK), i + 1, np.int32)}).items()}
                for i, n in enumerate([40, 30, 50, 20])]
        with Reader(clients, config) as reader:
            if ending == "exhausted":
                held = list(reader.stream(shard, batches, rank, hold=True))
            else:
                with reader.stream(shard, batches, rank, hold=True) as stream:
                    held = [next(stream) for _ in batches]

            def next_step() -> list:
                with reader.stream(other, batches, rank) as stream:
                    return [bool((mb.routed_experts[0][:10] == mb.index + 1).all()) for mb in stream]
            assert next_step() == [True] * 4
            assert [_check(mb, [mb.index], data, range(LAYERS), rank) for mb in held] == [True] * 4
            for mb in held:
                mb.release()
            empty, made = Buffers.empty, []
            monkeypatch.setattr(Buffers, "empty", lambda buffers, n: made.append(n) or empty(buffers, n))
            assert next_step() == [True] * 4 and made == []  # the released buffers serve it


@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_closing_the_reader_cuts_its_streams_short_with_a_typed_error_and_ends_their_leases(transport):
    """A Reader closed under a live stream closes the stream first (its work still runs on the reader's threads):
    the consumer asking for more gets ``ClosedError``, never the end of the pass nor a bare ``RuntimeError``,
    and no lease or thread of it is left. A stream consumed to its end still ends."""
    rank = ParallelSlice(layers=range(0, 2), num_experts=EXPERTS)
    with local_units(transport, units=2, routed_experts_dtype="uint16") as (config, units, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, np.random.default_rng(21), [40, 30, 50, 20, 60, 35])
        before = set(threading.enumerate())  # another test's reader left open is not this one's
        reader = Reader(clients, config)
        done = reader.stream(shard, [[0, 1, 2, 3, 4, 5]], rank)
        cut = reader.stream(shard, [[i] for i in range(6)], rank)
        assert _check(next(done), [0, 1, 2, 3, 4, 5], data, range(0, 2), rank)
        assert _check(next(cut), [0], data, range(0, 2), rank)
        reader.close()
        with pytest.raises(ClosedError, match=r"the Reader was closed: micro-batches 1\.\. of 6 were not read"):
            next(cut)
        with pytest.raises(ClosedError):  # and again: the pass stays cut short
            next(cut)
        with pytest.raises(StopIteration):
            next(done)
        cut.close()  # idempotent
        with pytest.raises(ClosedError, match="Reader is closed"):
            reader.stream(shard, [[i] for i in range(6)], rank)
        wait_until(lambda: all(unit.stats()["leases"] == 0 for unit in units), 10, "the cut stream's leases to end")
        assert _threads_since(before) == []


@pytest.mark.parametrize("hold", [False, True], ids=["restored-ahead", "hold"])
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_a_stream_dropped_unclosed_never_holds_up_the_next_and_ends_its_leases_once_it_is_garbage(transport, hold):
    """A training step raised out of its loop, and the trainer kept the error: the unclosed stream stays alive
    (the error's frames refer to its micro-batch), its work waiting for buffers its consumer holds. The
    reader's next stream still reads every micro-batch, and once the error goes and the stream is garbage its
    leases end (a released step's regions are free again), not after the units' lease timeout."""
    rank = ParallelSlice(layers=range(0, 2), num_experts=EXPERTS)
    batches = [[i] for i in range(8)]
    with local_units(transport, units=2, routed_experts_dtype="uint16") as (config, units, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, np.random.default_rng(22), [40, 30, 50, 20, 60, 35, 45, 25])
        before = set(threading.enumerate())
        with Reader(clients, config) as reader:
            held = []

            def train_until_a_step_raises():
                for batch in reader.stream(shard, batches, rank, hold=hold):
                    assert _check(batch, [batch.index], data, range(0, 2), rank)
                    if batch.index == 2:
                        held.append(sum(unit.stats()["leases"] for unit in units))
                        raise RuntimeError("the step failed")
                    batch.release()

            try:
                train_until_a_step_raises()
            except RuntimeError as exc:
                kept = exc
            # One-sided reads hold leases here (windows, leases taken ahead); a tcp unit's, only while it sends.
            assert len(held) == 1 and (transport == "tcp" or held[0] > 0)
            consumed = []

            def next_step():
                with reader.stream(shard, batches, rank, hold=hold) as stream:
                    for batch in stream:
                        consumed.append(_check(batch, [batch.index], data, range(0, 2), rank))
                        batch.release()
            step = threading.Thread(target=next_step, daemon=True)
            step.start()
            step.join(30)
            assert not step.is_alive() and consumed == [True] * 8, "the next stream was held up"
            del kept
            # Garbage once its work under way ran, then collected: in a cycle (its micro-batches refer to it),
            # by the collector's next pass.
            wait_until(lambda: gc.collect() >= 0 and all(unit.stats()["leases"] == 0 for unit in units), 10,
                       "the dropped stream's leases to end", interval=0.05)
        assert _threads_since(before) == []


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_closed_streams_threads_serve_the_reader_s_next_stream_and_stop_with_the_reader(transport):
    """A stream a step opens starts no threads: it takes the fetch and restore threads a closed one gave back
    (over tcp replies are widened as they land: no restore thread starts). Two streams open at once each have
    their own; the reader's close stops them all."""
    rank = ParallelSlice(layers=range(0, 2), num_experts=EXPERTS)
    with _stored(24, [40, 30, 50, 20], transport=transport, routed_experts_dtype="uint16") as \
            (config, _, clients, shard, data):
        before = set(threading.enumerate())
        started = lambda: _threads_since(before, ("gputq-prefetch", "gputq-restore"))  # noqa: E731
        pair = ["gputq-prefetch", "gputq-restore"] if transport == "shm" else ["gputq-prefetch"]
        with Reader(clients, config) as reader:
            for _ in range(3):
                with reader.stream(shard, [[0, 1], [2, 3]], rank) as stream:
                    assert [_check(mb, [2 * mb.index, 2 * mb.index + 1], data, range(0, 2), rank)
                            for mb in stream] == [True, True]
            assert started() == pair
            both = [[0, 1], [2, 3]]
            with reader.stream(shard, both, rank) as one, reader.stream(shard, both, rank) as two:
                assert _check(next(one), [0, 1], data, range(0, 2), rank)
                assert _check(next(two), [0, 1], data, range(0, 2), rank)
                assert started() == sorted(pair * 2)
        assert started() == []


def test_more_tcp_streams_than_a_channel_pools_connections_starve_no_call_and_lose_no_unit():
    """A tcp stream holds a connection to each unit it reads for its life (its read pipeline). Nine streams of
    one reader, each paused after its first micro-batch as a trainer computing, leave the channel's pooled
    connections to calls: a control call is answered, every stream reads on, and the unit stays live. Streams
    once took the channel's eight read connections, so the ninth stream's reads and the call each waited their
    whole timeout and marked the healthy unit lost."""
    from gputq.transport.tcp import CHANNEL_CONNECTIONS

    rank = ParallelSlice(layers=range(0, 2), num_experts=EXPERTS)
    with _stored(26, [40, 30, 50, 20], transport="tcp", routed_experts_dtype="uint16", control_timeout_s=5.0,
                 read_timeout_s=5.0) as (config, _, clients, shard, data):
        with Reader(clients, config) as reader, contextlib.ExitStack() as streams:
            opened = [streams.enter_context(reader.stream(shard, [[0, 1], [2, 3]], rank))
                      for _ in range(CHANNEL_CONNECTIONS + 1)]
            for stream in opened:
                assert _check(next(stream), [0, 1], data, range(0, 2), rank)
            assert clients.channel("su-0").call("stats", timeout=5)["keys"] == 8
            for stream in opened:
                assert _check(next(stream), [2, 3], data, range(0, 2), rank)
        assert clients.lost == {} and clients.live_units == ["su-0"]


@pytest.mark.parametrize("ending", ["closed", "raised"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_readers_dropped_unclosed_leave_no_thread_once_garbage(transport, ending):
    """A trainer that opens a Reader per step and never closes it: once each is garbage, none of its threads
    (its pool, its streams', its reaper) is left, whatever it streamed and fetched; also where each step
    raised out of its loop, dropping its stream unclosed too (the reaper, ending that stream, once kept the
    job it ran while it awaited the next: the job refers to the reader's context, which so stayed alive, and
    with it every thread of the reader)."""
    rank = ParallelSlice(layers=range(0, 2), num_experts=EXPERTS)
    with _stored(25, [40, 30, 50, 20], transport=transport, routed_experts_dtype="uint16") as \
            (config, units, clients, shard, data):
        with Writer(clients, config) as writer:
            writer.finalize(shard, "p", readers=3)  # each step releases micro-batch 0 once
        before = set(threading.enumerate())

        def step():
            reader = Reader(clients, config)
            stream = reader.stream(shard, [[0, 1], [2, 3]], rank, release="p" if ending == "raised" else None)
            assert _check(next(stream), [0, 1], data, range(0, 2), rank)
            assert _check(next(stream), [2, 3], data, range(0, 2), rank)  # micro-batch 0 released meanwhile
            if ending == "raised":  # out of the loop before the stream's end: the stream is dropped unclosed
                return
            stream.close()
            np.testing.assert_array_equal(reader.fetch(shard)[3]["rollout_routed_experts"], data[3][0])
        for _ in range(3):
            step()
        wait_until(lambda: gc.collect() >= 0 and not _threads_since(before), 10,
                   "the dropped readers' threads to end", interval=0.05)
        # The releases the dropped streams issued ran: micro-batch 0's samples are freed, the others kept.
        assert units[0].stats()["keys"] == (4 if ending == "raised" else 8)


@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_clients_dropped_unclosed_leave_no_thread_and_no_connection_once_garbage(transport):
    """A process that opens UnitClients and a Reader per step and closes neither (some steps raising out of
    their loop): once they are garbage, none of their threads is left, nor the units' threads serving their
    connections. Threads that outlive them (a channel's lease helpers over shm, the process's lease ender and
    fan-out threads) once kept the last job they ran while they awaited the next, and with it the clients."""
    from gputq.client.clients import UnitClients

    rank = ParallelSlice(layers=range(0, 2), num_experts=EXPERTS)
    with local_units(transport, units=2, routed_experts_dtype="uint16") as (config, units, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, np.random.default_rng(27), [40, 30, 50, 20])
            writer.finalize(shard, "p", readers=4)  # each step releases micro-batch 0 once
        membership = {unit.name: unit.address() for unit in units}
        before = set(threading.enumerate())

        def step(ending: str):
            reader = Reader(UnitClients(membership, config), config)
            stream = reader.stream(shard, [[0, 1], [2, 3]], rank, release="p")
            assert _check(next(stream), [0, 1], data, range(0, 2), rank)
            assert _check(next(stream), [2, 3], data, range(0, 2), rank)  # micro-batch 0 released meanwhile
            if ending == "raised":  # out of the loop: the stream is dropped unclosed too
                return
            stream.close()
        for ending in ("closed", "raised", "closed", "raised"):
            step(ending)
        ours = (*READ_THREADS, "gputq-shm-lease", "gputq-lease-ends", "gputq-tcp-conn")  # not the process's own
        wait_until(lambda: gc.collect() >= 0 and not _threads_since(before, ours), 10,
                   "the dropped clients' threads and the units' threads serving them to end", interval=0.05)
        assert sum(unit.stats()["keys"] for unit in units) == 4  # micro-batch 0's samples freed, by every step


def _hold_the_fetch_of_micro_batch_1(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Hold micro-batch 1's fetch on the fetch thread until ``go`` is set: ``(held, go)``, ``held`` set once it
    is held."""
    from gputq.client import stream as stream_module

    run_into, held, go = stream_module.run_into, threading.Event(), threading.Event()

    def holding(future, work, *args):
        if work is not None and args and getattr(args[0], "index", None) == 1 and not held.is_set():
            held.set()
            assert go.wait(10)
        return run_into(future, work, *args)
    monkeypatch.setattr(stream_module, "run_into", holding)
    return held, go


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_reader_closed_from_another_thread_wakes_a_consumer_waiting_for_its_micro_batch(monkeypatch, transport):
    """The consumer is waiting for micro-batch 1, whose fetch is held on the fetch thread, when another thread
    closes the Reader: the held fetch ends, the consumer gets ``ClosedError`` (at once, or at its next request
    if that fetch had started), and nothing is queued on threads being stopped."""
    held, go = _hold_the_fetch_of_micro_batch_1(monkeypatch)
    rank = ParallelSlice(num_experts=EXPERTS)
    with local_units(transport, units=1, routed_experts_dtype="uint16") as (config, units, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, np.random.default_rng(22), [40, 30, 50, 20])
        reader = Reader(clients, config)
        stream = reader.stream(shard, [[i] for i in range(4)], rank)
        assert _check(next(stream), [0], data, range(0, LAYERS), rank)
        outcome = []

        def consume():
            try:
                for mb in stream:
                    outcome.append(mb.index)
            except ClosedError as exc:
                outcome.append(exc)
        consumer = threading.Thread(target=consume)
        consumer.start()
        assert held.wait(10)
        closing = threading.Thread(target=reader.close)
        closing.start()
        closing.join(0.2)
        assert closing.is_alive()  # it waits for the fetch under way
        go.set()
        closing.join(10)
        consumer.join(10)
        assert not closing.is_alive() and not consumer.is_alive()
        assert outcome[:-1] in ([], [1]) and isinstance(outcome[-1], ClosedError), outcome
        wait_until(lambda: units[0].stats()["leases"] == 0, 10, "the leases of the closed stream to end")


def test_a_stream_closed_from_another_thread_is_closed_not_failed(monkeypatch):
    """Closed by another thread while its consumer waits for micro-batch 1's restore (queued behind a held
    fetch, over shm): the consumer gets ``ClosedError`` naming the close, and asking again is the end, as after
    any close of its own; not a failure of micro-batch 1 (its error, ``CancelledError``, is the close's)."""
    held, go = _hold_the_fetch_of_micro_batch_1(monkeypatch)
    rank = ParallelSlice(num_experts=EXPERTS)
    with local_units("shm", units=1, routed_experts_dtype="uint16") as (config, _, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, np.random.default_rng(23), [40, 30, 50, 20])
        with Reader(clients, config) as reader:
            stream = reader.stream(shard, [[i] for i in range(4)], rank, prefetch=2)
            assert _check(next(stream), [0], data, range(0, LAYERS), rank)
            outcome = []

            def consume():
                try:
                    outcome.append(next(stream).index)
                except ClosedError as exc:
                    outcome.append(exc)
            consumer = threading.Thread(target=consume)
            consumer.start()
            assert held.wait(10)
            closing = threading.Thread(target=stream.close)
            closing.start()
            closing.join(0.2)
            go.set()
            closing.join(10)
            consumer.join(10)
            assert not closing.is_alive() and not consumer.is_alive()
            if isinstance(outcome[0], ClosedError):  # else micro-batch 1 was restored before the close
                assert "the stream was closed while micro-batch 1 was awaited" in str(outcome[0])
            with pytest.raises(StopIteration):
                next(stream)


def test_a_step_shared_in_a_micro_batch_is_read_once_and_once_per_micro_batch():
    rng = np.random.default_rng(8)
    with local_units("tcp", units=1) as (config, units, clients):
        with Writer(clients, config) as writer:
            refs = writer.put("s/0", "p", {"routed_experts": rng.integers(0, EXPERTS, (100, LAYERS, TOPK))})
            writer.flush()
        step = Layout.from_ref(refs["routed_experts"])
        shard = [{"routed_experts": step.slice(0, 80)}, {"routed_experts": step.slice(40, 100)}]
        row = refs["routed_experts"].row_nbytes
        with Reader(clients, config) as reader:
            for batches, rows in (([[0, 1]], 100), ([[0], [1]], 80 + 60)):
                before = _bytes_read(units)
                with reader.stream(shard, batches, ParallelSlice(num_experts=EXPERTS)) as stream:
                    for mb in stream:
                        assert len(mb.routed_experts) == LAYERS
                assert _bytes_read(units) - before == rows * row


def test_an_all_zero_layer_is_refused_at_its_micro_batch():
    experts = np.random.default_rng(9).integers(1, EXPERTS, (200, LAYERS, TOPK)).astype(np.int32)
    experts[:100, 1] = 0  # zeros past the first look's rows: the layer is scanned whole, and passes
    experts[:, 2] = 0
    with local_units("tcp", units=1) as (config, _, clients):
        with Writer(clients, config) as writer:
            refs = writer.put("s/0", "p", {"routed_experts": experts})
            writer.flush()
        shard = [{"routed_experts": Layout.from_ref(refs["routed_experts"])}]
        with Reader(clients, config) as reader:
            with reader.stream(shard, [[0]], ParallelSlice(layers=(0, 1), num_experts=EXPERTS)) as stream:
                assert len(next(stream).routed_experts) == 2
            with reader.stream(shard, [[0]], ParallelSlice(layers=(1, 2), num_experts=EXPERTS)) as stream:
                with pytest.raises(LayoutError, match="layer 2 is all zero"):
                    next(stream)


def test_a_lost_unit_raises_at_the_micro_batch_that_needs_it_within_the_timeout():
    import time

    from gputq.errors import UnitLostError

    rng = np.random.default_rng(10)
    with local_units("tcp", units=2, read_timeout_s=5.0, control_timeout_s=5.0) as (config, units, clients):
        with Writer(clients, config) as writer:
            shard, _ = _rollout(writer, rng, [30] * 8)
        home = {i: sample["routed_experts"].fragments[0].ref.unit for i, sample in enumerate(shard)}
        lost = home[7]
        first = [i for i in range(8) if home[i] != lost][:1]
        rest = [i for i in range(8) if i not in first]
        next(service for service in units if service.name == lost).close()
        with Reader(clients, config) as reader:
            started = time.monotonic()
            # Both micro-batches are fetched at once; the second's failure waits for its turn.
            with reader.stream(shard, [first, rest], ParallelSlice(num_experts=EXPERTS), prefetch=2) as stream:
                assert next(stream).samples == tuple(first)
                with pytest.raises(UnitLostError, match=lost):
                    next(stream)
            assert time.monotonic() - started < 15


@pytest.mark.parametrize("dtype, row_shape", [("uint16", (6, 4)), ("uint8", (5, 3)), ("int32", (4, 1))])
def test_a_micro_batch_is_sized_up_front_and_placed_within_that_size(dtype, row_shape):
    """plan_stream checks and sizes; the placement (just before the fetch) fits the staging sized for it."""
    from gputq.client.plan import plan_stream
    from gputq.data.refs import FieldRef

    def ref(unit, key, field, rows, dtype, shape):
        return FieldRef(key=key, field=field, unit=unit, rows=rows, dtype=dtype, row_shape=shape, partition="p")

    rng = np.random.default_rng(3)
    steps = [ref(f"su-{i % 3}", f"k{i}", "routed_experts", int(n), dtype, row_shape)
             for i, n in enumerate(rng.integers(7, 90, 12))]
    shard = []
    for i in range(10):  # segments of one to three steps, neighbours sharing one
        parts = [Layout.from_ref(steps[j]) for j in range(i, i + 1 + i % 3)]
        experts = Layout.concat(parts)
        total = experts.rows + 1
        shard.append({"routed_experts": experts,
                      "logprobs": Layout.from_ref(ref(f"su-{i % 2}", f"lp{i}", "logprobs", total // 2, "float32", ()))})
    batches = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9]]
    for rank in (ParallelSlice(num_experts=16), ParallelSlice(layers=range(1, row_shape[0]), cp_rank=1, cp_size=2, num_experts=16,
                                                tp_size=2, pad_multiple=4)):
        plans = plan_stream(shard, batches, rank)
        assert all(plan.requests is None for plan in plans)  # nothing placed up front
        for plan in plans:
            assert plan.finish() is plan and plan.finish().requests is plan.requests  # once
            assert 0 < plan.nbytes <= plan.max_nbytes
            assert sum(r.stop - r.start for r in plan.requests) == plan.slice_bytes
            assert tuple(sorted({r.unit for r in plan.requests})) == plan.units
            assert all(fp.plan.shape[1] == 3 for fp in plan.fields.values())


def test_a_micro_batch_naming_two_versions_of_one_key_is_refused_at_planning():
    """The planner refuses, before anything is read, a micro-batch whose samples name two generations of one
    key (at most one is current); a reference of unknown version is read as the known one."""
    from gputq.client.plan import plan_stream
    from gputq.data.refs import FieldRef
    from gputq.errors import StaleReadError

    def ref(generation):
        return FieldRef(key="k", field="routed_experts", unit="su-0", rows=6, dtype="uint16", row_shape=(2, 4),
                        partition="p", incarnation="aaaaaaaaaaaaaaaa", generation=generation)

    rank = ParallelSlice(num_experts=16)
    shard = [{"routed_experts": Layout.from_ref(ref(3))}, {"routed_experts": Layout.from_ref(ref(7))}]
    apart = plan_stream(shard, [[0], [1]], rank)  # in two micro-batches: each reads its own (the unit checks)
    assert [p.finish().requests[0].generations for p in apart] == [[3], [7]]
    with pytest.raises(StaleReadError, match=r"micro-batch 0 references two versions of key 'k' on unit su-0"):
        plan_stream(shard, [[0, 1]], rank)
    shard[0] = {"routed_experts": Layout.from_ref(ref(0))}
    plan = plan_stream(shard, [[0, 1]], rank)[0].finish()
    assert [(r.keys, r.generations) for r in plan.requests] == [(["k"], [7])]  # the known version is checked


@pytest.mark.rdma
@pytest.mark.parametrize("consumed", [4, 1])
def test_an_rdma_stream_leases_the_next_micro_batch_while_this_one_is_read(consumed):
    """Every micro-batch after the first reads under leases taken ahead (no round trip before its READs),
    restores the same rows as slime; leases taken for micro-batches never read end with the stream."""
    from gputq.client.plan import plan_stream
    from tests.conftest import nixl_usable
    from tests.waiting import wait_until

    if nixl_usable():
        pytest.skip(nixl_usable())
    rng = np.random.default_rng(5)
    with local_units("rdma", units=2) as (config, units, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, rng, [40, 33, 61, 27, 45, 52, 30, 38])
        batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
        rank = ParallelSlice(num_experts=EXPERTS)
        plans = plan_stream(shard, batches, rank, max_bytes=config.max_frame_bytes)
        requests = [len(plan.finish().requests) for plan in plans]
        with Reader(clients, config) as reader:
            with reader.stream(shard, batches, rank, prefetch=1) as stream:
                for mb in stream:
                    assert _check(mb, batches[mb.index], data, range(LAYERS), rank)
                    if mb.index + 1 == consumed:
                        break
            leased_ahead = sum(clients.channel(unit).leased_ahead for unit in clients.units)
        if consumed == len(batches):
            assert leased_ahead == sum(requests[1:]) > 0
        wait_until(lambda: all(unit.stats()["leases"] == 0 for unit in units), 10, "every lease is ended")
