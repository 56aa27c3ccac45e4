"""One NIXL transfer: a READ or WRITE of arena regions, packed back to back on the local side.

Both directions of the rdma backend go through :class:`Transfers`: a
channel's reads (:mod:`gputq.transport.nixl`) READ leased regions into a
destination, and its pushes (:mod:`gputq.transport.nixl_push`) WRITE a
staging buffer into a reserved region. The descriptor lists are built with
numpy, adjacent regions merged, so a read of many keys written in sequence
is one descriptor.
"""

from __future__ import annotations

import time

import numpy as np

from gputq.errors import GputqTimeoutError, PeerLostError, TransferError, TransferSetupError
from gputq.transport.base import describe_keys

__all__ = ["Transfers", "descriptors"]

# A transfer still in flight after this long is polled with the GIL released
# between polls (time.sleep(0)), so threads reading other units can run.
_SPIN_S = 0.0002
# What NIXL's binding raises when the peer's process went away mid-transfer (matched by name: the
# binding's module depends on the CUDA build installed).
_REMOTE_GONE = "nixlRemoteDisconnectError"


def descriptors(regions: np.ndarray, local_base: int, remote_base: int, device: int):
    """Nx3 (address, length, device) local and remote descriptor arrays for ``regions``.

    Regions are packed back to back from ``local_base``. Runs of regions that
    also follow each other in the arena (keys written in sequence usually do)
    become one descriptor: UCX moves one large block faster than many
    adjacent small ones (each descriptor has its own cost in UCX). Empty runs
    are dropped.
    """
    offsets, lengths = regions[:, 0], regions[:, 1]
    ends = np.cumsum(lengths)  # packed end of each region in the destination
    breaks = np.flatnonzero(offsets[1:] != offsets[:-1] + lengths[:-1]) + 1
    if not len(breaks):  # the common case: one run, no fancy indexing
        total = int(ends[-1]) if len(ends) else 0
        if not total:
            empty = np.empty((0, 3), dtype=np.uint64)
            return empty, empty
        return (np.array([[local_base, total, device]], dtype=np.uint64),
                np.array([[remote_base + int(offsets[0]), total, 0]], dtype=np.uint64))
    first = np.concatenate(([0], breaks))
    run_ends = np.concatenate((ends[breaks - 1], ends[-1:]))
    run_starts = ends[first] - lengths[first]
    keep = run_ends > run_starts
    local = np.empty((int(keep.sum()), 3), dtype=np.uint64)
    local[:, 0] = local_base + run_starts[keep]
    local[:, 1] = (run_ends - run_starts)[keep]
    local[:, 2] = device
    remote = local.copy()
    remote[:, 0] = remote_base + offsets[first][keep]
    remote[:, 2] = 0
    return local, remote


class Transfers:
    """NIXL transfers between this process's agent and one unit's arena.

    Parameters
    ----------
    agent:
        This process's NIXL agent (``nixl_agent``), shared by every channel.
    remote:
        The unit's agent name, as ``add_remote_agent`` returned it.
    remote_base:
        The address of the unit's arena in its process (:attr:`remote_base`).
    unit:
        The unit's name, for errors.
    """

    def __init__(self, agent, remote: str, remote_base: int, unit: str):
        self._agent, self._remote, self.remote_base, self.unit = agent, remote, int(remote_base), unit

    def run(self, op: str, keys, regions: np.ndarray, local_base: int, kind, deadline: float | None) -> None:
        """One NIXL ``op`` (``"READ"`` or ``"WRITE"``) of ``regions`` (arena offset, length), packed from
        ``local_base`` in memory of ``kind`` (``("DRAM", 0)`` or ``("VRAM", device)``).

        Raises
        ------
        TransferSetupError
            NIXL refused to create the transfer; nothing moved.
        GputqTimeoutError
            Still in flight at ``deadline`` (``time.monotonic``); the transfer is aborted.
        PeerLostError
            The unit's process disconnected (it died) during the transfer.
        TransferError
            NIXL failed it otherwise; names the unit and ``keys``.
        """
        local, remote = descriptors(regions, local_base, self.remote_base, kind[1])
        if not len(local):
            return
        agent = self._agent
        try:
            handle = agent.initialize_xfer(op, agent.get_xfer_descs(local, kind[0]),
                                           agent.get_xfer_descs(remote, "DRAM"), self._remote)
        except Exception as exc:
            raise TransferSetupError(f"unit {self.unit}: NIXL cannot {op} keys {describe_keys(keys)} "
                             f"({kind[0]} destination): {exc}", self.unit, keys) from exc
        done = False
        try:
            self._complete(handle, op, keys, deadline)
            done = True
        finally:
            try:
                handle.release()  # aborts a transfer still in flight
            except Exception:
                if done:
                    raise

    def _complete(self, handle, op: str, keys, deadline: float | None) -> None:
        agent = self._agent
        try:
            state = agent.transfer(handle)  # over cma the whole copy happens in here
            spin_until = time.perf_counter() + _SPIN_S
            while state == "PROC":
                if deadline is not None and time.monotonic() > deadline:
                    raise GputqTimeoutError(
                        f"NIXL {op} of keys {describe_keys(keys)} from unit {self.unit} timed out")
                state = agent.check_xfer_state(handle)
                if state == "PROC" and time.perf_counter() > spin_until:
                    time.sleep(0)  # let other threads (reads of other units) take the GIL
        except (GputqTimeoutError, TransferError):
            raise
        except Exception as exc:  # NIXL's binding errors (nixlBackendError, ...)
            if type(exc).__name__ == _REMOTE_GONE:  # the unit's process is gone: a lost peer, not a bad transfer
                raise PeerLostError(f"unit {self.unit}: NIXL {op} of keys {describe_keys(keys)} failed: the "
                                    f"unit's process disconnected ({exc})") from exc
            raise TransferError(f"unit {self.unit}: NIXL {op} of keys {describe_keys(keys)} failed: {exc}",
                                self.unit, keys) from exc
        if state != "DONE":
            raise TransferError(f"unit {self.unit}: NIXL {op} of keys {describe_keys(keys)} failed "
                                f"(transfer state {state})", self.unit, keys)
