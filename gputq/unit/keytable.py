"""A unit's key table: stored keys, writes in progress, and who owns each key.

Ownership is a counter of references per *partition* (rollout). The writing
partition holds the first reference; ``add_ref`` shares a key into another
partition, ``transfer`` moves a partition's references to another without
moving bytes, ``release`` and ``release_partition`` drop references, and
``delete`` removes keys outright (commit-region rollback). A key is
forgotten when its last reference goes; what happens to its bytes then
(freed at once, or kept until the last lease on them ends) is the owner's
``on_forget`` callback.

The table is not thread-safe and does not validate its arguments: the
StorageUnit calls it with its lock held, after checking input at its own
boundary with the ``check_*`` functions here, which raise
:class:`InvalidInputError` for anything malformed.
"""

from __future__ import annotations

import secrets
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from gputq.errors import InvalidInputError, StaleReadError, UnknownKeyError

__all__ = [
    "DEFAULT_PARTITION",
    "RESERVED",
    "COMMITTED",
    "Entry",
    "KeyTable",
    "ReleaseIds",
    "check_key",
    "check_keys",
    "check_partition",
    "check_nbytes",
    "check_meta",
    "check_generations",
    "check_release_id",
    "check_page",
]

DEFAULT_PARTITION = "default"

RESERVED = "reserved"
COMMITTED = "committed"

_MAX_GENERATION = 2**63
_MAX_RELEASE_ID = 256


@dataclass(eq=False)  # identity hashing: an entry may sit in sets and dicts
class Entry:
    """One stored key (or one write in progress) and its region of the arena."""

    key: str
    offset: int
    nbytes: int
    meta: dict
    generation: int
    state: str = RESERVED
    holders: Counter = field(default_factory=Counter)
    #: Leases pinning the region; a forgotten entry's region waits for them.
    leases: int = 0
    #: Forgotten while leased: the region is freed when ``leases`` reaches 0.
    released: bool = False


class ReleaseIds:
    """The ``release_id`` s already applied, per partition, bounded.

    A retried or duplicated release carries the id of the first one and is
    a no-op. Ids are forgotten when their partition is released, and the
    oldest go first once ``limit`` ids are remembered: a retry comes soon
    after its original, so a bounded memory is enough.
    """

    def __init__(self, limit: int = 65536):
        self._limit = limit
        self._order: OrderedDict[tuple[str | None, str], None] = OrderedDict()
        self._by_partition: dict[str | None, set[str]] = {}

    def __len__(self) -> int:
        return len(self._order)

    def seen(self, partition: str | None, release_id: str) -> bool:
        return (partition, release_id) in self._order

    def add(self, partition: str | None, release_id: str) -> None:
        self._order[(partition, release_id)] = None
        self._by_partition.setdefault(partition, set()).add(release_id)
        while len(self._order) > self._limit:
            (old_partition, old_id), _ = self._order.popitem(last=False)
            self._discard(old_partition, old_id)

    def forget_partition(self, partition: str) -> None:
        for release_id in self._by_partition.pop(partition, ()):
            del self._order[(partition, release_id)]

    def _discard(self, partition: str | None, release_id: str) -> None:
        ids = self._by_partition[partition]
        ids.discard(release_id)
        if not ids:
            del self._by_partition[partition]


