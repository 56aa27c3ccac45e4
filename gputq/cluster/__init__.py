"""The cluster: Ray names, the controller, the Ray deployment and the metrics exporter.

Membership, placement of units on nodes, partitions and lifecycle; never
on the per-byte path. Ray is imported lazily, through
:func:`gputq.cluster.names.import_ray`.
"""

__all__: list[str] = []
