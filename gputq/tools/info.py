"""What ``gputq info`` reports: versions, transports, devices and the auto decision.

Everything here is a probe that may fail on some machine; each failure is
reported as data (``None``, an empty list, an ``error`` string), never
raised, so ``gputq info`` answers on a laptop without NIXL or a GPU as well
as on an InfiniBand node. Nothing heavy is imported (torch, CuPy and Ray
versions come from package metadata).
"""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata as metadata
import os
import platform
import shutil
import subprocess
from warnings import catch_warnings

from gputq.config import GputqConfig
from gputq.errors import ConfigError
from gputq.kernels.host_native import host_codec, host_codec_status
from gputq.transport.nixl import import_nixl
from gputq.transport.policy import (
    ENV_VAR,
    NIXL_DISTRIBUTIONS,
    choose_transport,
    gpudirect_support,
    infiniband_devices,
    load_nixl_api,
    local_hostname,
    nixl_fix,
    nixl_import_error,
)

__all__ = ["collect_info", "format_info"]

# Distribution names to report, first installed one wins per label.
_PACKAGES = {
    "gputq": ("gputq",),
    "nixl": NIXL_DISTRIBUTIONS,
    "torch": ("torch",),
    "cupy": ("cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x", "cupy"),
    "ray": ("ray",),
    "numpy": ("numpy",),
    "msgpack": ("msgpack",),
}
_PROBE_TIMEOUT_S = 10


def _version(dists: tuple[str, ...]) -> str:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown" if dists == ("gputq",) else "not installed"


def _run(cmd: list[str]) -> str | None:
    """stdout of ``cmd``, or ``None`` when it is missing, fails or hangs."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _nixl_libs_dir() -> str | None:
    """The directory of libraries bundled with the NIXL wheel (``nixl_cu12.libs``)."""
    try:
        api = load_nixl_api()
    except Exception:
        return None
    site = os.path.dirname(os.path.dirname(api.__file__))  # .../site-packages/nixl_cu12/_api.py
    dirs = sorted(glob.glob(os.path.join(site, "nixl_cu*.libs")))
    return dirs[0] if dirs else None


def _nixl_info() -> dict:
    error = nixl_import_error()
    info = {"available": error is None, "error": error, "plugins": [], "ucx_mem_types": [],
            "fix": None if error is None else nixl_fix(error)}
    if error is not None:
        return info
    try:
        nixl_agent, nixl_agent_config, _ = import_nixl()
        # No backend: listing plugins must not open UCX workers.
        agent = nixl_agent(f"gputq-info-{os.getpid()}", nixl_agent_config(
            enable_prog_thread=False, backends=[]))
        info["plugins"] = sorted(agent.get_plugin_list())
        if "UCX" in info["plugins"]:
            info["ucx_mem_types"] = list(agent.get_plugin_mem_types("UCX"))
    except Exception as exc:  # a broken plugin directory, no UCX, ...
        info["error"] = f"cannot create a NIXL agent: {type(exc).__name__}: {exc}"
    return info


def _ucx_info() -> dict:
    """UCX version and transports: the system ``ucx_info`` if present, and the NIXL wheel's bundle."""
    info: dict = {"system_ucx_info": shutil.which("ucx_info"), "system_version": None,
                  "system_transports": [], "bundled_version": None, "bundled_modules": []}
    version = _run(["ucx_info", "-v"])
    if version:
        info["system_version"] = version.strip().splitlines()[0].lstrip("# ").strip()
    devices = _run(["ucx_info", "-d"])
    if devices:
        info["system_transports"] = sorted({line.split(":", 1)[1].strip() for line in devices.splitlines()
                                            if line.strip().startswith("# Transport:")})
    libs = _nixl_libs_dir()
    if libs:
        ucp = sorted(glob.glob(os.path.join(libs, "libucp*.so*")))
        if ucp:
            try:
                lib = ctypes.CDLL(ucp[0])
                lib.ucp_get_version_string.restype = ctypes.c_char_p
                info["bundled_version"] = lib.ucp_get_version_string().decode()
            except (OSError, AttributeError):
                pass
        # tcp, self, posix and sysv are built into libuct; the rest are modules.
        modules = {os.path.basename(p)[len("libuct_"):].split(".")[0]
                   for p in glob.glob(os.path.join(libs, "ucx", "libuct_*.so*"))}
        info["bundled_modules"] = sorted(modules)
    return info


def _gpus() -> list[str]:
    listing = _run(["nvidia-smi", "-L"])
    if listing:
        return [line.strip() for line in listing.splitlines() if line.strip()]
    # Without nvidia-smi, the driver still lists its devices in procfs.
    return sorted(os.path.basename(p) for p in glob.glob("/proc/driver/nvidia/gpus/*"))


def _gpudirect(gpus: list[str]) -> dict:
    if not gpus:
        return {"possible": False, "reason": "no GPU"}
    possible, reason = gpudirect_support()
    return {"possible": possible, "reason": reason}


