"""Controller lifecycle fan-out over real units (in-process, tcp)."""

from __future__ import annotations

import numpy as np
import pytest

from gputq.client.writer import Writer
from gputq.cluster.controller import Controller
from gputq.errors import ConfigError, InvalidInputError
from tests.conftest import local_units
from tests.waiting import wait_until


def _write_steps(clients, config, partition, n):
    with Writer(clients, config) as writer:
        refs = [writer.put(f"{partition}/s{i}/0", partition, {"logprobs": np.full(8, i, np.float32)})
                for i in range(n)]
        writer.flush()
    return [r["logprobs"] for r in refs]


def test_partial_rollout_transfer_survives_release_of_old_partition():
    with local_units("tcp", units=2) as (config, services, clients):
        controller = Controller(config)
        for service in services:
            controller.register_unit(service.name, service.address())
        controller.open_partition("r0")
        refs = _write_steps(clients, config, "r0", 6)
        carried = refs[:2]  # an unfinished session moves to the next rollout
        by_unit: dict = {}
        for ref in carried:
            by_unit.setdefault(ref.unit, []).append(ref.key)
        controller.transfer(by_unit, "r0", "r1")
        assert controller.partitions() == ["r0", "r1"]
        assert controller.release_partition("r0") == {"freed": 4, "unreachable": {}}
        stats = controller.stats()
        assert stats["totals"]["keys"] == 2 and set(stats["units"]) == {"su-0", "su-1"}
        assert controller.release_partition("r1") == {"freed": 2, "unreachable": {}}
        assert controller.stats()["totals"]["keys"] == 0
        assert controller.partitions() == []
        controller.close()


def test_shared_step_with_two_live_rollouts_is_freed_at_last_reference():
    with local_units("tcp", units=1) as (config, services, clients):
        controller = Controller(config)
        controller.register_unit("su-0", services[0].address())
        (ref,) = _write_steps(clients, config, "r0", 1)
        clients.channel("su-0").call("add_ref", keys=[ref.key], partition="r1")  # async training
        assert controller.release_partition("r0")["freed"] == 0
        assert controller.release_partition("r1")["freed"] == 1
        controller.close()


def test_membership_errors_are_typed():
    with local_units("tcp", units=1) as (config, services, _):
        controller = Controller(config)
        with pytest.raises(InvalidInputError, match="su-9"):
            controller.deregister_unit("su-9")
        controller.register_unit("su-0", services[0].address())
        assert list(controller.membership()) == ["su-0"]
        controller.deregister_unit("su-0")
        assert controller.membership() == {}
    with pytest.raises(ConfigError, match="token"):
        Controller(config.replace(token=None)).stats()


def test_a_closed_unit_is_marked_lost_reported_and_skipped():
    from gputq.errors import PartialFailureError

    with local_units("tcp", units=3, heartbeat_interval_s=0.05, probe_timeout_s=0.5) as (config, services, clients):
        controller = Controller(config)
        for service in services:
            controller.register_unit(service.name, service.address())
        controller.open_partition("r0")
        refs = _write_steps(clients, config, "r0", 24)
        on = {s.name: sum(r.unit == s.name for r in refs) for s in services}
        assert controller.heartbeat() == {}
        services[1].close()
        wait_until(lambda: set(controller.lost_units()) == {"su-1"}, 10, "the heartbeat marks su-1 lost")
        assert controller.live_units() == ["su-0", "su-2"]
        assert set(controller.stats()["unreachable"]) == {"su-1"}
        with pytest.raises(PartialFailureError, match="su-1") as info:
            controller.release_partition("r0")
        assert info.value.result == {"freed": on["su-0"] + on["su-2"], "unreachable": {
            "su-1": info.value.result["unreachable"]["su-1"]}}
        assert "su-1 is lost" in info.value.result["unreachable"]["su-1"]
        assert controller.partitions() == []
        report = controller.check_invariants()
        assert report["violations"] == [] and list(report["unreachable"]) == ["su-1"] and not report["ok"]
        controller.close()


def test_transfer_raises_the_units_own_errors():
    with local_units("tcp", units=1) as (config, services, clients):
        controller = Controller(config, heartbeat=False)
        controller.register_unit("su-0", services[0].address())
        (ref,) = _write_steps(clients, config, "r0", 1)
        with pytest.raises(InvalidInputError, match="holds no reference"):
            controller.transfer({"su-0": [ref.key]}, "elsewhere", "r1")
        assert controller.transfer({"su-0": [ref.key]}, "r0", "r1") == 1
        controller.close()
