"""The one CUDA probe of gputq, and the few CUDA runtime calls built on it.

Whether this process can run CUDA work is asked in many places (the arena
pins itself, the tcp staging ring copies to the device, the rdma pool
page-locks its buffers, the kernels launch, the shm backend registers a
mapping). They all ask here, and the answer is computed once per process:
probing imports CuPy or torch, which costs up to seconds.

CuPy is preferred (the kernels and the zero-copy paths need it); torch is
asked only where CuPy cannot run (not installed, or built for another CUDA)
and a GPU driver's device file exists (:data:`DRIVER_FILES`).
Nothing is imported until a probe runs; without either library every probe
is a quiet ``False``/``None``.

Host registration flags and device attributes are the CUDA runtime's values
(``cuda_runtime_api.h``), so the calls below work through CuPy's runtime
binding or torch's ``cudart()`` alike. :func:`host_register` is gputq's one
``cudaHostRegister``: the arena, the rdma pool and the shm mapping all
page-lock through it (or :func:`page_lock`), so a refusal is always a
:class:`~gputq.errors.GputqError` carrying CUDA's reason.
"""

from __future__ import annotations

import functools
import os
import warnings

from gputq.errors import GputqError, MissingDependencyError

__all__ = [
    "HOST_REGISTER_DEFAULT",
    "HOST_REGISTER_PORTABLE",
    "HOST_REGISTER_MAPPED",
    "HOST_REGISTER_READ_ONLY",
    "usable_cupy",
    "usable_torch",
    "DRIVER_FILES",
    "cuda_available",
    "require_cupy",
    "host_register",
    "host_unregister",
    "page_lock",
    "read_only_register_supported",
    "mapped_device_pointer",
]

#: cudaHostRegisterDefault: pinned for the current CUDA context only.
HOST_REGISTER_DEFAULT = 0x00
#: cudaHostRegisterPortable: pinned for every CUDA context, not just the current one.
HOST_REGISTER_PORTABLE = 0x01
#: cudaHostRegisterMapped: kernels may read the range through a device pointer.
HOST_REGISTER_MAPPED = 0x02
#: cudaHostRegisterReadOnly: pin pages the process may only read (a PROT_READ mapping).
HOST_REGISTER_READ_ONLY = 0x08
# cudaDevAttrHostRegisterReadOnlySupported
_ATTR_HOST_REGISTER_READ_ONLY = 113


