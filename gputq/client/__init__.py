"""The client side: channels to units, fan-out, the writer, the reader and key lifetimes.

Everything a rollout worker or a trainer rank runs to put, read and release
stored fields. Imports the data model, the configuration and the transports;
never the cluster, the integrations or the tools.
"""

__all__: list[str] = []
