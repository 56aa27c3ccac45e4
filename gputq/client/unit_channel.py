"""The channel to one unit as a deployment's readers and writers see it: the transport's, under the loss rule.

A :class:`UnitChannel` forwards every request to its unit's transport
channel through the :class:`UnitAccess` its
:class:`~gputq.client.clients.UnitClients` gives it: a lost peer or a
timeout marks the unit lost and raises
:class:`~gputq.errors.UnitLostError` naming the unit and the keys, and
while the unit is lost its requests fail at once (see
:mod:`gputq.client.clients`). :class:`UnitReadPipeline` is the same rule
around a tcp :class:`~gputq.transport.tcp_pipeline.ReadPipeline`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from gputq.errors import ClosedError, UnitLostError
from gputq.transport.base import Channel

__all__ = ["UnitAccess", "UnitChannel", "UnitReadPipeline"]


@dataclass(frozen=True)
class UnitAccess:
    """What a unit's channels may ask of their :class:`~gputq.client.clients.UnitClients`: the loss rule.

    Attributes
    ----------
    run:
        ``run(unit, keys, what, request)``: ``request(channel)`` on the
        unit's live transport channel; a loss marks the unit lost and raises
        ``UnitLostError`` naming ``what`` and ``keys``.
    guarded:
        ``guarded(unit, keys, what, function, *args)``: ``function(*args)``
        under the same rule (work on a channel already in hand).
    connect:
        ``connect(unit)``: the unit's transport channel, connected if need
        be; ``UnitLostError`` while the unit is lost.
    """

    run: Callable
    guarded: Callable
    connect: Callable


class UnitReadPipeline:
    """:class:`~gputq.transport.tcp_pipeline.ReadPipeline` of one unit under the loss rule.

    From :meth:`UnitChannel.pipeline`. Its transport pipeline (one
    connection) is opened by the first :meth:`send`; a lost peer or a
    timeout in :meth:`send` or :meth:`receive` marks the unit lost and
    raises :class:`UnitLostError` naming the keys. ``close`` is idempotent.
    """

    def __init__(self, access: "UnitAccess", unit: str):
        self._access, self.unit = access, unit
        self._pipe = None

    def send(self, keys: Sequence[str], timeout: float | None = None, **kwargs) -> None:
        """:meth:`ReadPipeline.send <gputq.transport.tcp_pipeline.ReadPipeline.send>`.

        Raises
        ------
        MissingDependencyError
            The unit's transport sends no reads ahead (shm, rdma).
        """
        def request(chan):
            if self._pipe is None:
                self._pipe = chan.pipeline()
            self._pipe.send(keys, timeout, **kwargs)

        self._access.run(self.unit, keys, "read", request)

    def receive(self, sink, timeout: float | None = None, *, keys: Sequence[str] = (), chunk_bytes: int,
                breaks: Sequence[int] = ()) -> list[int]:
        """:meth:`ReadPipeline.receive <gputq.transport.tcp_pipeline.ReadPipeline.receive>`; ``keys``, those of
        the read being received, name it in a loss."""
        if self._pipe is None:
            raise ClosedError(f"no read of unit {self.unit} is in flight on this pipeline")
        pipe = self._pipe
        return self._access.guarded(self.unit, keys, "read",
                                    lambda: pipe.receive(sink, timeout, chunk_bytes=chunk_bytes, breaks=breaks))

    def close(self) -> None:
        """Hand the connection back (dropped if a reply is pending). Idempotent."""
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None


class UnitChannel(Channel):
    """The channel to one unit as :meth:`UnitClients.channel <gputq.client.clients.UnitClients.channel>` hands it out.

    It forwards ``write``, ``write_many``, ``read`` and ``call`` to the transport's channel
    and turns a lost peer or a timeout into :class:`UnitLostError` naming
    the unit and the keys; while the unit is marked lost, requests fail at
    once. ``close`` is a no-op: the ``UnitClients`` owns the connection.

    Same-host reads (the shm transport) add :meth:`mapped_source`,
    :meth:`mapped_lease` and :meth:`directory_lent`, under the same rule,
    byte-stream reads (tcp) add :meth:`pipeline`, one-sided reads (shm, rdma)
    :meth:`lease_ahead` and :meth:`drop_lease`, rdma :meth:`read_leased`, and
    the queries :attr:`pipelines_reads`, :attr:`leases_ahead`,
    :attr:`mapping`, :meth:`device_mappable`, :attr:`fallback_reason`,
    :attr:`reads_ahead`, :attr:`hint_misses` and :attr:`leased_ahead`, which
    answer "nothing mapped" (``None``, ``False``, ``0``) for other transports
    and while the unit is lost, so a reader takes the path whose requests name
    their keys. Nothing else of the transport channel shows through: each
    member decides how a lost unit appears.
    """

    def __init__(self, access: "UnitAccess", unit: str):
        self._access = access
        self.unit = unit

    def write(self, key: str, payload, meta: dict | None = None, timeout: float | None = None, **kwargs) -> dict:
        return self._access.run(self.unit, (key,), "write",
                                lambda chan: chan.write(key, payload, meta, timeout=timeout, **kwargs))

    def write_many(self, items, timeout: float | None = None) -> list:
        """The transport channel's ``write_many``, under the loss rule (naming every item's key)."""
        return self._access.run(self.unit, [item[0] for item in items], "write",
                                lambda chan: chan.write_many(items, timeout=timeout))

    def read(self, keys: Sequence[str], dest, timeout: float | None = None, **kwargs) -> list[int]:
        return self._access.run(self.unit, keys, "read",
                                lambda chan: chan.read(keys, dest, timeout=timeout, **kwargs))

    def pipeline(self) -> "UnitReadPipeline":
        """Reads sent ahead of their replies (tcp: see :attr:`pipelines_reads`), under the loss rule."""
        return UnitReadPipeline(self._access, self.unit)

    @property
    def pipelines_reads(self) -> bool:
        """True when reads of the unit can be sent ahead of their replies and received chunk by chunk as they
        land (tcp; False for other transports and while the unit is lost)."""
        chan = self._live()
        return chan is not None and chan.pipelines_reads

    @property
    def leases_ahead(self) -> bool:
        """True when a read's lease can be taken ahead of it (rdma; False for other transports and while the
        unit is lost)."""
        chan = self._live()
        return chan is not None and chan.leases_ahead

    def lease_ahead(self, keys: Sequence[str], timeout: float | None = None, **kwargs):
        """The transport channel's ``lease_ahead`` (the read's keyword arguments), under the loss rule."""
        return self._access.run(self.unit, keys, "read", lambda chan: chan.lease_ahead(keys, timeout, **kwargs))

    def read_leased(self, held, dest, timeout: float | None = None) -> list[int]:
        """The transport channel's ``read_leased``, under the loss rule (a channel reconnected since the
        lease takes its own)."""
        return self._access.run(self.unit, held.keys, "read", lambda chan: chan.read_leased(held, dest, timeout))

    def drop_lease(self, held) -> None:
        """End a lease taken ahead that no read will use; nothing to do while the unit is lost."""
        chan = self._live()
        if chan is not None:
            chan.drop_lease(held)

    def call(self, method: str, timeout: float | None = None, **args) -> Any:
        keys = args.get("keys") or ()
        return self._access.run(self.unit, keys if isinstance(keys, (list, tuple)) else (), method,
                                lambda chan: chan.call(method, timeout=timeout, **args))

    @contextlib.contextmanager
    def mapped_source(self, keys: Sequence[str], timeout: float | None = None, **kwargs) -> Iterator:
        """Lease ``keys`` and lend their bytes where they lie in the unit's mapped arena.

        :meth:`ShmChannel.mapped_source <gputq.transport.shm.ShmChannel.mapped_source>`
        (same arguments, a context manager yielding the ``[n, 2]`` addresses
        and lengths) under the loss rule: the lease is requested on entry and
        confirmed on exit, and a lost peer or a timeout in either marks the
        unit lost and raises :class:`UnitLostError` naming the keys. An error
        of the block itself passes through as it is.

        Raises
        ------
        MissingDependencyError
            The unit's transport maps no arena here (tcp, rdma), or the
            mapping cannot serve this read (see the shm channel).
        UnitLostError
            The unit is lost, or was lost while the lease was requested or
            confirmed.
        """
        keys, access = list(keys), self._access

        def enter(chan):
            source = chan.mapped_source(keys, timeout, **kwargs)
            return source, source.__enter__()

        source, regions = access.run(self.unit, keys, "read", enter)
        try:
            yield regions
        except BaseException as exc:
            if not access.guarded(self.unit, keys, "read", source.__exit__, type(exc), exc, exc.__traceback__):
                raise
        else:
            access.guarded(self.unit, keys, "read", source.__exit__, None, None, None)

    def mapped_lease(self, held) -> contextlib.AbstractContextManager:
        """:meth:`ShmChannel.mapped_lease <gputq.transport.shm.ShmChannel.mapped_lease>` (the regions of a lease
        from :meth:`lease_ahead` where they lie in the mapping, held mapped for the block) under the loss
        rule; a channel reconnected since the lease raises ``HintMissedError`` (lease again)."""
        return self._held_mapping(held.keys, lambda chan: chan.mapped_lease(held))

    def directory_lent(self, keys: Sequence[str], generations: Sequence[int],
                       spans=None) -> contextlib.AbstractContextManager:
        """:meth:`ShmChannel.directory_lent <gputq.transport.shm.ShmChannel.directory_lent>` (the key directory's
        regions of ``keys``, a hint, held mapped for the block; None where it names them not all) under
        the loss rule."""
        return self._held_mapping(keys, lambda chan: chan.directory_lent(keys, generations, spans))

    @contextlib.contextmanager
    def _held_mapping(self, keys: Sequence[str], manager_of: Callable) -> Iterator:
        """Enter ``manager_of(chan)`` (a block holding the mapping, that asks nothing of the unit on exit) on
        the live channel, under the loss rule."""

        def enter(chan):
            manager = manager_of(chan)
            return manager, manager.__enter__()

        manager, lent = self._access.run(self.unit, keys, "read", enter)
        try:
            yield lent
        finally:
            manager.__exit__(None, None, None)  # the mapping's hold ends

    @property
    def mapping(self):
        """The unit's arena as mapped here (shm), or None: the transport maps none, or the unit is lost."""
        chan = self._live()
        return None if chan is None else chan.mapping

    def device_mappable(self) -> bool:
        """True when the arena is mapped here and registered with CUDA (False for other transports
        and while the unit is lost)."""
        chan = self._live()
        if chan is None:
            return False
        return bool(self._access.guarded(self.unit, (), "device_mappable", chan.device_mappable))

    @property
    def fallback_reason(self) -> str | None:
        """Why an shm channel reads over rdma or tcp, when it does (None otherwise, or while lost)."""
        chan = self._live()
        return None if chan is None else chan.fallback_reason

    def _counter(self, name: str) -> int:
        """The current channel's counter ``name``, one :class:`~gputq.transport.base.Channel` declares
        (0 while the unit is lost)."""
        chan = self._live()
        return 0 if chan is None else int(getattr(chan, name))

    @property
    def reads_ahead(self) -> int:
        """Reads of the current shm channel copied from the key directory ahead of their lease."""
        return self._counter("reads_ahead")

    @property
    def hint_misses(self) -> int:
        """Reads of the current shm channel whose directory regions the lease did not confirm."""
        return self._counter("hint_misses")

    @property
    def leased_ahead(self) -> int:
        """Reads of the current rdma channel that copied under a lease taken ahead of them."""
        return self._counter("leased_ahead")

    @property
    def incarnation(self) -> str:
        """The incarnation the unit announced on connecting (UnitLostError while it is lost)."""
        return self._access.run(self.unit, (), "incarnation", lambda chan: chan.incarnation)

    def close(self) -> None:
        """Nothing to do: the connection belongs to the ``UnitClients``."""

    def _live(self):
        """The transport channel, connected if need be; None while the unit is lost."""
        try:
            return self._access.connect(self.unit)
        except UnitLostError:
            return None

    def __repr__(self) -> str:
        return f"UnitChannel({self.unit!r})"
