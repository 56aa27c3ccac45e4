"""The serving side of the rdma backend: one arena registered with NIXL once.

The arena is registered at start; readers READ it one-sided. Control is
served by the tcp backend beside it: every tcp server answers the one-sided
readers' ``lease`` / ``end_lease`` calls, and :class:`_NixlControl` adds the
rdma-only method in front of the handler's own:

- ``nixl_connect`` hands out the NIXL agent metadata and the arena's base
  address. It is the only way to get them, and only over a connection that
  passed the token handshake: they let a NIXL peer read and write the whole
  arena, so they never appear in the address, the membership or a log.

A pushed write is framed by the reservation calls every tcp server answers
(:mod:`gputq.transport.write_batches`); the client NIXL-WRITEs into the
reserved regions in between, within the safe window of
:mod:`gputq.transport.reserved_writes`, and a commit after a reservation
expired is refused by the unit with a typed error the client raises.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import numpy as np

from gputq.transport.base import LogLimiter, Server
from gputq.transport.handler import ArenaHandler, Lease, ServerLimits, check_handler
from gputq.transport.nixl_pool import agent_name, host_ptr, import_nixl
from gputq.transport.policy import infiniband_devices, local_hostname
from gputq.transport.tcp import TcpTransport
from gputq.transport.ucx_devices import ucx_bound_to

__all__ = ["NixlServer", "CONNECT"]

log = logging.getLogger(__name__)

#: The control method the server adds in front of the handler's own.
CONNECT = "nixl_connect"
_SERVER_PROGRESS_S = 0.001


class _NixlControl(ArenaHandler):
    """The handler as the tcp server sees it: the rdma control calls added in front.

    Every other member is the handler's, unchanged, so the tcp path of an
    rdma unit behaves exactly like a tcp unit.
    """

    def __init__(self, handler: ArenaHandler, connect_info: dict):
        self._handler = handler
        self._connect_info = connect_info

    @property
    def name(self) -> str:
        return self._handler.name

    @property
    def incarnation(self) -> str:
        return self._handler.incarnation

    @property
    def arena(self) -> memoryview:
        return self._handler.arena

    @property
    def arena_path(self) -> str:
        return self._handler.arena_path

    @property
    def directory_file(self) -> dict | None:
        return self._handler.directory_file

    @property
    def lease_timeout_s(self) -> float | None:
        return self._handler.lease_timeout_s

    @property
    def reservation_timeout_s(self) -> float | None:
        return self._handler.reservation_timeout_s

    def begin_write(self, key: str, nbytes: int, meta: dict, timeout: float | None) -> int:
        return self._handler.begin_write(key, nbytes, meta, timeout)

    def commit_write(self, key: str, generation: int | None = None) -> dict:
        return self._handler.commit_write(key, generation)

    def abort_write(self, key: str, generation: int | None = None) -> None:
        self._handler.abort_write(key, generation)

    def lease(self, keys: Sequence[str], generations=None, incarnation=None, *, expires: bool = True) -> Lease:
        return self._handler.lease(keys, generations=generations, incarnation=incarnation, expires=expires)

    def lease_regions(self, keys: Sequence[str], generations=None, incarnation=None, *,
                      expires: bool = True, spans: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        return self._handler.lease_regions(keys, generations=generations, incarnation=incarnation,
                                           expires=expires, spans=spans)

    def end_lease(self, lease_id: int) -> bool | None:
        return self._handler.end_lease(lease_id)

    def control(self, method: str, args: dict) -> Any:
        if method == CONNECT:
            return dict(self._connect_info)
        return self._handler.control(method, args)


class NixlServer(Server):
    """Serves one arena: registered with NIXL once, control over tcp.

    The address holds ``transport`` (``"rdma"``), ``unit``, ``incarnation``,
    ``control`` (the tcp server's address: a tcp client of this unit
    connects with it), ``hostname`` and ``ib_devices`` (what
    :mod:`gputq.transport.policy` looks at). No secret: the NIXL metadata comes
    from the ``nixl_connect`` call, after the token handshake.
    """

    def __init__(self, handler: ArenaHandler, *, host: str, port: int, token: str,
                 limits: ServerLimits = ServerLimits()):
        check_handler(handler)  # before an agent is made for it
        nixl_agent, nixl_agent_config, sync = import_nixl()
        self._closed = False
        self._reg = None
        self._tcp = None
        self._name = handler.name
        self._failures = LogLimiter(log)
        # The target side must make progress for connection wire-up (and for
        # every transfer on UCX's tcp lane). NIXL's own progress thread spins
        # without pause and holds a full core even when idle, which a unit
        # cannot afford next to its tcp server; a thread progressing every
        # millisecond costs a small fraction of one.
        # UCX listens on every interface it may use: only the one holding `host` (and InfiniBand ports).
        with ucx_bound_to(host):
            self._agent = nixl_agent(agent_name(f"unit-{handler.name}"), nixl_agent_config(
                enable_prog_thread=False, backends=["UCX"], sync_mode=sync.NIXL_THREAD_SYNC_RW))
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, name=f"gputq-nixl-{handler.name}",
                                          daemon=True)
        self._progress.start()
        try:
            base, nbytes = host_ptr(handler.arena)
            if nbytes:
                self._reg = self._agent.register_memory(
                    np.array([[base, nbytes, 0]], dtype=np.uint64), "DRAM")
            info = {"agent_metadata": self._agent.get_agent_metadata(), "arena_base": base, "arena_nbytes": nbytes}
            self._tcp = TcpTransport().serve(_NixlControl(handler, info), host=host, port=port, token=token,
                                             limits=limits)
            control = self._tcp.address
            self._address = dict(transport="rdma", unit=handler.name, incarnation=control["incarnation"],
                                 control=control, hostname=local_hostname(), ib_devices=infiniband_devices())
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> dict:
        return dict(self._address, control=dict(self._address["control"]))

    @property
    def limits(self) -> ServerLimits:
        """What the control lane allows its peers (the one-sided transfers have no frames)."""
        return self._tcp.limits

    def _progress_loop(self) -> None:
        while not self._stop.wait(_SERVER_PROGRESS_S):
            try:
                self._agent.get_new_notifs()  # drives the UCX worker
            except Exception as exc:  # a failing poll must not kill the unit; readers see their own errors
                self._failures.warning("unit %s: NIXL progress failed: %s", self._name, exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._progress.join()
        if self._tcp is not None:
            self._tcp.close()
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception:  # best effort during teardown
                pass
            self._reg = None
