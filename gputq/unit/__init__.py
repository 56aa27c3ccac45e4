"""The StorageUnit: one arena of pinned host memory, its allocator, key table and leases.

A unit is plain Python (the Ray actor in :mod:`gputq.cluster.deploy` wraps
it). It serves :mod:`gputq.transport` servers as their arena handler and
imports nothing above :mod:`gputq.transport` and :mod:`gputq.errors`.
"""

__all__: list[str] = []
