"""Which backend a channel uses: the ``--transport auto|shm|rdma|tcp`` decision.

``auto`` picks the fastest lane the peer and this host share. The lanes
(``python -m bench.transport`` and ``python -m bench.fetch`` measure them;
docs/PERFORMANCE.md has the figures):

- same host: the reader maps the unit's arena file read-only and copies
  from it (``shm``): one memcpy, faster than NIXL's cross-memory attach
  (cma) and than the tcp backend's socket => shm. Where the file
  cannot be mapped (another container's /dev/shm, permissions) the shm
  channel reads over rdma (cma) or the unit's tcp lane and says why;
- InfiniBand on this host (and on the peer, when its address says): one-sided
  RDMA READ with no CPU copy => rdma;
- remote peer without InfiniBand: UCX falls back to its tcp lane, which
  emulates READ in software, slower than the tcp backend => tcp.

What is requested comes from the caller, read once by the config
(:class:`gputq.config.GputqConfig`): dataclass default ``auto`` < YAML
``transport:`` < ``GPUTQ_TRANSPORT`` < the ``--transport`` flag. This module
reads no environment variable: a flag the job was started with wins over
the variable, as everywhere else in the config.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as metadata
import mmap
import os
import socket

from gputq.errors import InvalidInputError

__all__ = [
    "TRANSPORT_NAMES",
    "ENV_VAR",
    "choose_transport",
    "nixl_import_error",
    "nixl_fix",
    "NIXL_DISTRIBUTIONS",
    "load_nixl_api",
    "NIXL_API_MODULES",
    "infiniband_devices",
    "local_hostname",
    "is_same_host",
    "shm_supported",
    "gpudirect_support",
]

TRANSPORT_NAMES = ("auto", "shm", "rdma", "tcp")
#: The variable that sets the config's ``transport`` (``GPUTQ_<FIELD>``); the config reads it, not this module.
ENV_VAR = "GPUTQ_TRANSPORT"
_IB_SYSFS = "/sys/class/infiniband"


#: Modules that provide NIXL's Python API, in order of preference. The
#: ``nixl`` meta package only re-exports one of the ``nixl_cuXX`` wheels, and
#: installing it pulls a CUDA build of torch; ``pip install 'gputq[rdma]'``
#: installs ``nixl-cu12`` alone, so its module is tried directly too.
NIXL_API_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
#: The distributions that install NIXL, as pip names them.
NIXL_DISTRIBUTIONS = ("nixl-cu12", "nixl-cu13", "nixl")


def load_nixl_api():
    """Import NIXL's Python API from whichever wheel is installed.

    Raises
    ------
    ImportError or OSError
        From the last candidate when none imports (the reason to report).
    """
    error: Exception | None = None
    for name in NIXL_API_MODULES:
        try:
            return importlib.import_module(name)
        except Exception as exc:  # ImportError, or a broken native library (OSError)
            if error is None or not isinstance(exc, ModuleNotFoundError):
                error = exc  # keep the most telling failure: a broken library beats "not installed"
    raise error


@functools.lru_cache(maxsize=1)
def nixl_import_error() -> str | None:
    """Why NIXL cannot be used here, or ``None`` when its API imports.

    Cached: importing NIXL loads native plugins once per process.
    """
    try:
        load_nixl_api()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def nixl_fix(error: str) -> str:
    """What fixes a NIXL that does not import: installing it, or repairing the installed wheel."""
    installed = [f"{dist} {metadata.version(dist)}" for dist in NIXL_DISTRIBUTIONS if _installed(dist)]
    if not installed:
        return "pip install 'gputq[rdma]' (installs nixl-cu12; CUDA 13 hosts: pip install nixl-cu13)"
    return (f"{', '.join(installed)} is installed but does not load ({error}); reinstall it with "
            f"pip install --force-reinstall 'gputq[rdma]' and check its bundled libraries with gputq info")


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


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


def shm_supported() -> bool:
    """Whether this process can map another process's arena file (POSIX shared mappings)."""
    return os.name == "posix" and hasattr(mmap, "MAP_SHARED")


def _requested(requested: str) -> str:
    name = (requested or "auto").strip().lower()
    if name not in TRANSPORT_NAMES:
        raise InvalidInputError(
            f"transport {requested!r} is not one of {', '.join(TRANSPORT_NAMES)}")
    return name


def choose_transport(requested: str = "auto", peer_address: dict | None = None) -> tuple[str, str]:
    """Decide the backend for a channel to ``peer_address``.

    Parameters
    ----------
    requested : str
        ``"auto"``, ``"shm"``, ``"rdma"`` or ``"tcp"``: what the caller asks,
        usually its config's ``transport`` (where ``GPUTQ_TRANSPORT`` sits
        below the ``--transport`` flag). Taken as given: no variable
        overrides it here.
    peer_address : dict or None
        The unit's published address. Its ``hostname`` tells whether the peer
        shares this host; its ``ib_devices`` (when present) whether the peer
        has InfiniBand. ``None`` means a peer on another host, capabilities
        unknown.

    Returns
    -------
    (str, str)
        The backend name (``"shm"``, ``"rdma"`` or ``"tcp"``) and a one-line
        reason.

    Raises
    ------
    InvalidInputError
        For a name other than auto/shm/rdma/tcp.
    """
    name = _requested(requested)
    if name != "auto":
        return name, f"requested {name} explicitly"
    if is_same_host(peer_address) and shm_supported():
        return "shm", ("auto: peer on the same host, reads copy from its arena file mapped read-only "
                       "(rdma or tcp reads where the file cannot be mapped)")
    missing = nixl_import_error()
    if missing is not None:
        return "tcp", f"auto: nixl does not import ({missing}); pip install 'gputq[rdma]' for rdma"
    if is_same_host(peer_address):
        return "rdma", "auto: peer on the same host, NIXL reads by cross-memory attach (cma)"
    local_ib = infiniband_devices()
    if not local_ib:
        return "tcp", ("auto: remote peer and no InfiniBand device here; NIXL would use "
                       "UCX tcp, slower than the tcp backend")
    if peer_address is not None and "ib_devices" in peer_address and not peer_address["ib_devices"]:
        return "tcp", "auto: the peer has no InfiniBand device; NIXL would use UCX tcp"
    return "rdma", f"auto: InfiniBand devices present ({', '.join(local_ib)})"


def gpudirect_support() -> tuple[bool, str]:
    """Whether a NIC here can DMA into GPU memory (GPUDirect RDMA), and why.

    Needs an InfiniBand/RoCE device and either the ``nvidia_peermem`` module
    or the open GPU kernel module (dma-buf). Without it UCX still accepts GPU
    destinations but stages them in software, slower than a host READ plus
    a host-to-device copy (docs/gpu/), so the rdma backend then reads into
    host memory and copies.
    """
    ib = infiniband_devices()
    if not ib:
        return False, "no InfiniBand/RoCE device"
    try:
        with open("/proc/modules", encoding="ascii", errors="replace") as f:
            modules = {line.split()[0] for line in f if line.strip()}
    except OSError:
        modules = set()
    if modules & {"nvidia_peermem", "nv_peer_mem"}:
        return True, "nvidia_peermem is loaded"
    try:
        with open("/proc/driver/nvidia/version", encoding="ascii", errors="replace") as f:
            if "Open Kernel Module" in f.read():  # its version line says so
                return True, "dma-buf: the open GPU kernel module is loaded (no nvidia_peermem)"
    except OSError:
        pass
    return False, "neither nvidia_peermem nor the open GPU kernel module (dma-buf) is loaded"
