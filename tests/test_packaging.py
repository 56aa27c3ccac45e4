"""The gputq wheel as it installs: only ``gputq/...``, beside PyPI's own ``kernels`` package.

The repository keeps ``transport/`` and ``kernels/`` at its top, and setup.py
installs them as ``gputq.transport`` and ``gputq.kernels`` only. A wheel
that put a top-level ``kernels`` on sys.path would shadow (or be shadowed
by) the Hugging Face ``kernels`` package from PyPI, so this test builds the
wheel, installs it into a fresh venv next to that package and imports both.

The wheel is built from a copy of the working tree (no ``build/``, no
egg-info, no venv): an in-tree build would write into the checkout, and
setuptools' ``build/lib`` keeps files deleted from the source, which would
then ship. pip's cache is reused, so a warm cache makes this about half a
minute; it is skipped, saying why, when pip cannot reach the package index.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(900)

#: What the copy of the tree leaves out: build outputs, caches, the venv, git.
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__",
                                     ".pytest_cache", ".hypothesis", "out", ".whl", "*.pyc")

#: Fragments of pip's output that mean the package index could not be reached.
_UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
                "Name or service not known", "Network is unreachable", "No route to host", "Connection refused",
                "ConnectTimeoutError", "ReadTimeoutError", "Read timed out", "ProxyError", "connection broken by",
                "Max retries exceeded")

#: Run in the fresh venv with ``-I`` (no cwd, no PYTHONPATH, no user site): what is importable there
#: is what the wheels installed.
_PROBE = textwrap.dedent("""
    import importlib.metadata, importlib.resources, importlib.util, json, sys, sysconfig
    import kernels
    import gputq.kernels, gputq.transport
    from gputq.kernels import widen_scatter
    cu = importlib.resources.files("gputq.kernels").joinpath("widen_scatter.cu")
    print(json.dumps({
        "site": sysconfig.get_paths()["purelib"],
        "platsite": sysconfig.get_paths()["platlib"],
        "kernels_file": kernels.__file__,
        "kernels_dist": importlib.metadata.distribution("kernels").metadata["Name"],
        "kernels_version": importlib.metadata.version("kernels"),
        "kernels_has_get_kernel": hasattr(kernels, "get_kernel"),
        "kernels_has_widen_scatter": hasattr(kernels, "widen_scatter"),
        "gputq_kernels_file": gputq.kernels.__file__,
        "gputq_transport_file": gputq.transport.__file__,
        "widen_scatter_callable": callable(widen_scatter),
        "cu_is_file": cu.is_file(),
        "cu_has_kernel": cu.is_file() and "widen_scatter_u8_i32" in cu.read_text(),
        "top_level_transport": importlib.util.find_spec("transport") is not None,
        "gputq_files": sorted(str(f) for f in importlib.metadata.files("gputq")),
    }))
