"""Prometheus metrics of a unit and the controller, and the stats table."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest

pytest.importorskip("prometheus_client", reason="pip install 'gputq[metrics]'")

from gputq.client.reader import Reader  # noqa: E402
from gputq.client.writer import Writer  # noqa: E402
from gputq.cluster.controller import Controller  # noqa: E402
from gputq.cluster.metrics import UNIT_METRICS, controller_metrics, rss_bytes, serve_metrics, unit_metrics  # noqa: E402
from gputq.config import GputqConfig  # noqa: E402
from gputq.data.refs import Layout  # noqa: E402
from gputq.tools.stats import format_table
from tests.conftest import local_units  # noqa: E402


def _values(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def test_unit_metrics_follow_the_units_counters_over_http():
    with local_units("tcp", units=1) as (config, services, clients):
        unit = services[0].unit
        server = serve_metrics(unit_metrics(unit.stats), 0, "127.0.0.1")
        try:
            rng = np.random.default_rng(0)
            logprobs = -rng.random(1000).astype(np.float32)
            with Writer(clients, config) as writer:
                refs = writer.put("r/s/0", "r", {"logprobs": logprobs})
                writer.flush()
            with Reader(clients, config) as reader:
                reader.fetch([{"logprobs": Layout.from_ref(refs["logprobs"])}])
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as resp:
                values = _values(resp.read().decode())
        finally:
            server.close()
    assert values["gputq_unit_keys"] == 1 and values["gputq_unit_bytes_held"] >= 4000
    assert values["gputq_unit_writes_total"] == 1 and values["gputq_unit_reads_total"] == 1
    assert values["gputq_unit_bytes_written_total"] == 4000 and values["gputq_unit_bytes_read_total"] == 4000
    assert values["gputq_unit_backpressure_waits_total"] == 0 and values["gputq_unit_errors_total"] == 0
    assert values["process_resident_memory_bytes"] > 1 << 20
    names = {name + ("_total" if kind == "counter" else "") for name, kind, _, _ in UNIT_METRICS}
    assert names <= set(values)


def test_controller_metrics_count_units_and_partitions():
    controller = Controller(GputqConfig(token="t" * 32))
    controller.register_unit("su-0", {"transport": "tcp", "host": "127.0.0.1", "port": 1})
    controller.open_partition("rollout-0")
    server = serve_metrics(controller_metrics(controller), 0, "127.0.0.1")
    try:
        values = _values(server.scrape())
    finally:
        server.close()
    assert values["gputq_controller_units"] == 1 and values["gputq_controller_partitions"] == 1


def test_busy_port_moves_to_the_next_one():
    first = serve_metrics(unit_metrics(lambda: {"name": "a"}), 0, "127.0.0.1")
    try:
        second = serve_metrics(unit_metrics(lambda: {"name": "b"}), first.port, "127.0.0.1")
        try:
            assert second.port != first.port and first.port < second.port < first.port + 64
        finally:
            second.close()
    finally:
        first.close()


def test_stats_table_rates_and_rows():
    before = {"su-0": {"name": "su-0", "used": 1 << 20, "capacity": 64 << 20, "keys": 3, "puts": 10,
                       "reads": 4, "bytes_written": 0, "bytes_read": 0, "rss_bytes": 100 << 20}}
    after = {"su-0": {**before["su-0"], "puts": 30, "bytes_written": 4_000_000},
             "su-1": {"error": "PeerLostError: gone"}}
    table = format_table(after, before, 2.0).splitlines()
    assert table[0].split()[:3] == ["unit", "held", "MiB"]
    row = table[1].split()
    assert row[0] == "su-0" and row[1] == "1.0" and row[5] == "10.0" and row[7] == "2.0"
    assert table[2].startswith("su-1") and "unreachable: PeerLostError: gone" in table[2]
    assert rss_bytes() > 1 << 20


def _free_port_pair() -> int:
    """A port p with p + 1 free too, found by binding port 0 (the metrics port is p)."""
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    pytest.skip("no two adjacent free ports")


def test_unit_service_and_controller_serve_metrics_when_a_port_is_set():
    from gputq.cluster.deploy import ControllerService, UnitService

    port = _free_port_pair()
    config = GputqConfig(transport="tcp", host="127.0.0.1", unit_capacity_bytes=4 << 20, metrics_port=port,
                         token="t" * 32)
    controller = ControllerService(config)
    service = UnitService("su-0", config)
    try:
        assert controller.metrics_address() == f"127.0.0.1:{port}"
        stats = service.stats()
        assert stats["metrics"] == f"127.0.0.1:{port + 1}" and stats["rss_bytes"] > 1 << 20
        with urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/metrics", timeout=10) as resp:
            values = _values(resp.read().decode())
        assert values["gputq_unit_capacity_bytes"] == 4 << 20 and values["gputq_unit_keys"] == 0
    finally:
        service.close()
        controller.close()
    assert GputqConfig(token="t" * 32).metrics_port == 0  # default: no endpoint
    quiet = UnitService("su-1", GputqConfig(transport="tcp", host="127.0.0.1", unit_capacity_bytes=4 << 20,
                                            token="t" * 32))
    try:
        assert quiet.stats()["metrics"] is None
    finally:
        quiet.close()
