"""Ray deployment: a controller and StorageUnits, embedded or one per node.

The classes here are plain Python (``UnitService`` owns a StorageUnit and
its transport server); Ray actors are thin wrappers made on demand, so the
unit tests run everything in-process. Serving actors take ``num_cpus=0``:
they only serve sockets and must not starve trainers of CPU slots.

On a multi-node cluster each node gets one unit pinned to it (hard node
affinity); :meth:`Deployment.sync_nodes` (or the watcher started with
``watch_nodes_s``) gives a node that joins later its unit and drops the
units of nodes that left. The controller is the named actor
``gputq-controller`` in the ``gputq`` namespace, and each unit
``gputq-controller/<unit>``, so ``gputq stats`` can attach to a running job.

Ray carries control only: addresses, stats, lifecycle calls; payload bytes
go over the transports.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Iterator

from gputq.client.clients import UnitClients
from gputq.client.reachability import unreachable_samples
from gputq.cluster.controller import Controller
from gputq.cluster.metrics import controller_metrics, require_prometheus, rss_bytes, serve_metrics, unit_metrics
from gputq.cluster.names import CONTROLLER_NAME, NAMESPACE, import_ray, unit_actor_name
from gputq.config import GputqConfig
from gputq.errors import ConfigError, MissingDependencyError
from gputq.transport import get_transport
from gputq.transport.base import Closeable
from gputq.transport.policy import nixl_fix, nixl_import_error
from gputq.unit.storage_unit import StorageUnit

__all__ = ["UnitService", "ControllerService", "Deployment", "local_cluster", "node_unit_name", "serving_transport"]

_log = logging.getLogger(__name__)


def serving_transport(requested: str) -> str:
    """The backend a unit serves with: rdma (which also serves tcp) when NIXL loads.

    Readers forced onto shm need only the tcp control lane.
    """
    if requested in ("tcp", "shm"):
        return "tcp"
    missing = nixl_import_error()
    if missing is None:
        return "rdma"
    if requested == "rdma":
        raise MissingDependencyError(f"transport 'rdma' needs NIXL: {nixl_fix(missing)}")
    return "tcp"


class UnitService(Closeable):
    """One StorageUnit plus the transport server that exposes its arena.

    Parameters
    ----------
    name:
        Unit name, unique in the deployment.
    config:
        Capacity, timeouts, token, transport and bind host.
    """

    def __init__(self, name: str, config: GputqConfig):
        self.name = name
        # Leases outlive no read: a reader gives up after read_timeout_s, the unit after twice that.
        self._unit = StorageUnit(name, config.unit_capacity_bytes, put_timeout_s=config.put_timeout_s,
                                 shm_dir=config.shm_dir, lease_timeout_s=2 * config.read_timeout_s,
                                 reservation_timeout_s=config.reservation_timeout_s,
                                 write_aging_s=config.write_aging_s)
        host = config.host or _default_host()
        self._metrics = None
        try:
            self._server = get_transport(serving_transport(config.transport)).serve(
                self._unit, host=host, port=0, token=config.token, limits=config.server_limits)
            if config.metrics_port:
                # The next free port above the controller's: one unit per node -> metrics_port + 1.
                self._metrics = serve_metrics(unit_metrics(self._unit.stats), config.metrics_port + 1, host)
        except BaseException:
            if getattr(self, "_server", None) is not None:
                self._server.close()
            self._unit.close()
            raise
        self._closed = False

    @property
    def unit(self) -> StorageUnit:
        return self._unit

    def address(self) -> dict:
        return self._server.address

    def stats(self) -> dict:
        """The unit's stats plus this process's RSS and metrics endpoint."""
        return {**self._unit.stats(), "rss_bytes": rss_bytes(),
                "metrics": None if self._metrics is None else f"{self._metrics.host}:{self._metrics.port}"}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._metrics is not None:
                self._metrics.close()
            self._server.close()
            self._unit.close()


class ControllerService(Controller):
    """The controller as it runs in its actor: plus its Prometheus endpoint."""

    def __init__(self, config: GputqConfig):
        super().__init__(config)
        self._metrics = None
        if config.metrics_port:
            self._metrics = serve_metrics(controller_metrics(self), config.metrics_port,
                                          config.host or _default_host())

    def metrics_address(self) -> str | None:
        return None if self._metrics is None else f"{self._metrics.host}:{self._metrics.port}"

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        super().close()


def _default_host() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def node_unit_name(node: dict) -> str:
    """The name cluster mode gives the unit of a Ray node (an entry of ``ray.nodes()``).

    Known before the unit starts, so a job can plan placement (and size arenas) first.
    """
    return f"su-{node['NodeManagerAddress']}-{node['NodeID'][:8]}"


@dataclass
class Deployment:
    """A running controller and its StorageUnit actors.

    Use :meth:`start`; :meth:`shutdown` (or the context manager) stops the
    actors and, if this deployment started Ray, Ray too.
    """

    config: GputqConfig
    controller: object
    units: dict = field(default_factory=dict)
    started_ray: bool = False
    per_node: bool = False
    unit_nodes: dict = field(default_factory=dict)
    controller_name: str = CONTROLLER_NAME

    def __post_init__(self):
        self._sync_lock = threading.Lock()
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @classmethod
    def start(cls, config: GputqConfig, *, ray_address: str | None = None,
              num_cpus: int | None = None, per_node: bool | None = None,
              watch_nodes_s: float | None = None, controller_name: str = CONTROLLER_NAME) -> "Deployment":
        """Start a controller and units on Ray.

        Parameters
        ----------
        ray_address:
            Connect to this cluster (``"auto"``, ``"ray://head:10001"``, ...);
            ``None`` starts an embedded local Ray of its own when this process
            has none initialised (never joining another job's cluster).
        num_cpus:
            CPUs of the embedded Ray (default: this machine's count, at least 2).
        per_node:
            One unit per alive node with hard node affinity (cluster mode).
            Default: on when Ray has more than one node, else
            ``config.num_units`` local units.
        watch_nodes_s:
            In cluster mode, check for joined and departed nodes this often
            (seconds) and run :meth:`sync_nodes`; ``None`` leaves it to the caller.
        controller_name:
            Name of the controller actor in the ``gputq`` namespace (one per
            deployment on a cluster; ``gputq stats`` attaches to the default).
        """
        ray = import_ray()
        if config.metrics_port:
            require_prometheus()  # here, in one line, not as a failed actor on every node
        started = _init_ray(ray, ray_address, num_cpus)
        config = config.with_token()
        controller = _start_controller(ray, config, controller_name)
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if per_node is None:
            per_node = len(alive) > 1
        deployment = cls(config=config, controller=controller, started_ray=started, per_node=per_node,
                         controller_name=controller_name)
        try:
            if per_node:
                deployment.sync_nodes()
            else:
                deployment._add_units([(f"su-{i}", None) for i in range(config.num_units)])
        except BaseException:
            deployment.shutdown()
            raise
        if per_node and watch_nodes_s:
            deployment._watcher = threading.Thread(target=deployment._watch, args=(watch_nodes_s,),
                                                   name="gputq-node-watcher", daemon=True)
            deployment._watcher.start()
        return deployment

    def _add_units(self, placements: list[tuple[str, str | None]]) -> list[str]:
        ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor_cls = ray.remote(num_cpus=0, max_concurrency=16)(UnitService)
        handles = {}
        for name, node in placements:
            options = {"name": unit_actor_name(name, self.controller_name), "namespace": NAMESPACE}
            if node is not None:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
            handles[name] = actor_cls.options(**options).remote(name, self.config)
        try:
            addresses = ray.get([handle.address.remote() for handle in handles.values()])
        except ray.exceptions.RayActorError as exc:
            if not exc.actor_init_failed:
                raise
            for handle in handles.values():  # the others started: they go with the failed start
                ray.kill(handle)
            # Ray's text ends with the unit's own error: "ConfigError: cannot reserve ...", say.
            reason = str(exc).strip().splitlines()[-1]
            raise ConfigError(f"a StorageUnit could not start with this config: {reason}") from None
        ray.get([self.controller.register_unit.remote(name, address, node)
                 for (name, node), address in zip(placements, addresses)])
        self.units.update(handles)
        self.unit_nodes.update(dict(placements))
        return list(handles)

    def sync_nodes(self) -> dict[str, list[str]]:
        """Match units to the cluster's alive nodes (cluster mode): one per node.

        A node without a unit gets one, pinned to it; the unit of a node
        that is gone leaves the membership (its keys are lost with it).
        Returns ``{"added": [unit, ...], "removed": [unit, ...]}``.
        """
        if not self.per_node:
            return {"added": [], "removed": []}
        ray = import_ray()
        with self._sync_lock:
            alive = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
            placed = set(self.unit_nodes.values())
            new = [(node_unit_name(n), node_id) for node_id, n in alive.items() if node_id not in placed]
            gone = [name for name, node in self.unit_nodes.items() if node not in alive]
            for name in gone:
                ray.get(self.controller.deregister_unit.remote(name))
                with contextlib.suppress(Exception):  # its node is gone; the handle may be dead already
                    ray.kill(self.units.pop(name))
                self.unit_nodes.pop(name, None)
            added = self._add_units(new) if new else []
        if added or gone:
            _log.info("gputq: units added %s, removed %s", added, gone)
        return {"added": added, "removed": gone}

    def _watch(self, interval: float) -> None:
        while not self._watch_stop.wait(interval):
            try:
                self.sync_nodes()
            except Exception:  # a transient Ray error must not end the watcher
                _log.warning("gputq: node sync failed", exc_info=True)

    def membership(self) -> dict[str, dict]:
        return import_ray().get(self.controller.membership.remote())

    def clients(self):
        """Channels to this deployment's units, for a writer or reader in this process.

        Units the controller knows to be lost start out lost (no request waits on them).
        """
        clients = UnitClients(self.membership(), self.config)
        for unit, reason in import_ray().get(self.controller.lost_units.remote()).items():
            clients.mark_lost(unit, reason)
        return clients

    def stats(self) -> dict:
        return import_ray().get(self.controller.stats.remote())

    def unreachable(self, samples, *, timeout: float | None = None) -> dict[int, list[str]]:
        """Per sample whose bytes live on a unit lost or unreachable now, those units: the samples a rollout
        manager drops or rolls again before the data-parallel split. One probe per unit, in parallel
        (see :func:`~gputq.client.reachability.unreachable_samples`)."""
        with self.clients() as clients:
            return unreachable_samples(samples, clients, timeout=timeout)

    def release_partition(self, partition: str) -> dict:
        """Drop a rollout's references on every unit: ``{"freed", "unreachable"}`` (see Controller)."""
        return import_ray().get(self.controller.release_partition.remote(partition))

    def shutdown(self) -> None:
        """Stop units and controller (and Ray, if started here). Idempotent."""
        ray = import_ray()
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=30)
            self._watcher = None
        if not ray.is_initialized():
            return
        if self.controller is not None:
            with self._sync_lock:
                closing = {name: handle.close.remote() for name, handle in self.units.items()}
                for name, ref in closing.items():
                    try:
                        ray.get(ref, timeout=self.config.control_timeout_s)
                    except (ray.exceptions.RayError, TimeoutError) as exc:  # its node may be gone
                        _log.warning("gputq: unit %s did not close cleanly: %s", name, exc)
                for handle in self.units.values():
                    ray.kill(handle)
                self.units, self.unit_nodes = {}, {}
                ray.get(self.controller.close.remote())
                ray.kill(self.controller)
                self.controller = None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


@contextlib.contextmanager
def local_cluster(config: GputqConfig) -> Iterator[tuple[GputqConfig, list[UnitService], UnitClients]]:
    """``config.num_units`` units in this process, without Ray, and clients to them.

    For tests, benchmarks and single-process tools. Yields the config (with
    its token), the services and a :class:`~gputq.client.clients.UnitClients`.
    """
    config = config.with_token()
    services: list[UnitService] = []
    try:
        for i in range(config.num_units):
            services.append(UnitService(f"su-{i}", config))
        with UnitClients({s.name: s.address() for s in services}, config) as clients:
            yield config, services, clients
    finally:
        for service in services:
            service.close()


def _init_ray(ray, ray_address: str | None, num_cpus: int | None) -> bool:
    """Connect to ``ray_address``, or start an embedded Ray of ``num_cpus``, unless this process has Ray
    initialised already; whether it started one."""
    if ray.is_initialized():
        return False
    # address="local": a cluster of our own, never one that another job (or a
    # stale `ray start`) left on this machine, which ray.init() would join.
    kwargs = {"address": ray_address} if ray_address else {
        "address": "local", "num_cpus": num_cpus or max(2, os.cpu_count() or 2), "include_dashboard": False}
    ray.init(log_to_driver=False, namespace=NAMESPACE, **kwargs)
    return True


def _start_controller(ray, config: GputqConfig, name: str):
    """The controller actor ``name``, on the driver's node: a num_cpus=0 actor could otherwise land on any
    node, and take the membership down with it when an autoscaled node leaves."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0, max_concurrency=16)(ControllerService).options(
        name=name, namespace=NAMESPACE, scheduling_strategy=here).remote(config)
