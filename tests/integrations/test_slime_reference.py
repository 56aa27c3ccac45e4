"""slime's own preparation code, where a checkout is at hand: each rank's stream is exactly what it computes.

    GPUTQ_SLIME_SRC=/path/to/slime python -m pytest tests/integrations/test_slime_reference.py

loads ``slime/backends/megatron_utils/cp_utils.py`` from that checkout and
feeds its ``prepare_routed_experts_for_routing_replay`` (what slime's
``fill_routing_replay`` hands Megatron's router replay) and its
``slice_log_prob_with_cp`` the same samples the units hold, for every rank
of zigzag and allgather CP, TP with and without sequence parallelism, and
pad multipliers. Megatron's parallel state is the one thing stood in for:
the rank's position, as ``mpu`` reports it. Without a checkout these tests
skip (a clean clone has none and no network to get one); the numpy
statements of the same rules in ``tests/client/test_stream.py`` and
``tests/client/test_allgather_cp.py`` always run.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.data.slices import ParallelSlice
from tests.client.test_stream import EXPERTS
from tests.client.test_stream import _rollout as rollout
from tests.conftest import TRANSPORT_PARAMS, local_units

SLIME_SRC = os.environ.get("GPUTQ_SLIME_SRC", "")
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not SLIME_SRC, reason="GPUTQ_SLIME_SRC names no slime checkout")]

#: Uneven lengths: zigzag chunks get pads, allgather chunks cross sample boundaries.
LENGTHS = [37, 50, 9, 64, 23, 41, 2]
BATCHES = [[0, 1, 2], [3], [4, 5, 6]]
LAYERS, TOPK = 5, 3
#: The stage's layers: not the first, not contiguous.
STAGE = (1, 2, 4)
#: allgather CP or zigzag, CP size, TP size, sequence parallelism, data_pad_size_multiplier.
GRID = list(itertools.product((False, True), (1, 2, 4), (1, 2), (False, True), (1, 4)))


@pytest.fixture(scope="module")
def cp_utils():
    """slime's ``cp_utils`` module, loaded from the checkout (its ``mpu`` replaced per rank by :func:`_at`)."""
    path = Path(SLIME_SRC) / "slime" / "backends" / "megatron_utils" / "cp_utils.py"
    if not path.is_file():
        pytest.fail(f"GPUTQ_SLIME_SRC={SLIME_SRC!r} holds no {path.relative_to(SLIME_SRC)}")
    pytest.importorskip("torch", reason="slime's code runs on torch: make test installs it")
    with warnings.catch_warnings():  # megatron-core without Transformer Engine warns; CPU fallbacks suffice
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core", reason="slime's cp_utils imports megatron-core (the dev extra)")
        spec = importlib.util.spec_from_file_location("slime_cp_utils", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def _at(rank: ParallelSlice) -> types.SimpleNamespace:
    """Megatron's parallel state as slime's code asks it, for ``rank``."""
    return types.SimpleNamespace(get_context_parallel_rank=lambda: rank.cp_rank,
                                 get_context_parallel_world_size=lambda: rank.cp_size,
                                 get_tensor_model_parallel_rank=lambda: rank.tp_rank,
                                 get_tensor_model_parallel_world_size=lambda: rank.tp_size)


def _ranks(allgather: bool, cp: int, tp: int, sp: bool, pad: int):
    """Every rank of one layout that gets its own rows: without sequence parallelism TP ranks share them."""
    for cp_rank, tp_rank in itertools.product(range(cp), range(tp if sp else 1)):
        yield ParallelSlice(layers=STAGE, cp_rank=cp_rank, cp_size=cp, tp_rank=tp_rank, tp_size=tp,
                            sequence_parallel=sp, pad_multiple=pad, num_experts=EXPERTS, allgather_cp=allgather)


def _slimes(cp_utils, data: list, batch: list, rank: ParallelSlice, monkeypatch) -> tuple:
    """What slime's code computes for ``rank`` on micro-batch ``batch``: its R3 rows ``[tokens, L, K]`` and the
    samples' CP-cut ``rollout_log_probs``."""
    import torch

    monkeypatch.setattr(cp_utils, "mpu", _at(rank))
    experts = cp_utils.prepare_routed_experts_for_routing_replay(
        [torch.from_numpy(data[i][0]) for i in batch], [torch.zeros(data[i][2], dtype=torch.long) for i in batch],
        num_experts=EXPERTS, data_pad_size_multiplier=rank.pad_multiple, sequence_parallel=rank.sequence_parallel,
        allgather_cp=rank.allgather_cp)
    log_probs = [cp_utils.slice_log_prob_with_cp(torch.from_numpy(data[i][1]), data[i][2], len(data[i][1]))
                 for i in batch]
    return experts.numpy(), [lp.numpy() for lp in log_probs]


@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_every_rank_streams_what_slimes_own_code_prepares(cp_utils, transport, monkeypatch):
    with local_units(transport, units=2, routed_experts_dtype="uint8", num_experts=EXPERTS) as (config, _, clients):
        with Writer(clients, config) as writer:
            shard, data = rollout(writer, np.random.default_rng(5), LENGTHS, layers=LAYERS, topk=TOPK)
        with Reader(clients, config) as reader:
            checked = 0
            for layout in GRID:
                for rank in _ranks(*layout):
                    with reader.stream(shard, BATCHES, rank) as stream:
                        for mb in stream:
                            experts, log_probs = _slimes(cp_utils, data, BATCHES[mb.index], rank, monkeypatch)
                            assert mb.layers == STAGE
                            for j, layer in enumerate(STAGE):
                                np.testing.assert_array_equal(mb.routed_experts[j], experts[:, layer],
                                                              err_msg=f"{rank}, micro-batch {mb.index}")
                            assert len(mb.log_probs) == len(log_probs)
                            for got, want in zip(mb.log_probs, log_probs):
                                np.testing.assert_array_equal(got, want, err_msg=f"{rank}, micro-batch {mb.index}")
                            checked += 1
            assert checked == len(BATCHES) * sum(len(list(_ranks(*layout))) for layout in GRID)
