"""The serving side of the rdma backend: one arena registered with NIXL once.

The arena is registered at start; readers READ it one-sided. Control
(leases, write reservations, lifecycle calls) is served by the tcp backend
beside it, through :class:`_LeaseControl`, which adds the NIXL lease and
write methods in front of the handler's own control methods.
"""

from __future__ import annotations

import operator
import threading
from typing import Any

import numpy as np

from transport.base import ArenaHandler, Server
from transport.nixl_pool import agent_name, host_ptr, import_nixl
from transport.policy import infiniband_devices, local_hostname
from transport.tcp import TcpTransport

__all__ = ["NixlServer", "LEASE", "END_LEASE", "BEGIN_WRITE", "COMMIT_WRITE", "ABORT_WRITE"]

#: Control methods the server adds in front of the handler's own.
LEASE, END_LEASE = "nixl_lease", "nixl_end_lease"
BEGIN_WRITE, COMMIT_WRITE, ABORT_WRITE = "nixl_begin_write", "nixl_commit_write", "nixl_abort_write"
_SERVER_PROGRESS_S = 0.001

_OFFSET = operator.attrgetter("offset")
_NBYTES = operator.attrgetter("nbytes")


class _LeaseControl:
    """The handler as the tcp server sees it: NIXL's control calls added in front.

    Everything else (writes, the handler's own control methods) is delegated
    unchanged, so the tcp path of an rdma unit behaves exactly like a tcp unit.
    """

    def __init__(self, handler: ArenaHandler):
        self._handler = handler
        self.name = handler.name
        self._lease_regions = getattr(handler, "lease_regions", None)

    @property
    def arena(self) -> memoryview:
        return self._handler.arena

    def __getattr__(self, attr):  # begin_write, commit_write, lease, ...
        return getattr(self._handler, attr)

    def control(self, method: str, args: dict) -> Any:
        h = self._handler
        if method == LEASE:
            # Leases the client finished with ride on its next request; ended
            # first, so a unit short of space frees them before leasing more.
            for lease_id in args.get("end") or ():
                h.end_lease(int(lease_id))
            return self._lease(list(args["keys"]))
        if method == END_LEASE:
            for lease_id in args["lease_ids"]:
                h.end_lease(int(lease_id))
            return None
        if method == BEGIN_WRITE:
            return h.begin_write(args["key"], int(args["nbytes"]), dict(args.get("meta") or {}),
                                 args.get("wait_s"))
        if method == COMMIT_WRITE:
            return h.commit_write(args["key"])
        if method == ABORT_WRITE:
            h.abort_write(args["key"])
            return None
        return h.control(method, args)

    def _lease(self, keys: list) -> dict:
        # Regions travel as raw little-endian int64 (offset, length) rows:
        # packing, unpacking and converting 1024 [offset, length] lists
        # costs ~200 us, this ~60 us. A handler with ``lease_regions(keys)
        # -> (lease_id, int64 array [n, 2])`` skips building n Region
        # objects (~0.3 us each, most of a 1024-key lease).
        if self._lease_regions is not None:
            lease_id, regions = self._lease_regions(keys)
            return {"lease_id": int(lease_id), "regions": np.asarray(regions, dtype="<i8").tobytes()}
        lease = self._handler.lease(keys)
        n = len(lease.regions)
        regions = np.empty((n, 2), dtype="<i8")
        regions[:, 0] = np.fromiter(map(_OFFSET, lease.regions), dtype="<i8", count=n)
        regions[:, 1] = np.fromiter(map(_NBYTES, lease.regions), dtype="<i8", count=n)
        return {"lease_id": lease.lease_id, "regions": regions.tobytes()}


class NixlServer(Server):
    """Serves one arena: registered with NIXL once, control over tcp.

    The address holds ``transport`` (``"rdma"``), ``unit``, ``control`` (the
    tcp server's address: a tcp client of this unit connects with it),
    ``agent``, ``agent_metadata`` (bytes), ``arena_base``, ``arena_nbytes``,
    ``hostname`` and ``ib_devices`` (what :mod:`transport.policy` looks at).
    """

    def __init__(self, handler: ArenaHandler, *, host: str, port: int, token: str,
                 max_frame_bytes: int):
        nixl_agent, nixl_agent_config, sync = import_nixl()
        self._closed = False
        self._reg = None
        self._tcp = None
        name = agent_name(f"unit-{handler.name}")
        # The target side must make progress for connection wire-up (and for
        # every transfer on UCX's tcp lane). NIXL's own progress thread spins
        # without pause and holds a full core even when idle (measured: 2.0 s
        # of CPU per 2 s idle), which a unit cannot afford next to its tcp
        # server; a thread progressing every millisecond costs ~5% of a core.
        self._agent = nixl_agent(name, nixl_agent_config(
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
            self._tcp = TcpTransport().serve(_LeaseControl(handler), host=host, port=port,
                                             token=token, max_frame_bytes=max_frame_bytes)
            self._address = dict(transport="rdma", unit=handler.name, control=self._tcp.address, agent=name,
                                 agent_metadata=self._agent.get_agent_metadata(),
                                 arena_base=base, arena_nbytes=nbytes,
                                 hostname=local_hostname(), ib_devices=infiniband_devices())
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> dict:
        return dict(self._address)

    def _progress_loop(self) -> None:
        while not self._stop.wait(_SERVER_PROGRESS_S):
            try:
                self._agent.get_new_notifs()  # drives the UCX worker
            except Exception:  # a failing poll must not kill the unit; the reader sees the error
                pass

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
