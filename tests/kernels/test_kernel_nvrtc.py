"""The CUDA source compiled by NVRTC, as CuPy compiles it on a GPU host, checked without a GPU.

NVRTC needs no driver: given the backend's own options and a target
architecture it builds PTX and, through ptxas, machine code. That pins what
a GPU run depends on before one is lent: the source compiles for the GPUs
gputq targets (A100 and H100/H200), every kernel the backend launches is
there, each moves its source in 16-byte loads whatever the element size
(uint8 and uint16 included), and nothing spills to local memory (a spill
would put a round trip to memory inside the copy loop). What the kernels
compute is checked on the CPU by ``test_kernel_on_host`` and on the GPU by
``test_gpu_kernel``.

NVRTC comes from the ``nvidia-cuda-nvrtc-cu12`` wheel (the ``dev`` extra on
Linux x86-64) or a system CUDA; without either the tests skip.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from gputq.kernels.cupy_backend import (
    _KERNELS,
    _SOURCE,
    DEFAULT_STEPS,
    UNPACK_KERNEL,
    UNPACK_SOURCE,
    compile_options,
    unpack_compile_options,
)

pytestmark = pytest.mark.timeout(120)

_ARCHS = ("sm_80", "sm_90")  # A100; H100 and H200
_STEPS = (2, DEFAULT_STEPS)  # the default, and the fewer groups per thread a GPU check also times


def _libnvrtc_path() -> str | None:
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        wheel = sorted(Path(next(iter(spec.submodule_search_locations)), "lib").glob("libnvrtc.so*"))
        if wheel:
            return str(wheel[0])
    return ctypes.util.find_library("nvrtc")


def _text(lib, prog, size_fn, get_fn) -> str:
    size = ctypes.c_size_t()
    size_fn(prog, ctypes.byref(size))
    buffer = ctypes.create_string_buffer(size.value)
    get_fn(prog, buffer)
    return buffer.value.decode()


@dataclass(frozen=True)
class _Build:
    arch: str
    steps: int
    result: int  # NVRTC's status: 0 is success
    log: str  # the compiler's and ptxas's messages
    ptx: str

    def __str__(self) -> str:
        return f"{self.arch}, {self.steps} groups/thread"


def _compile(lib, arch: str, steps: int, source: Path = _SOURCE, options: tuple = ()) -> _Build:
    """A kernel source (by default the widen kernel's, under the backend's options for ``steps``) for ``arch``."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.read_bytes(), source.name.encode(), 0,
                                  None, None) == 0
    try:
        options = [*(o.encode() for o in (options or compile_options(steps))),
                   f"--gpu-architecture={arch}".encode(), b"--ptxas-options=-v"]
        result = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        log = _text(lib, prog, lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog)
        ptx = _text(lib, prog, lib.nvrtcGetPTXSize, lib.nvrtcGetPTX) if result == 0 else ""
        return _Build(arch, steps, result, log, ptx)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc():
    path = _libnvrtc_path()
    if path is None:
        pytest.skip("no NVRTC here: pip install nvidia-cuda-nvrtc-cu12 (in the dev extra on Linux x86-64)")
    lib = ctypes.CDLL(path)
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    print(f"\nNVRTC {major.value}.{minor.value} ({path})")
    return lib


@pytest.fixture(scope="module", params=[(arch, steps) for arch in _ARCHS for steps in _STEPS],
                ids=lambda param: f"{param[0]}-steps{param[1]}")
def build(request) -> _Build:
    return _compile(_nvrtc(), *request.param)


def _entries(ptx: str) -> dict[str, str]:
    """Each kernel's PTX body by name."""
    parts = re.split(r"(?=\.visible \.entry )", ptx)[1:]
    return {re.match(r"\.visible \.entry (\w+)", part).group(1): part for part in parts}


def test_the_source_compiles_without_warnings(build):
    assert build.result == 0, f"NVRTC failed for {build}:\n{build.log}"
    assert "warning" not in build.log.lower(), build.log


def test_every_kernel_the_backend_launches_is_built(build):
    assert set(_entries(build.ptx)) == set(_KERNELS.values())


@pytest.mark.parametrize("dtype", sorted(_KERNELS))
def test_each_kernel_loads_16_bytes_per_group_whatever_the_element_size(build, dtype):
    body = _entries(build.ptx)[_KERNELS[dtype]]
    # One 16-byte load per group on the aligned path, all issued before the stores.
    assert len(re.findall(r"ld\.global\.nc\.v4\.\w+", body)) == build.steps
    assert re.search(r"st\.global\.v4\.\w+", body)


def test_nothing_spills_to_local_memory(build):
    assert ".local" not in build.ptx
    reports = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", build.log)
    assert len(reports) == len(_KERNELS), f"ptxas reported {len(reports)} kernels for {build}:\n{build.log}"
    assert all(report == ("0", "0", "0") for report in reports), build.log
    # Registers bound the blocks an SM holds (occupancy); -s shows them for the performance notes.
    for name, registers in re.findall(r"entry function '(\w+)' for '\w+'\n(?:.*\n)*?.*Used (\d+) registers",
                                      build.log):
        print(f"{build} {name}: {registers} registers, no spills")


@pytest.mark.parametrize("arch", _ARCHS)
def test_the_unpack_kernel_compiles_clean_and_spills_nothing(arch):
    build = _compile(_nvrtc(), arch, 0, UNPACK_SOURCE, unpack_compile_options())
    assert build.result == 0 and "warning" not in build.log.lower(), build.log
    assert set(_entries(build.ptx)) == {UNPACK_KERNEL}
    assert ".local" not in build.ptx
    assert re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      build.log) == [("0", "0", "0")], build.log
