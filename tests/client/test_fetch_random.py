"""Random composed layouts through ``Reader.fetch`` over real units, against the same composition in numpy.

A sample's field is a :class:`Layout` built the ways segments are: concatenations of slices of stored
steps, runs of fill rows, a slice shifted into a larger target, and half of them sent through
``to_dict``/``from_dict`` (as they cross Ray). The same recipe applied to the arrays that were put gives
the expected tensor; the restored one must equal it, in int32 and float32, over every transport and
stored format.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.data.refs import Layout
from tests.conftest import TRANSPORT_PARAMS, local_units

pytestmark = pytest.mark.timeout(300)

EXPERTS = 16
FORMATS = ["uint8", "uint16", "int32", "packed"]
_RDMA = TRANSPORT_PARAMS[-1]
#: The device restore's reads: shm's read in place, and copied to the device in spans first.
_DEVICE_READS = [pytest.param("tcp", math.inf, id="tcp"), pytest.param("shm", math.inf, id="shm-in-place"),
                 pytest.param("shm", 0, id="shm-copied"),
                 pytest.param(*_RDMA.values, math.inf, id="rdma", marks=_RDMA.marks)]


def _piece(rng, layout: Layout, array: np.ndarray) -> tuple[Layout, np.ndarray]:
    """A random slice of one stored step, shifted into a larger target (the rest its fill) one time in three."""
    start = int(rng.integers(0, layout.rows + 1))
    stop = int(rng.integers(start, layout.rows + 1))
    piece, rows = layout.slice(start, stop), array[start:stop]
    if stop > start and rng.integers(0, 3) == 0:
        offset = int(rng.integers(0, 4))
        total = offset + len(rows) + int(rng.integers(0, 4))
        target = np.full((total, *array.shape[1:]), layout.fill, array.dtype)
        target[offset:offset + len(rows)] = rows
        return piece.shift(offset, total), target
    return piece, rows


def _compose(rng, stored: list[tuple[Layout, np.ndarray]]) -> tuple[Layout, np.ndarray]:
    """A layout of 1-4 pieces of ``stored`` (fill runs among them; all share one fill) and the array it must
    restore to."""
    pieces = []
    for _ in range(int(rng.integers(1, 5))):
        layout, array = stored[int(rng.integers(0, len(stored)))]
        if rng.integers(0, 5) == 0:
            rows = int(rng.integers(0, 6))
            pieces.append((Layout.empty(layout.field, rows, fill=layout.fill, dtype=layout.dtype,
                                        row_shape=layout.row_shape),
                           np.full((rows, *array.shape[1:]), layout.fill, array.dtype)))
        else:
            pieces.append(_piece(rng, layout, array))
    layout = Layout.concat(p for p, _ in pieces)
    if rng.integers(0, 2):
        layout = Layout.from_dict(layout.to_dict())
    return layout, np.concatenate([a for _, a in pieces])


def _on_host(restored) -> np.ndarray:
    """A restored array as numpy: a device reader's tensors copied to the host."""
    return restored.cpu().numpy() if hasattr(restored, "cpu") else restored


def _fetch_and_check(transport: str, stored_as: str, seed: int, shards: int, device: str = "cpu",
                     **overrides) -> int:
    rng = np.random.default_rng([seed, FORMATS.index(stored_as)])
    layers, topk = int(rng.integers(1, 5)), int(rng.integers(1, 9))
    with local_units(transport, units=int(rng.integers(1, 4)), routed_experts_dtype=stored_as, num_experts=EXPERTS,
                     capacity=16 << 20, **overrides) as (config, _, clients):
        experts, log_probs = [], []
        with Writer(clients, config) as writer:
            for i in range(int(rng.integers(1, 8))):
                rows = int(rng.integers(0, 40))
                fields = {"routed_experts": rng.integers(0, EXPERTS, (rows, layers, topk)).astype(np.int32),
                          "logprobs": rng.standard_normal(rows).astype(np.float32)}
                refs = writer.put(f"c{seed}-{i}/0", "p", fields)
                experts.append((Layout.from_ref(refs["routed_experts"]), fields["routed_experts"]))
                log_probs.append((Layout.from_ref(refs["logprobs"]), fields["logprobs"]))
        checked = 0
        with Reader(clients, config, device=device) as reader:
            for _ in range(shards):
                samples = [(_compose(rng, experts), _compose(rng, log_probs)) for _ in range(int(rng.integers(1, 6)))]
                restored = reader.fetch([{"routed_experts": e[0], "logprobs": lp[0]} for e, lp in samples])
                for got, (e, lp) in zip(restored, samples):
                    experts_got = _on_host(got["rollout_routed_experts"])
                    assert experts_got.dtype == np.int32
                    np.testing.assert_array_equal(experts_got, e[1], err_msg=e[0].describe())
                    np.testing.assert_array_equal(_on_host(got["rollout_log_probs"]), lp[1], err_msg=lp[0].describe())
                    checked += 1
        return checked


@pytest.mark.parametrize("stored_as", FORMATS)
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_random_composed_layouts_restore_exactly(transport, stored_as):
    assert sum(_fetch_and_check(transport, stored_as, seed, 4) for seed in range(2)) >= 8


@pytest.mark.slow
@pytest.mark.parametrize("stored_as", FORMATS)
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_random_composed_layouts_many(transport, stored_as):
    assert sum(_fetch_and_check(transport, stored_as, seed, 6) for seed in range(2, 32)) >= 180


@pytest.mark.parametrize("stored_as", FORMATS)
@pytest.mark.parametrize("transport, zero_copy_max_bytes", _DEVICE_READS)
def test_random_composed_layouts_restore_exactly_into_device_memory_under_the_cuda_stand_in(
        shm_leases_checked, transport, zero_copy_max_bytes, stored_as):
    """device="cuda": over shm the restore reads the mappings in place, or copies them to the device in spans
    first (``zero_copy_max_bytes=0``), each read under its lease."""
    pytest.importorskip("torch", reason="a device Reader returns torch tensors: make test installs torch")
    assert sum(_fetch_and_check(transport, stored_as, seed, 4, "cuda", zero_copy_max_bytes=zero_copy_max_bytes)
               for seed in range(2)) >= 8
    assert any(entry[0] == "launch" for entry in shm_leases_checked.log)
