"""Random composed layouts through ``Reader.fetch`` over real units, against the same composition in numpy.

A sample's field is a :class:`Layout` built the ways segments are: concatenations of slices of stored
steps, runs of fill rows, a slice shifted into a larger target, and half of them sent through
``to_dict``/``from_dict`` (as they cross Ray). The same recipe applied to the arrays that were put gives
the expected tensor; the restored one must equal it, in int32 and float32, over every transport and
stored format.
"""

from __future__ import annotations

import numpy as np
import pytest

from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.data.refs import Layout
from tests.conftest import TRANSPORT_PARAMS, local_units

pytestmark = pytest.mark.timeout(300)

EXPERTS = 16
FORMATS = ["uint8", "uint16", "int32", "packed"]


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


def _fetch_and_check(transport: str, stored_as: str, seed: int, shards: int) -> int:
    rng = np.random.default_rng([seed, FORMATS.index(stored_as)])
    layers, topk = int(rng.integers(1, 5)), int(rng.integers(1, 9))
    with local_units(transport, units=int(rng.integers(1, 4)), routed_experts_dtype=stored_as, num_experts=EXPERTS,
                     capacity=16 << 20) as (config, _, clients):
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
        with Reader(clients, config) as reader:
            for _ in range(shards):
                samples = [(_compose(rng, experts), _compose(rng, log_probs)) for _ in range(int(rng.integers(1, 6)))]
                restored = reader.fetch([{"routed_experts": e[0], "logprobs": lp[0]} for e, lp in samples])
                for got, (e, lp) in zip(restored, samples):
                    assert got["rollout_routed_experts"].dtype == np.int32
                    np.testing.assert_array_equal(got["rollout_routed_experts"], e[1], err_msg=e[0].describe())
                    np.testing.assert_array_equal(got["rollout_log_probs"], lp[1], err_msg=lp[0].describe())
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
