import collections

import pytest

from gputq.errors import InvalidInputError
from gputq.placement import rendezvous_order, rendezvous_unit


def test_deterministic_and_balanced():
    units = [f"su-{i}" for i in range(4)]
    keys = [f"rollout-0/session-{i}/0" for i in range(4000)]
    first = [rendezvous_unit(k, units) for k in keys]
    assert first == [rendezvous_unit(k, list(reversed(units))) for k in keys]
    counts = collections.Counter(first)
    assert set(counts) == set(units)
    assert min(counts.values()) > 800  # ~1000 each


def test_removing_a_unit_moves_only_its_keys():
    units = [f"su-{i}" for i in range(4)]
    keys = [f"k{i}" for i in range(2000)]
    before = {k: rendezvous_unit(k, units) for k in keys}
    after = {k: rendezvous_unit(k, units[:-1]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "su-3" for k in moved)


def test_order_starts_with_owner():
    units = ["a", "b", "c"]
    assert rendezvous_order("x", units)[0] == rendezvous_unit("x", units)
    assert sorted(rendezvous_order("x", units)) == units


def test_no_units_is_typed_error():
    with pytest.raises(InvalidInputError):
        rendezvous_unit("k", [])