@functools.lru_cache(maxsize=1)
def usable_cupy():
    """CuPy when it imports and sees at least one CUDA device, else ``None``.

    Quiet where CuPy is installed without a driver or device (CuPy warns
    about a missing CUDA path on import; that is silenced too).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import cupy
    except Exception:  # not installed, or a broken install: torch may still work
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # CUDARuntimeError without a driver: the final answer
        pass
    return None


#: Device files one of which every CUDA-capable Linux host has: the NVIDIA driver's control device
#: (bare metal, containers, gVisor), WSL2's GPU paravirtualisation, ROCm's (torch.cuda runs on HIP).
DRIVER_FILES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def _driver_present() -> bool:
    return any(os.path.exists(path) for path in DRIVER_FILES)


@functools.lru_cache(maxsize=1)
def usable_torch():
    """torch when CuPy cannot run and torch sees a CUDA device, else ``None``.

    torch is not even imported on a host with none of :data:`DRIVER_FILES`:
    its import costs up to seconds of CPU, and memory, in every process that
    asks (a unit's arena asks as it starts), for an answer known already.
    """
    if usable_cupy() is not None or not _driver_present():
        return None
    try:
        import torch
    except Exception:
        return None
    try:
        return torch if torch.cuda.is_available() else None
    except Exception:  # a broken CUDA setup means "not usable"
        return None


def cuda_available() -> bool:
    """True when CuPy (or, without CuPy, torch) can run CUDA work here. Cached."""
    return usable_cupy() is not None or usable_torch() is not None


def require_cupy(what: str):
    """CuPy with a device, or :class:`MissingDependencyError` saying ``what`` needs it."""
    cupy = usable_cupy()
    if cupy is None:
        raise MissingDependencyError(
            f"{what} needs CuPy with a CUDA device: pip install cupy-cuda12x (or cupy-cuda13x)")
    return cupy


def host_register(ptr: int, nbytes: int, flags: int, *, hint: str = "") -> None:
    """``cudaHostRegister(ptr, nbytes, flags)`` through CuPy, else torch.

    Parameters
    ----------
    ptr, nbytes : int
        The host range to page-lock.
    flags : int
        ``HOST_REGISTER_*`` values, or-ed.
    hint : str, optional
        What the caller can do about a refusal; appended to the error's message.

    Raises
    ------
    MissingDependencyError
        No usable CUDA here.
    GputqError
        The runtime refused (the message carries CUDA's reason and ``hint``).
    """
    what = f"cudaHostRegister of {nbytes} bytes (flags {flags:#x}) failed"
    tail = f"; {hint}" if hint else ""
    cupy = usable_cupy()
    if cupy is not None:
        rt = cupy.cuda.runtime
        try:
            rt.hostRegister(int(ptr), int(nbytes), int(flags))
        except rt.CUDARuntimeError as exc:
            raise GputqError(f"{what}: {exc}{tail}") from exc
        return
    torch = usable_torch()
    if torch is None:
        raise MissingDependencyError("page-locking host memory needs CUDA through CuPy or torch")
    err = int(torch.cuda.cudart().cudaHostRegister(int(ptr), int(nbytes), int(flags)))
    if err:
        raise GputqError(f"{what}: CUDA error {err}{tail}")


def host_unregister(ptr: int) -> None:
    """``cudaHostUnregister(ptr)``; errors are raised as :class:`GputqError`.

    Without usable CUDA nothing can have been registered: a no-op.
    """
    cupy = usable_cupy()
    if cupy is not None:
        rt = cupy.cuda.runtime
        try:
            rt.hostUnregister(int(ptr))
        except rt.CUDARuntimeError as exc:
            raise GputqError(f"cudaHostUnregister failed: {exc}") from exc
        return
    torch = usable_torch()
    if torch is not None:
        err = int(torch.cuda.cudart().cudaHostUnregister(int(ptr)))
        if err:
            raise GputqError(f"cudaHostUnregister failed: CUDA error {err}")


def page_lock(ptr: int, nbytes: int, flags: int = HOST_REGISTER_PORTABLE, *, hint: str = "") -> bool:
    """:func:`host_register` where CUDA is usable; without it, nothing and ``False``.

    Pageable memory is a normal configuration (tcp transport, CPU hosts),
    so only "CUDA is not usable here" is quiet: a registration refused by a
    working CUDA raises. Undo a ``True`` with :func:`host_unregister`.

    Returns
    -------
    bool
        True when ``[ptr, ptr + nbytes)`` is now page-locked.

    Raises
    ------
    GputqError
        The runtime refused (the message carries CUDA's reason and ``hint``).
    """
    if not cuda_available():
        return False
    host_register(ptr, nbytes, flags, hint=hint)
    return True


@functools.lru_cache(maxsize=None)
def read_only_register_supported(device: int = 0) -> bool:
    """Whether ``device`` accepts :data:`HOST_REGISTER_READ_ONLY` (CUDA 11.1+ drivers).

    Without CuPy (no attribute query through torch) the answer is True and
    the registration itself decides.
    """
    cupy = usable_cupy()
    if cupy is None:
        return usable_torch() is not None
    try:
        return bool(cupy.cuda.runtime.deviceGetAttribute(_ATTR_HOST_REGISTER_READ_ONLY, int(device)))
    except Exception:  # an older runtime without the attribute
        return False


def mapped_device_pointer(ptr: int) -> int:
    """The device address of registered, mapped host memory at ``ptr``.

    With unified addressing (every 64-bit platform CUDA supports today) it
    is usually ``ptr`` itself; the runtime says which.
    """
    cupy = require_cupy("reading host memory from a kernel")
    attrs = cupy.cuda.runtime.pointerGetAttributes(int(ptr))
    device_ptr = int(attrs.devicePointer)
    if not device_ptr:
        raise GputqError(f"host address {ptr:#x} is not registered as mapped memory")
    return device_ptr