def collect_info() -> dict:
    """Probe this machine for everything that decides how gputq moves bytes.

    Returns
    -------
    dict
        JSON-able: ``versions``, ``nixl``, ``ucx``, ``infiniband``, ``gpus``,
        ``gpudirect``, ``transport`` (``requested``: what the config loaded
        here asks, ``auto`` unless YAML or ``GPUTQ_TRANSPORT`` says otherwise;
        ``env``: that variable as set; and what the request chooses for a
        same-host and a remote peer, and why), ``host_codec`` (packed IDs on
        the host: the C codec or numpy, and why) and ``warnings``.
    """
    ib = infiniband_devices()
    gpus = _gpus()
    warnings = []
    hostname = local_hostname()
    requested = _requested_transport(warnings)
    transport: dict = {"env": os.environ.get(ENV_VAR), "requested": requested}
    for label, peer in (("same_host", {"hostname": hostname}), ("remote", None)):
        if requested is None:
            transport[label] = {"choice": None, "reason": "the config does not load (see the warnings)"}
        else:
            choice, reason = choose_transport(requested, peer)
            transport[label] = {"choice": choice, "reason": reason}
    nixl = _nixl_info()
    if requested == "rdma" and not ib:
        warnings.append("the config requests transport rdma but there is no InfiniBand device: remote peers "
                        "will use UCX over tcp, slower than --transport tcp")
    if requested == "rdma" and not nixl["available"]:
        warnings.append("the config requests transport rdma but nixl does not import: rdma channels will fail")
    return {
        "hostname": hostname,
        "python": platform.python_version(),
        "versions": {label: _version(dists) for label, dists in _PACKAGES.items()},
        "nixl": nixl,
        "ucx": _ucx_info(),
        "infiniband": ib,
        "gpus": gpus,
        "gpudirect": _gpudirect(gpus),
        "transport": transport,
        "host_codec": _host_codec(),
        "warnings": warnings,
    }


def _host_codec() -> dict:
    """Whether packed expert IDs are packed and unpacked on the host by the C codec or numpy, and why."""
    return {"native": host_codec() is not None, "status": host_codec_status()}


def _requested_transport(warnings: list) -> str | None:
    """The transport the config of this environment requests, or None (the reason added to ``warnings``).

    Read as every gputq process reads it, :meth:`GputqConfig.load` (defaults
    < ``GPUTQ_CONFIG`` YAML < ``GPUTQ_TRANSPORT``), so what this reports is
    what a job started here without a ``--transport`` flag would use.
    """
    with catch_warnings(record=True) as caught:  # an unknown GPUTQ_* variable is reported, not printed
        try:
            requested = GputqConfig.load(env=os.environ).transport
        except ConfigError as exc:
            requested = None
            warnings.append(str(exc))
    warnings.extend(str(w.message) for w in caught)
    return requested


def format_info(info: dict) -> str:
    """Render :func:`collect_info`'s result as text for people."""
    lines = [f"gputq {info['versions']['gputq']} on {info['hostname']} (python {info['python']})", "versions:"]
    lines += [f"  {name}: {ver}" for name, ver in info["versions"].items() if name != "gputq"]
    nixl = info["nixl"]
    if nixl["available"] and not nixl["error"]:
        lines.append(f"nixl: plugins {', '.join(nixl['plugins']) or '(none)'}; "
                     f"UCX memory types {', '.join(nixl['ucx_mem_types']) or '(none)'}")
    else:
        lines.append(f"nixl: unavailable ({nixl['error']})")
        if nixl.get("fix"):
            lines.append(f"  fix: {nixl['fix']}")
    ucx = info["ucx"]
    lines.append(f"ucx (bundled with nixl): {ucx['bundled_version'] or 'not found'}; "
                 f"modules {', '.join(ucx['bundled_modules']) or '(none)'} + built-in tcp, self, posix, sysv")
    if ucx["system_ucx_info"]:
        lines.append(f"ucx (system, {ucx['system_ucx_info']}): {ucx['system_version']}; "
                     f"transports {', '.join(ucx['system_transports']) or '(none)'}")
    else:
        lines.append("ucx (system): ucx_info not found")
    lines.append(f"infiniband: {', '.join(info['infiniband']) or 'none'}")
    lines.append(f"gpus: {'; '.join(info['gpus']) or 'none'}")
    gd = info["gpudirect"]
    lines.append(f"gpudirect rdma: {'possible' if gd['possible'] else 'no'} ({gd['reason']})")
    tr = info["transport"]
    lines.append(f"transport {tr['requested'] or '(config error)'} as configured "
                 f"({ENV_VAR}={tr['env'] or 'unset'}; a --transport flag wins over it):")
    for label in ("same_host", "remote"):
        lines.append(f"  {label.replace('_', '-')} peer: {tr[label]['choice']} - {tr[label]['reason']}")
    codec = info["host_codec"]
    lines.append(f"packed expert IDs on the host: {'C codec' if codec['native'] else 'numpy'} ({codec['status']})")
    lines += [f"warning: {w}" for w in info["warnings"]]
    return "\n".join(lines)
