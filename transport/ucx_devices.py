"""Which network devices a unit's UCX (inside its NIXL agent) may use: the configured address's only.

UCX opens a listening tcp socket on every network interface it is allowed
to use (its tcp lane, for connection wire-up and software READ/WRITE). Left
to its defaults it uses all of them, so a unit told to bind ``127.0.0.1``
would still answer on the host's external address. :func:`ucx_bound_to`
restricts UCX, for the one agent created inside it, to the interface that
holds the unit's bind address plus this host's InfiniBand ports (which
listen on no IP socket). It sets ``UCX_NET_DEVICES`` only when the user has
not: a value already in the environment is the operator's choice and wins.

UCX reads its environment when a context is created, so setting the
variable around the agent's creation is enough; it is restored afterwards,
so that other agents of the process (a reader's) keep the user's setting.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
import threading

from gputq.transport.policy import infiniband_devices

__all__ = ["NET_DEVICES_VAR", "interface_of", "unit_net_devices", "ucx_bound_to"]

#: UCX's variable naming the network devices it may use (``lo``, ``eth0``, ``mlx5_0:1``).
NET_DEVICES_VAR = "UCX_NET_DEVICES"
_IB_SYSFS = "/sys/class/infiniband"
_SIOCGIFCONF = 0x8912
_IFREQ = struct.Struct("16s16s8x")  # ifr_name, then ifr_addr (struct sockaddr_in) in a 24-byte union
_MAX_ADDRESSES = 1024
_LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
_env_lock = threading.Lock()


def _ipv4_addresses() -> dict[str, str]:
    """Every IPv4 address of this host's interfaces -> the interface (aliases ``eth0:1`` -> ``eth0``)."""
    buf = array.array("B", bytes(_IFREQ.size * _MAX_ADDRESSES))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        # struct ifconf {int ifc_len; char *ifc_buf;}: the kernel fills buf and sets the length used.
        ifconf = struct.pack("iL", len(buf), buf.buffer_info()[0])
        length = struct.unpack("iL", fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, ifconf))[0]
    found = {}
    for start in range(0, length, _IFREQ.size):
        name, addr = _IFREQ.unpack_from(buf, start)
        if struct.unpack_from("H", addr)[0] == socket.AF_INET:
            found[socket.inet_ntoa(addr[4:8])] = name.split(b"\0", 1)[0].decode().split(":", 1)[0]
    return found


def interface_of(host: str) -> str | None:
    """The interface holding IPv4 address ``host``; ``None`` for a wildcard, IPv6 or an address not found.

    ``host`` may be a name; it is resolved as the tcp server resolves it.
    """
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if address.is_unspecified:
        return None  # every interface, on purpose
    if address in _LOOPBACK:
        return "lo"  # the whole of 127/8 is lo's, though only 127.0.0.1 is listed
    return _ipv4_addresses().get(str(address))


def _infiniband_ports() -> list[str]:
    ports = []
    for device in infiniband_devices():
        try:
            ports += [f"{device}:{port}" for port in sorted(os.listdir(f"{_IB_SYSFS}/{device}/ports"))]
        except OSError:
            continue
    return ports


def unit_net_devices(host: str) -> str | None:
    """The ``UCX_NET_DEVICES`` value for a unit bound to ``host``; ``None`` when it cannot be narrowed."""
    interface = interface_of(host)
    if interface is None:
        return None
    return ",".join([interface, *_infiniband_ports()])


@contextlib.contextmanager
def ucx_bound_to(host: str):
    """Within the block, UCX contexts use only the devices of :func:`unit_net_devices` of ``host``.

    Does nothing when ``UCX_NET_DEVICES`` is already set or ``host`` cannot
    be narrowed to one interface (a wildcard address: every interface, as
    asked). Yields the value in force (``None``: UCX's own default).
    """
    with _env_lock:
        if NET_DEVICES_VAR in os.environ:
            yield os.environ[NET_DEVICES_VAR]
            return
        devices = unit_net_devices(host)
        if devices is None:
            yield None
            return
        os.environ[NET_DEVICES_VAR] = devices
        try:
            yield devices
        finally:
            os.environ.pop(NET_DEVICES_VAR, None)