class KeyTable:
    """Keys, reservations and reference-counted ownership of one unit.

    Parameters
    ----------
    unit : str
        Unit name, for error messages.
    on_forget : callable
        Called with each :class:`Entry` that leaves the table (last
        reference dropped, deleted, aborted, expired): the owner frees or
        parks its region.
    """

    def __init__(self, unit: str, on_forget: Callable[[Entry], None]):
        self._unit = unit
        self._on_forget = on_forget
        self._entries: dict[str, Entry] = {}
        self._partitions: dict[str, set[str]] = {}
        self._release_ids = ReleaseIds()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def visible(self, key: str) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.state == COMMITTED

    def committed(self, key: str) -> Entry:
        """The committed entry of ``key``; :class:`UnknownKeyError` names unit and key."""
        entry = self._entries.get(key)
        if entry is None or entry.state != COMMITTED:
            raise UnknownKeyError(f"unit {self._unit}: unknown key {key!r}")
        return entry

    def committed_many(self, keys: Sequence[str]) -> list[Entry]:
        """:meth:`committed` of each key, in order (the lease fast path)."""
        entries = self._entries
        try:
            found = [entries[k] for k in keys]
        except KeyError as exc:
            raise UnknownKeyError(f"unit {self._unit}: unknown key {exc.args[0]!r}") from None
        for entry in found:
            if entry.state != COMMITTED:
                raise UnknownKeyError(f"unit {self._unit}: unknown key {entry.key!r}")
        return found

    # -- writes ----------------------------------------------------------------------

    def reserve(self, entry: Entry, partition: str) -> None:
        self._entries[entry.key] = entry
        self._add_holder(entry, partition, 1)

    def forget(self, entry: Entry) -> None:
        """Remove ``entry`` from the table and drop its references; hand it to ``on_forget``."""
        del self._entries[entry.key]
        for partition in list(entry.holders):
            self._drop_holder(entry, partition, entry.holders[partition])
        self._on_forget(entry)

    # -- ownership -----------------------------------------------------------------------

    def release(self, keys: Sequence[str], partition: str | None, missing_ok: bool,
                release_id: str | None) -> int:
        """Drop references (see :meth:`StorageUnit.release`); return keys freed."""
        if release_id is not None and self._release_ids.seen(partition, release_id):
            return 0
        wanted = Counter(k for k in keys if not missing_ok or self.visible(k))
        if missing_ok and partition is not None:
            # Skip the references the partition does not hold (e.g. transferred away).
            wanted = +Counter({key: min(count, self._entries[key].holders[partition])
                               for key, count in wanted.items()})
        entries = []
        for key, count in wanted.items():  # validate everything before changing anything
            entry = self.committed(key)
            if partition is not None and entry.holders[partition] < count:
                raise InvalidInputError(
                    f"unit {self._unit}: partition {partition!r} holds "
                    f"{entry.holders[partition]} reference(s) to key {key!r}, cannot release {count}")
            entries.append((entry, count))
        freed = 0
        for entry, count in entries:
            if partition is None:
                for holder in list(entry.holders):
                    self._drop_holder(entry, holder, entry.holders[holder])
            else:
                self._drop_holder(entry, partition, count)
            freed += self._forget_if_unheld(entry)
        if release_id is not None:
            self._release_ids.add(partition, release_id)
        return freed

    def release_partition(self, partition: str) -> int:
        """Drop every reference ``partition`` holds; return committed keys freed.

        A write in progress loses its reference too: its commit then fails.
        """
        freed = 0
        for key in list(self._partitions.get(partition, ())):
            entry = self._entries[key]
            self._drop_holder(entry, partition, entry.holders[partition])
            if entry.state == COMMITTED:
                freed += self._forget_if_unheld(entry)
        self._release_ids.forget_partition(partition)
        return freed

    def add_ref(self, keys: Sequence[str], partition: str) -> None:
        for entry in [self.committed(k) for k in keys]:
            self._add_holder(entry, partition, 1)

    def transfer(self, keys: Sequence[str], src: str, dst: str) -> int:
        entries = list({k: self.committed(k) for k in keys}.values())
        for entry in entries:
            if entry.holders.get(src, 0) == 0:
                raise InvalidInputError(
                    f"unit {self._unit}: partition {src!r} holds no reference to key {entry.key!r}")
        if src != dst:
            for entry in entries:
                count = entry.holders[src]
                self._drop_holder(entry, src, count)
                self._add_holder(entry, dst, count)
        return len(entries)

    def delete(self, keys: Iterable[str]) -> int:
        removed = 0
        for key in keys:
            if self.visible(key):
                self.forget(self._entries[key])
                removed += 1
        return removed

    # -- queries -------------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> list[dict]:
        return [{"key": e.key, "offset": e.offset, "nbytes": e.nbytes, "generation": e.generation,
                 "meta": dict(e.meta), "holders": dict(e.holders)}
                for e in [self.committed(k) for k in keys]]

    def counts(self) -> tuple[int, int]:
        """``(committed, reserved)`` key counts."""
        committed = sum(1 for e in self._entries.values() if e.state == COMMITTED)
        return committed, len(self._entries) - committed

    def partition_stats(self) -> dict:
        return {name: {"keys": len(keys), "bytes": sum(self._entries[k].nbytes for k in keys)}
                for name, keys in self._partitions.items()}

    def snapshot(self, after: str | None = None, limit: int | None = None) -> dict:
        """Per partition the committed keys and their reference counts; keys being written apart.

        Committed keys are listed in name order, those after ``after`` and at
        most ``limit`` of them; ``"next"`` is the ``after`` of the next page
        (None on the last).
        """
        names = sorted(k for k, e in self._entries.items()
                       if e.state == COMMITTED and (after is None or k > after))
        page = names if limit is None else names[:limit]
        partitions: dict[str, dict[str, int]] = {}
        for key in page:
            for partition, count in self._entries[key].holders.items():
                partitions.setdefault(partition, {})[key] = count
        reserved = sorted(k for k, e in self._entries.items() if e.state != COMMITTED)
        return {"partitions": partitions, "reserved": reserved,
                "next": page[-1] if len(page) < len(names) else None}

    # -- internals -------------------------------------------------------------------------

    def _add_holder(self, entry: Entry, partition: str, count: int) -> None:
        entry.holders[partition] += count
        self._partitions.setdefault(partition, set()).add(entry.key)

    def _drop_holder(self, entry: Entry, partition: str, count: int) -> None:
        left = entry.holders[partition] - count
        if left > 0:
            entry.holders[partition] = left
            return
        del entry.holders[partition]
        keys = self._partitions.get(partition)
        if keys is not None:
            keys.discard(entry.key)
            if not keys:
                del self._partitions[partition]

    def _forget_if_unheld(self, entry: Entry) -> int:
        if entry.holders:
            return 0
        self.forget(entry)
        return 1


