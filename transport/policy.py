"""Which backend a channel uses: the ``--transport auto|rdma|tcp`` decision.

``auto`` picks ``rdma`` (NIXL) only where NIXL has a lane faster than the tcp
backend, and ``tcp`` otherwise. The lanes and the figures behind the rule,
measured on a 2-core loopback with ``python -m bench.transport``
(docs/operations.md has the table):

- same host: UCX reads by cross-memory attach (cma): 6-20 GB/s, above a plain
  socket (2-6 GB/s) => rdma;
- InfiniBand on both sides: one-sided RDMA READ, no CPU copy => rdma;
- remote peer without InfiniBand: UCX falls back to its tcp lane, which
  emulates READ in software at ~1-1.5 GB/s, below the tcp backend => tcp.

``GPUTQ_TRANSPORT`` (``auto``, ``rdma`` or ``tcp``) overrides the requested
value, so an operator can force a backend without touching the job's flags.
"""

from __future__ import annotations

import functools
import os
import socket

from transport.errors import InvalidInputError

__all__ = [
    "TRANSPORT_NAMES",
    "ENV_VAR",
    "choose_transport",
    "nixl_import_error",
    "infiniband_devices",
    "local_hostname",
    "is_same_host",
]

TRANSPORT_NAMES = ("auto", "rdma", "tcp")
ENV_VAR = "GPUTQ_TRANSPORT"
_IB_SYSFS = "/sys/class/infiniband"


@functools.lru_cache(maxsize=1)
def nixl_import_error() -> str | None:
    """Why ``nixl`` cannot be used here, or ``None`` when it imports.

    Cached: importing NIXL loads native plugins once per process.
    """
    try:
        import nixl._api  # noqa: F401  (the import is the probe)
    except Exception as exc:  # ImportError, or a broken native library (OSError)
        return f"{type(exc).__name__}: {exc}"
    return None


def infiniband_devices() -> list[str]:
    """Names of the InfiniBand/RoCE devices of this host (``mlx5_0``, ...)."""
    try:
        return sorted(os.listdir(_IB_SYSFS))
    except OSError:
        return []


def local_hostname() -> str:
    """This host's name, as servers publish it in their address."""
    return socket.gethostname()


def is_same_host(peer_address: dict | None) -> bool:
    """True when ``peer_address`` names this host (``hostname`` key)."""
    return bool(peer_address) and peer_address.get("hostname") == local_hostname()


def _requested(requested: str) -> tuple[str, str]:
    override = os.environ.get(ENV_VAR, "").strip().lower()
    if override:
        if override not in TRANSPORT_NAMES:
            raise InvalidInputError(
                f"{ENV_VAR}={override!r} is not one of {', '.join(TRANSPORT_NAMES)}")
        return override, f"{ENV_VAR}={override}"
    name = (requested or "auto").strip().lower()
    if name not in TRANSPORT_NAMES:
        raise InvalidInputError(
            f"transport {requested!r} is not one of {', '.join(TRANSPORT_NAMES)}")
    return name, f"requested {name}"


def choose_transport(requested: str = "auto", peer_address: dict | None = None) -> tuple[str, str]:
    """Decide the backend for a channel to ``peer_address``.

    Parameters
    ----------
    requested : str
        ``"auto"``, ``"rdma"`` or ``"tcp"``; ``GPUTQ_TRANSPORT`` overrides it.
    peer_address : dict or None
        The unit's published address. Its ``hostname`` tells whether the peer
        shares this host; its ``ib_devices`` (when present) whether the peer
        has InfiniBand. ``None`` means a peer on another host, capabilities
        unknown.

    Returns
    -------
    (str, str)
        The backend name (``"rdma"`` or ``"tcp"``) and a one-line reason.

    Raises
    ------
    InvalidInputError
        For a name other than auto/rdma/tcp.
    """
    name, source = _requested(requested)
    if name != "auto":
        return name, f"{source} explicitly"
    missing = nixl_import_error()
    if missing is not None:
        return "tcp", f"auto: nixl does not import ({missing}); pip install nixl-cu12 for rdma"
    if is_same_host(peer_address):
        return "rdma", "auto: peer on the same host, NIXL reads by cross-memory attach (cma)"
    local_ib = infiniband_devices()
    if not local_ib:
        return "tcp", ("auto: remote peer and no InfiniBand device here; NIXL would use "
                       "UCX tcp, slower than the tcp backend")
    if peer_address is not None and "ib_devices" in peer_address and not peer_address["ib_devices"]:
        return "tcp", "auto: the peer has no InfiniBand device; NIXL would use UCX tcp"
    return "rdma", f"auto: InfiniBand devices present ({', '.join(local_ib)})"
