"""Ray deployment: a controller and StorageUnits, embedded or one per node.

The classes here are plain Python (``UnitService`` owns a StorageUnit and
its transport server); Ray actors are thin wrappers made on demand, so the
unit tests run everything in-process. Serving actors take ``num_cpus=0``:
they only serve sockets and must not starve trainers of CPU slots.

Ray carries control only: addresses, stats, lifecycle calls (rule 1).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

from transport.base import Closeable

from .clients import UnitClients
from .config import GputqConfig
from .controller import Controller
from .errors import MissingDependencyError
from .storage_unit import StorageUnit

__all__ = ["UnitService", "Deployment", "local_cluster", "serving_transport", "import_ray"]


def import_ray():
    try:
        import ray
    except ImportError:
        raise MissingDependencyError("this needs Ray: pip install 'gputq[ray]'") from None
    return ray


def serving_transport(requested: str) -> str:
    """The backend a unit serves with: rdma (which also serves tcp) when NIXL loads."""
    if requested == "tcp":
        return "tcp"
    from transport.policy import nixl_import_error

    missing = nixl_import_error()
    if missing is None:
        return "rdma"
    if requested == "rdma":
        from .info import nixl_fix

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
        from transport import get_transport

        self.name = name
        # Leases outlive no read: a reader gives up after read_timeout_s, the unit after twice that.
        self._unit = StorageUnit(name, config.unit_capacity_bytes, put_timeout_s=config.put_timeout_s,
                                 shm_dir=config.shm_dir, lease_timeout_s=2 * config.read_timeout_s)
        host = config.host or _default_host()
        try:
            self._server = get_transport(serving_transport(config.transport)).serve(
                self._unit, host=host, port=0, token=config.token,
                max_frame_bytes=config.max_frame_bytes)
        except BaseException:
            self._unit.close()
            raise
        self._closed = False

    @property
    def unit(self) -> StorageUnit:
        return self._unit

    def address(self) -> dict:
        return self._server.address

    def stats(self) -> dict:
        return self._unit.stats()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._server.close()
            self._unit.close()


def _default_host() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


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

    @classmethod
    def start(cls, config: GputqConfig, *, ray_address: str | None = None,
              num_cpus: int | None = None, per_node: bool | None = None) -> "Deployment":
        """Start a controller and units on Ray.

        Parameters
        ----------
        ray_address:
            Connect to this cluster; ``None`` starts an embedded local Ray
            if none is running.
        num_cpus:
            CPUs of the embedded Ray (default: this machine's count, at least 2).
        per_node:
            One unit per alive node with hard node affinity (cluster mode).
            Default: on when Ray has more than one node, else
            ``config.num_units`` local units.
        """
        ray = import_ray()
        started = False
        if not ray.is_initialized():
            import os

            kwargs = {"address": ray_address} if ray_address else {
                "num_cpus": num_cpus or max(2, os.cpu_count() or 2), "include_dashboard": False}
            ray.init(log_to_driver=False, **kwargs)
            started = True
        config = config.with_token()
        actor_cls = ray.remote(num_cpus=0, max_concurrency=16)(UnitService)
        controller = ray.remote(num_cpus=0, max_concurrency=16)(Controller).remote(config)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if per_node is None:
            per_node = len(nodes) > 1
        units = {}
        if per_node:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            for node in nodes:
                name = f"su-{node['NodeManagerAddress']}-{node['NodeID'][:8]}"
                units[name] = (actor_cls.options(
                    name=None, scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
                    .remote(name, config), node["NodeID"])
        else:
            for i in range(config.num_units):
                name = f"su-{i}"
                units[name] = (actor_cls.remote(name, config), None)
        addresses = ray.get([handle.address.remote() for handle, _ in units.values()])
        ray.get([controller.register_unit.remote(name, addr, node)
                 for (name, (_, node)), addr in zip(units.items(), addresses)])
        return cls(config=config, controller=controller,
                   units={name: handle for name, (handle, _) in units.items()}, started_ray=started)

    def membership(self) -> dict[str, dict]:
        return import_ray().get(self.controller.membership.remote())

    def clients(self):
        """Channels to this deployment's units, for a writer or reader in this process."""
        return UnitClients(self.membership(), self.config)

    def stats(self) -> dict:
        return import_ray().get(self.controller.stats.remote())

    def release_partition(self, partition: str) -> int:
        """Drop a rollout's references on every unit; returns keys freed."""
        return import_ray().get(self.controller.release_partition.remote(partition))

    def shutdown(self) -> None:
        """Stop units and controller (and Ray, if started here). Idempotent."""
        ray = import_ray()
        if not ray.is_initialized():
            return
        if self.units:
            ray.get([handle.close.remote() for handle in self.units.values()])
            for handle in self.units.values():
                ray.kill(handle)
            ray.get(self.controller.close.remote())
            ray.kill(self.controller)
            self.units = {}
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
    its token), the services and a :class:`~gputq.clients.UnitClients`.
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
