"""The whole-shard restore from same-host arenas (the shm backend): in place, or copied out in spans.

A :class:`~gputq.client.reader.Reader` whose shard lies entirely in arenas
mapped here restores it without staging it first (small shards), or copies
it out of the mappings in spans (large ones); see :func:`mapped_staging`.
"""

from __future__ import annotations

import contextlib

from gputq.errors import TransferError
from gputq.kernels import MappedSource
from gputq.transport import arena_copies

__all__ = ["mapped_staging", "mapped_here", "add_leased"]


def mapped_staging(context, requests: list, nbytes: int, stats, lent: contextlib.ExitStack, *,
                   ahead: bool = True):
    """The shard's compact bytes as they lie in the units' arenas, or copied out of them in spans.

    Taken when every unit of the shard is read over shm with its arena
    mapped here (and, for a GPU restore, registered as mapped memory).
    A shard no larger than the config's ``zero_copy_max_bytes`` is
    read in place: the restore reads each compact byte once, where it lies
    (the kernel over PCIe, or the host restore straight out of the mapping),
    and the leases, entered into ``lent``, are confirmed when it closes,
    after the restore. A larger one is copied into this reader's staging
    buffer in spans of the arenas (one copy for keys written in sequence,
    whatever the fields; into GPU memory one ``cudaMemcpyAsync`` a span from
    the page-locked mapping), its leases confirmed right after the copy.
    With ``ahead``, both start on the regions the units' key directories
    name while the leases are requested; a lease naming other ones raises
    ``HintMissedError`` when confirmed. Returns ``None`` to stage as usual.

    ``context`` is the restoring reader's
    :class:`~gputq.client.read_context.ReadContext` (its device, channels,
    config and staging buffer); ``stats`` its
    :class:`~gputq.client.shard_fetch.FetchStats`, counted here.
    """
    on_device = not context.on_host
    channels = {r.unit: context.channel(r.unit) for r in requests}
    if not channels or not all(mapped_here(channel, on_device) for channel in channels.values()):
        return None
    in_place = nbytes <= context.config.zero_copy_max_bytes
    with contextlib.ExitStack() as copied:  # the leases of a copy end with it, before the restore
        leases = lent if in_place else copied
        # Plain lists: a shard has a few keys per unit, and numpy calls on arrays that small
        # cost more than the loop, the more so in the caches a restore just swept.
        starts, addresses, lengths = [], [], []
        for r in requests:
            regions = leases.enter_context(channels[r.unit].mapped_source(
                r.keys, context.read_timeout_s, generations=r.generations,
                incarnation=r.incarnation or None, device=on_device and in_place, ahead=ahead,
                spans=r.spans)).tolist()
            add_leased(r, regions, starts, addresses, lengths)
            stats.unique_keys += len(r.keys)
            stats.unique_keys_per_unit[r.unit] = stats.unique_keys_per_unit.get(r.unit, 0) + len(r.keys)
            stats.bytes_fetched += r.stop - r.start
        source = MappedSource(starts, addresses, lengths, nbytes)
        if in_place:
            return source
        return source.staged_in(context.buffers.staging,
                                arena_copies.device_copy_runs if on_device else arena_copies.copy_runs)


def add_leased(request, regions: list, starts: list, addresses: list, lengths: list) -> None:
    """Append a read's leased ``regions`` (address, length) at its staging bytes ``[start, stop)``.

    Raises ``TransferError`` when the unit leased another byte count than
    the read names (its keys', or its spans').
    """
    packed = request.start
    for address, length in regions:
        starts.append(packed)
        addresses.append(address)
        lengths.append(length)
        packed += length
    if packed != request.stop:
        raise TransferError(f"unit {request.unit} leased {packed - request.start} bytes for {len(request.keys)} "
                            f"keys, expected {request.stop - request.start}", unit=request.unit, keys=request.keys)


def mapped_here(channel, on_device: bool) -> bool:
    """Whether ``channel`` (a :class:`~gputq.client.unit_channel.UnitChannel`) lends its unit's arena
    here: never for tcp or rdma, nor while the unit is lost (its reads then name their keys)."""
    if on_device:
        return channel.device_mappable()
    return channel.mapping is not None
