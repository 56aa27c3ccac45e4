import collections

import pytest

from gputq.client.placement import rendezvous_order, rendezvous_unit
from gputq.errors import InvalidInputError


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


def test_new_keys_go_to_live_units_only():
    from gputq.client.clients import UnitClients
    from gputq.config import GputqConfig

    clients = UnitClients({f"su-{i}": {"transport": "tcp", "host": "127.0.0.1", "port": 1} for i in range(3)},
                          GputqConfig(token="t" * 32), reprobe=False)
    keys = [f"k{i}" for i in range(600)]
    before = {k: rendezvous_unit(k, clients.live_units) for k in keys}
    clients.mark_lost("su-1", "test")
    assert clients.units == ["su-0", "su-1", "su-2"] and clients.live_units == ["su-0", "su-2"]
    after = {k: rendezvous_unit(k, clients.live_units) for k in keys}
    assert "su-1" not in after.values()
    assert all(after[k] == before[k] for k in keys if before[k] != "su-1")  # only the lost unit's keys move
    clients.close()
