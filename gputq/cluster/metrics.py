"""Prometheus metrics of units and the controller.

Each StorageUnit process and the controller serve ``/metrics`` with
``prometheus_client`` when ``metrics_port`` is set (0, the default, serves
nothing). The controller takes ``metrics_port``; every unit takes the first
free port above it, so one unit per node is at ``metrics_port + 1`` and the
endpoints of a node never collide. Values are read from the unit's own
counters at scrape time, so nothing is counted twice:

=================================  =======  ==================================
metric                             type     meaning
=================================  =======  ==================================
gputq_unit_bytes_held              gauge    arena bytes allocated to keys
gputq_unit_capacity_bytes          gauge    arena size
gputq_unit_keys                    gauge    committed keys
gputq_unit_leases                  gauge    reads in progress (held leases)
gputq_unit_writers_waiting         gauge    writes waiting for space now
gputq_unit_writes_total            counter  committed writes (rate = writes/s)
gputq_unit_reads_total             counter  reads served (rate = reads/s)
gputq_unit_bytes_written_total     counter  bytes moved in
gputq_unit_bytes_read_total        counter  bytes moved out
gputq_unit_backpressure_waits_total counter writes that had to wait for space
gputq_unit_lease_expiries_total    counter  leases ended by their deadline
gputq_unit_errors_total            counter  writes refused for lack of space
gputq_controller_units             gauge    units in the membership
gputq_controller_partitions        gauge    live rollouts (partitions)
process_resident_memory_bytes      gauge    RSS of the process (and the other
                                            standard ``process_*`` metrics)
=================================  =======  ==================================

``prometheus_client`` is imported only when an endpoint starts
(``pip install 'gputq[metrics]'``). The ``gputq stats`` table that reads the
same counters over Ray is :mod:`gputq.tools.stats`.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

from gputq.errors import MissingDependencyError

__all__ = ["UNIT_METRICS", "MetricsServer", "unit_metrics", "controller_metrics", "serve_metrics",
           "rss_bytes", "require_prometheus"]

#: (metric name, kind, unit stats key, help); every unit stats key here is a counter or gauge.
UNIT_METRICS = (
    ("gputq_unit_bytes_held", "gauge", "used", "arena bytes allocated to keys"),
    ("gputq_unit_capacity_bytes", "gauge", "capacity", "arena size in bytes"),
    ("gputq_unit_keys", "gauge", "keys", "committed keys"),
    ("gputq_unit_leases", "gauge", "leases", "leases held (reads in progress)"),
    ("gputq_unit_writers_waiting", "gauge", "writers_waiting", "writes waiting for arena space"),
    ("gputq_unit_writes", "counter", "puts", "committed writes"),
    ("gputq_unit_reads", "counter", "reads", "reads served"),
    ("gputq_unit_bytes_written", "counter", "bytes_written", "bytes written into the arena"),
    ("gputq_unit_bytes_read", "counter", "bytes_read", "bytes read out of the arena"),
    ("gputq_unit_backpressure_waits", "counter", "waits", "writes that waited for arena space"),
    ("gputq_unit_lease_expiries", "counter", "leases_expired", "leases ended by their deadline"),
    ("gputq_unit_errors", "counter", "capacity_errors", "writes refused for lack of space"),
)
_PORT_SPAN = 64  # ports tried above metrics_port before giving up


def rss_bytes() -> int:
    """Resident set size of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def require_prometheus():
    """Raise ``MissingDependencyError`` naming the extra unless prometheus_client imports."""
    _prometheus()


def _prometheus():
    try:
        import prometheus_client
        from prometheus_client import core
    except ImportError:
        raise MissingDependencyError("metrics_port is set but prometheus_client is missing: "
                                     "pip install 'gputq[metrics]'") from None
    return prometheus_client, core


def unit_metrics(stats: Callable[[], dict]):
    """A collector reading ``stats()`` (a unit's stats dict) at every scrape."""
    _, core = _prometheus()

    class UnitCollector:
        def collect(self) -> Iterable:
            values = stats()
            labels = {"unit": str(values.get("name", ""))}
            for name, kind, key, doc in UNIT_METRICS:
                family = (core.GaugeMetricFamily if kind == "gauge" else core.CounterMetricFamily)(
                    name, doc, labels=list(labels))
                family.add_metric(list(labels.values()), float(values.get(key, 0)))
                yield family

    return UnitCollector()


def controller_metrics(controller):
    """A collector of the controller's membership and live partitions (no fan-out to units)."""
    _, core = _prometheus()

    class ControllerCollector:
        def collect(self) -> Iterable:
            units = core.GaugeMetricFamily("gputq_controller_units", "units in the membership")
            units.add_metric([], len(controller.membership()))
            parts = core.GaugeMetricFamily("gputq_controller_partitions", "live rollouts (partitions)")
            parts.add_metric([], len(controller.partitions()))
            yield units
            yield parts

    return ControllerCollector()


class MetricsServer:
    """A ``/metrics`` endpoint of one process; :meth:`close` stops it."""

    def __init__(self, server, thread, registry):
        self._server, self._thread, self.registry = server, thread, registry
        self.host, self.port = server.server_address[:2]

    def scrape(self) -> str:
        """The exposition text, as a scrape would get it (for tools and tests)."""
        prometheus_client, _ = _prometheus()
        return prometheus_client.generate_latest(self.registry).decode()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(collector, port: int, host: str) -> MetricsServer:
    """Serve ``collector`` plus the standard process metrics on the first free port from ``port``.

    ``port`` 0 takes any free port (tests); otherwise ports ``port`` to
    ``port + 63`` are tried in turn.
    """
    prometheus_client, core = _prometheus()
    registry = core.CollectorRegistry()
    registry.register(collector)
    prometheus_client.ProcessCollector(registry=registry)
    candidates = [0] if port == 0 else range(port, min(port + _PORT_SPAN, 65536))
    error: OSError | None = None
    for candidate in candidates:
        try:
            server, thread = prometheus_client.start_http_server(candidate, addr=host, registry=registry)
        except OSError as exc:
            error = exc
            continue
        return MetricsServer(server, thread, registry)
    raise OSError(f"no free metrics port in [{port}, {port + _PORT_SPAN}) on {host}: {error}")