def check_key(unit: str, key) -> str:
    """``key`` if it is a non-empty str."""
    if not isinstance(key, str) or not key:
        raise InvalidInputError(f"unit {unit}: key must be a non-empty str, got {key!r}")
    return key


def check_keys(unit: str, keys) -> list[str]:
    """``keys`` as a list, if it is a list or tuple of str."""
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
        raise InvalidInputError(f"unit {unit}: keys must be a list of str, got {keys!r:.200}")
    return list(keys)


def check_partition(unit: str, partition) -> str:
    """A partition name (str or int) as str."""
    if isinstance(partition, bool) or not isinstance(partition, (str, int, np.integer)):
        raise InvalidInputError(f"unit {unit}: a partition must be a str or an int, got {partition!r}")
    return str(partition)


def check_nbytes(unit: str, nbytes) -> int:
    """A write's size, an int >= 0."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise InvalidInputError(f"unit {unit}: nbytes must be an int >= 0, got {nbytes!r}")
    return int(nbytes)


def check_meta(unit: str, meta) -> tuple[dict, str, int]:
    """A write's ``(meta without the generation, partition, generation)``.

    ``meta["generation"]``, chosen by the writer, is an int in ``[1, 2**63)``;
    without it a random one is drawn.
    """
    if meta is not None and not isinstance(meta, dict):
        raise InvalidInputError(f"unit {unit}: meta must be a dict, got {type(meta).__name__}")
    meta = dict(meta or {})
    generation = meta.pop("generation", None)
    if generation is None:
        generation = secrets.randbits(63) or 1
    elif (isinstance(generation, bool) or not isinstance(generation, (int, np.integer))
          or not 1 <= generation < _MAX_GENERATION):
        raise InvalidInputError(f"unit {unit}: meta generation must be an int in [1, 2**63), got {generation!r}")
    return meta, check_partition(unit, meta.get("partition", DEFAULT_PARTITION)), int(generation)


def check_release_id(unit: str, release_id) -> str | None:
    """None, or a str of 1 to 256 characters."""
    if release_id is not None and (not isinstance(release_id, str) or not 0 < len(release_id) <= _MAX_RELEASE_ID):
        raise InvalidInputError(
            f"unit {unit}: release_id must be a str of 1 to {_MAX_RELEASE_ID} characters, got {release_id!r:.300}")
    return release_id


def check_generations(unit: str, entries: list[Entry], generations) -> None:
    """Compare the generations a reader expects with the stored ones (0 or None: unchecked).

    Raises
    ------
    StaleReadError
        A key's stored generation differs: it was deleted and written again.
    """
    if not isinstance(generations, (list, tuple)) or len(generations) != len(entries):
        raise InvalidInputError(
            f"unit {unit}: generations must be a list of {len(entries)} ints, got {generations!r:.200}")
    if [e.generation for e in entries] == list(generations):
        return  # the common case, compared at C speed in one list comparison
    for entry, expected in zip(entries, generations):
        if expected is None:
            continue
        if isinstance(expected, bool) or not isinstance(expected, (int, np.integer)):
            raise InvalidInputError(f"unit {unit}: a generation must be an int, got {expected!r}")
        if expected and expected != entry.generation:
            raise StaleReadError(
                f"unit {unit}: key {entry.key!r} is generation {entry.generation}, "
                f"the reference expects generation {expected} (deleted and written again)")


def check_page(unit: str, after, limit) -> None:
    """A page of a key listing: ``after`` a str or None, ``limit`` an int >= 1 or None."""
    if after is not None and not isinstance(after, str):
        raise InvalidInputError(f"unit {unit}: after must be a str or None, got {after!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidInputError(f"unit {unit}: limit must be an int >= 1 or None, got {limit!r}")
