"""A stream's background releases (gputq.client.stream_releases): what goes in one call, and who missed what.

The release callable stands in for ``Reader._release_micro_batches`` (the
stream tests run the real one over tcp, shm and rdma): here it records each
call and answers as told.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from gputq.client.stream_releases import StreamReleases
from gputq.data.refs import FieldRef, Layout

pytestmark = pytest.mark.timeout(30)


def _sample(unit: str, key: str) -> dict:
    ref = FieldRef(key=key, field="routed_experts", unit=unit, rows=4, dtype="uint8", row_shape=(2, 2),
                   partition="p")
    return {"routed_experts": Layout.from_ref(ref)}


#: Micro-batch i: one sample on su-(i % 2).
LAYOUTS = [[_sample(f"su-{i % 2}", f"s{i}")] for i in range(5)]


def _units(layouts: list) -> list:
    return [ref.unit for sample in layouts for layout in sample.values() for ref in layout.refs()]


def test_micro_batches_handed_over_while_a_release_runs_go_together_in_the_next_one():
    calls, first_started, go = [], threading.Event(), threading.Event()

    def release(layouts, indices):
        calls.append((list(indices), _units(layouts)))
        if len(calls) == 1:
            first_started.set()
            assert go.wait(10)
        return {}

    with ThreadPoolExecutor(1) as thread:
        releases = StreamReleases(release, LAYOUTS, thread)
        releases.hand_over(0)
        assert first_started.wait(10)
        for index in (1, 2, 3):  # the release thread is busy with micro-batch 0
            releases.hand_over(index)
        go.set()
        releases.wait()
        assert calls == [([0], ["su-0"]), ([1, 2, 3], ["su-1", "su-0", "su-1"])]
        releases.hand_over(4)  # the thread idle again: a call of its own
        releases.wait()
    assert calls[-1] == ([4], ["su-0"]) and releases.unreleased == {}


def test_a_unit_a_merged_release_missed_is_named_only_for_the_micro_batches_with_samples_on_it():
    def release(layouts, indices):
        return {"su-1": "unit su-1 is lost"}

    with ThreadPoolExecutor(1) as thread:
        releases = StreamReleases(release, LAYOUTS, thread)
        gate = threading.Event()
        thread.submit(gate.wait, 10)  # hold the thread: the four go in one release
        for index in range(4):
            releases.hand_over(index)
        gate.set()
        releases.wait()
    assert releases.unreleased == {1: {"su-1": "unit su-1 is lost"}, 3: {"su-1": "unit su-1 is lost"}}


def test_a_release_now_runs_on_the_callers_thread():
    threads = []

    def release(layouts, indices):
        threads.append(threading.current_thread())
        return {"su-0": "closed"}

    with ThreadPoolExecutor(1) as thread:
        releases = StreamReleases(release, LAYOUTS, thread)
        releases.now(2)
    assert threads == [threading.current_thread()] and releases.unreleased == {2: {"su-0": "closed"}}