""")


def _run(cmd, *, env=None, cwd=None, timeout=600):
    return subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, capture_output=True, text=True)


def _pip_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_NO_CACHE_DIR", "PIP_REQUIRE_VIRTUALENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _builds_wheels() -> bool:
    """Whether this venv's setuptools builds a wheel without build isolation: it has ``bdist_wheel`` from
    70.1 on, older ones with the ``wheel`` package."""
    try:
        major, minor = (int(part) for part in importlib.metadata.version("setuptools").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    if (major, minor) >= (70, 1):
        return True
    try:
        return bool(importlib.metadata.version("wheel"))
    except importlib.metadata.PackageNotFoundError:
        return False


def test_wheel_installs_gputq_only_beside_pypi_kernels(tmp_path):
    if not _builds_wheels():
        pytest.skip("this venv's setuptools builds no wheel (below 70.1 and no 'wheel' package); make test's has")
    started = time.monotonic()
    env = _pip_env()

    # 1. The wheel, from a copy of the tree, with the running venv's pip and setuptools.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    wheels = tmp_path / "wheels"
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                  "-w", str(wheels), str(src)], env=env, cwd=tmp_path)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("gputq-*.whl")

    # 2. What the wheel holds: gputq/... and its dist-info, nothing else.
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (record_name,) = [n for n in names if n.endswith(".dist-info/RECORD")]
        record = [line.split(",")[0] for line in zf.read(record_name).decode().splitlines() if line]
        (top_level_name,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        top_level = zf.read(top_level_name).decode().split()
    dist_info = record_name.split("/")[0]
    assert sorted(record) == sorted(names)
    tops = {n.split("/")[0] for n in names}
    assert tops == {"gputq", dist_info}, f"unexpected top-level entries: {sorted(tops - {'gputq', dist_info})}"
    assert top_level == ["gputq"]
    assert {"gputq/kernels/widen_scatter.cu", "gputq/kernels/host_codec.c", "gputq/kernels/host_pack.c",
            "gputq/kernels/host_widen.c", "gputq/kernels/host_codec.h"} <= set(names)
    assert "gputq/kernels/__init__.py" in names and "gputq/transport/__init__.py" in names
    assert "gputq/transport/wire.py" in names
    assert not [n for n in names if n.startswith(("tests/", "bench/", "gputq/tests/", "gputq/bench/"))
                or "/tests/" in n or "conftest" in n]
    assert "gputq/transport/errors.py" not in names  # the one error tree is gputq/errors.py
    assert "gputq/errors.py" in names

    # 3. A fresh venv of this interpreter, the wheel and PyPI's kernels in it (pip's cache reused).
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], env=env, cwd=tmp_path, timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    installed = _run([str(python), "-m", "pip", "install", "--progress-bar", "off", str(wheel), "kernels"],
                     env=env, cwd=tmp_path, timeout=780)
    if installed.returncode != 0:
        output = installed.stdout + installed.stderr
        lines = output.strip().splitlines()
        network = [line for line in lines if any(marker in line for marker in _UNREACHABLE)]
        if network:
            pytest.skip(f"PyPI unreachable (pip install of the wheel and 'kernels'): {network[0].strip()}")
        if "No matching distribution found for kernels" in output and "(from versions: none)" in output:
            pytest.skip("PyPI unreachable: pip saw no version of 'kernels' on its index (from versions: none)")
        pytest.fail("pip install of the gputq wheel and PyPI's kernels failed:\n" + output[-4000:])

    # 4. In that venv, outside the checkout: both import, each from its own package.
    probe = _run([str(python), "-I", "-c", _PROBE], env=env, cwd=tmp_path, timeout=120)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    sites = [Path(seen["site"]).resolve(), Path(seen["platsite"]).resolve()]
    kernels_file = Path(seen["kernels_file"]).resolve()
    assert any(kernels_file == site / "kernels" / "__init__.py" for site in sites), seen["kernels_file"]
    assert venv.resolve() in kernels_file.parents
    assert seen["kernels_dist"] == "kernels" and seen["kernels_has_get_kernel"]
    assert not seen["kernels_has_widen_scatter"], "top-level kernels is gputq's, not PyPI's"
    for name in ("gputq_kernels_file", "gputq_transport_file"):
        path = Path(seen[name]).resolve()
        assert any(path.parent.parent == site / "gputq" for site in sites), seen[name]
        assert ROOT not in path.parents, f"{name} came from the checkout: {path}"
    assert seen["widen_scatter_callable"] and seen["cu_is_file"] and seen["cu_has_kernel"]
    assert not seen["top_level_transport"], "a top-level 'transport' is importable"
    owned_tops = {f.split("/")[0] for f in seen["gputq_files"]}
    assert "kernels" not in owned_tops and "transport" not in owned_tops, sorted(owned_tops)
    assert owned_tops <= {"gputq", dist_info, "..", "bin", "Scripts"}, sorted(owned_tops)

    print(f"\npackaging: {wheel.name} beside kernels {seen['kernels_version']} "
          f"in {time.monotonic() - started:.1f} s")
