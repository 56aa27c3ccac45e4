"""The tcp staging ring's CuPy copier on the CuPy stand-in (``tests/host_cuda.py``).

The stand-in queues each copy on the ring's stream and reads the pinned
slot only when the copy runs, so a slot refilled before its copy ran, a
receive that returns before its copies ran, or copies that pass work
already queued on the destination all show up as wrong bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from gputq.transport.staging import StagingPool

pytestmark = pytest.mark.timeout(60)

CHUNK, SLOTS = 1000, 3


def _filler(payload: np.ndarray):
    """``fill(view)`` handing out ``payload`` in order, as a socket would."""
    cursor = 0

    def fill(view: memoryview) -> None:
        nonlocal cursor
        np.frombuffer(view, np.uint8)[:] = payload[cursor:cursor + view.nbytes]
        cursor += view.nbytes

    return fill


def test_a_receive_through_few_slots_lands_every_chunk_before_it_returns(host_cuda):
    payload = np.random.default_rng(1).integers(0, 256, 10 * CHUNK + 123, dtype=np.uint8)
    dest = host_cuda.empty(payload.size + 7, np.uint8)
    pool = StagingPool(chunk_bytes=CHUNK, nchunks=SLOTS)
    for _ in range(2):  # the second receive reuses the ring, its slots and events
        pool.receive(_filler(payload), dest, payload.size)
        # read on this thread's stream, which orders with nothing of the ring's
        got = host_cuda.to_host(dest)
        assert np.array_equal(got[:payload.size], payload) and (got[payload.size:] == 0xA5).all()
    copies = [entry for entry in host_cuda.log if entry[0] == "copy"]
    assert len(copies) == 2 * 11 and len({copy[4] for copy in copies}) == 1  # on the ring's one stream


def test_a_receive_lands_after_work_already_queued_on_its_destination(host_cuda):
    payload = np.random.default_rng(2).integers(0, 256, 2 * CHUNK, dtype=np.uint8)
    dest = host_cuda.empty(payload.size, np.uint8)
    earlier = host_cuda.cuda.alloc_pinned_memory(payload.size)
    np.frombuffer(earlier, np.uint8)[:] = 9
    runtime = host_cuda.cuda.runtime
    # queued on this thread's stream, not run yet: the ring's copies must land after it
    runtime.memcpyAsync(dest.data.ptr, earlier.ptr, payload.size, runtime.memcpyHostToDevice,
                        host_cuda.cuda.get_current_stream().ptr)
    StagingPool(chunk_bytes=CHUNK, nchunks=SLOTS).receive(_filler(payload), dest, payload.size)
    assert np.array_equal(host_cuda.to_host(dest), payload)


def test_a_failed_receive_leaves_no_copy_queued_on_its_slots(host_cuda):
    payload = np.arange(5 * CHUNK, dtype=np.uint8)
    dest = host_cuda.empty(payload.size, np.uint8)
    fill = _filler(payload)
    calls = 0

    def failing(view: memoryview) -> None:
        nonlocal calls
        calls += 1
        if calls == 4:
            raise ConnectionResetError("the unit went away")
        fill(view)

    pool = StagingPool(chunk_bytes=CHUNK, nchunks=SLOTS)
    with pytest.raises(ConnectionResetError):
        pool.receive(failing, dest, payload.size)
    # the three chunks received before the error landed, though nothing here waited for them
    assert np.array_equal(host_cuda.to_host(dest)[:3 * CHUNK], payload[:3 * CHUNK])
