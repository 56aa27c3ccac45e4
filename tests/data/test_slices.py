"""A rank's place, checked where it is named: every bad ``ParallelSlice`` argument is an ``InvalidInputError``."""

from __future__ import annotations

import numpy as np
import pytest

from gputq.data.slices import ParallelSlice
from gputq.errors import InvalidInputError

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("kwargs,message", [
    ({"cp_size": 0}, r"cp_size must be an int >= 1, got 0"),
    ({"cp_rank": -1}, r"cp_rank must be an int >= 0, got -1"),
    ({"tp_size": 2.0}, r"tp_size must be an int >= 1, got 2.0"),
    ({"pad_multiple": True}, r"pad_multiple must be an int >= 1, got True"),
    ({"cp_rank": 2, "cp_size": 2}, r"cp_rank 2 of 2, tp_rank 0 of 1: a rank must be below its size"),
    ({"tp_rank": 1}, r"tp_rank 1 of 1: a rank must be below its size"),
    ({"sequence_parallel": 1}, r"sequence_parallel must be a bool, got 1"),
    ({"allgather_cp": "yes"}, r"allgather_cp must be a bool, got 'yes'"),
    ({"num_experts": 0}, r"num_experts must be an int >= 1, got 0"),
    ({"layers": 5}, r"layers must be ascending non-negative layer indices, got 5"),
    ({"layers": range(0)}, r"got range\(0, 0\)"),
    ({"layers": (2, 1)}, r"got \(2, 1\)"),
    ({"layers": (1, 1)}, r"got \(1, 1\)"),
    ({"layers": (-1, 0)}, r"got \(-1, 0\)"),
    ({"layers": [1.0]}, r"got \[1.0\]"),
    ({"layers": (True,)}, r"got \(True,\)"),
])
def test_a_bad_argument_is_an_invalid_input_error_naming_it(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        ParallelSlice(**kwargs)


def test_good_arguments_are_normalised_to_plain_ints():
    rank = ParallelSlice(layers=np.arange(1, 4), cp_rank=np.int64(1), cp_size=2, num_experts=np.int32(16))
    assert rank.layers == (1, 2, 3) and all(type(v) is int for v in rank.layers)
    assert (type(rank.cp_rank), type(rank.num_experts)) == (int, int)
    assert ParallelSlice(layers=range(2, 6, 2)).layer_indices(5, "r") == (2, 4)
    assert ParallelSlice().layer_indices(3, "r") == (0, 1, 2)
    with pytest.raises(InvalidInputError, match=r"^r: layer 4 is past the 4 stored layers \(0..3\)$"):
        ParallelSlice(layers=(2, 4)).layer_indices(4, "r")
    with pytest.raises(InvalidInputError, match=r"^r: layers 3..7 are past the 3 stored layers \(0..2\)$"):
        ParallelSlice(layers=range(1, 8, 2)).layer_indices(3, "r")
