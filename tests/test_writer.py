"""Writer edge cases: ownership of the caller's buffers, failures, timeouts, empty fields."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gputq.errors import GputqTimeoutError, TransferError
from gputq.reader import Reader
from gputq.refs import Layout
from gputq.writer import Writer

from .conftest import local_units


def test_caller_may_reuse_its_buffer_right_after_put():
    with local_units("tcp", units=1) as (config, _, clients):
        with Writer(clients, config) as writer:
            buf = np.linspace(-5, 0, 1 << 18, dtype=np.float32)  # already the stored dtype: no copy needed
            expected = buf.copy()
            refs = writer.put("k/0", "p", {"logprobs": buf})
            buf[:] = -1.0  # an engine reusing its output buffer
            writer.flush()
        with Reader(clients, config) as reader:
            (got,) = reader.fetch([{"logprobs": Layout.from_ref(refs["logprobs"])}])
        assert np.array_equal(got["rollout_log_probs"], expected)


def test_zero_row_fields_round_trip():
    with local_units("tcp", units=1) as (config, _, clients):
        with Writer(clients, config) as writer:
            refs = writer.put("k/0", "p", {"routed_experts": np.zeros((0, 4, 2), np.int32),
                                           "logprobs": np.zeros(0, np.float32)})
            writer.flush()
        with Reader(clients, config) as reader:
            (got,) = reader.fetch([{f: Layout.from_ref(r) for f, r in refs.items()}])
        assert got["rollout_routed_experts"].shape == (0, 4, 2)
        assert got["rollout_log_probs"].shape == (0,)


def test_close_reports_failures_that_flush_never_saw():
    with local_units("tcp", units=1, capacity=1 << 20, put_timeout_s=0.2) as (config, _, clients):
        writer = Writer(clients, config)
        writer.put("too-big", "p", {"logprobs": np.zeros((2 << 20) // 4, np.float32)})
        with pytest.raises(TransferError, match="too-big"):
            writer.close()
        writer.close()  # idempotent, reported once


def test_exit_keeps_the_callers_exception_and_notes_failed_writes():
    with local_units("tcp", units=1, capacity=1 << 20, put_timeout_s=0.2) as (config, _, clients):
        with pytest.raises(KeyError) as info:
            with Writer(clients, config) as writer:
                writer.put("too-big", "p", {"logprobs": np.zeros((2 << 20) // 4, np.float32)})
                raise KeyError("local failure")
        assert any("writes also failed" in note for note in info.value.__notes__)


def test_wait_and_flush_time_out_typed():
    with local_units("tcp", units=1) as (config, _, clients):
        with Writer(clients, config) as writer:
            gate = threading.Event()
            original = writer._send

            def slow_send(*args):
                gate.wait(5)
                original(*args)

            writer._send = slow_send
            writer.put("slow", "p", {"logprobs": np.ones(4, np.float32)})
            with pytest.raises(GputqTimeoutError, match="slow"):
                writer.wait(["slow/logprobs"], timeout=0.1)
            with pytest.raises(TimeoutError):
                writer.flush(timeout=0.1)
            gate.set()
            writer.flush(timeout=5)
