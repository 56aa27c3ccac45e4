"""``gputq info``: the probes answer with or without NIXL, and say what auto would do."""

from __future__ import annotations

import builtins
import json
import sys

import pytest

from gputq.tools import info
from gputq.transport import policy
from gputq.transport.policy import nixl_fix


@pytest.fixture
def no_nixl(monkeypatch):
    """Make every ``import nixl...`` fail, as on a machine without the wheel."""
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.split(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    policy.nixl_import_error.cache_clear()
    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(policy, "NIXL_API_MODULES", ("nixl._api",))  # import_module skips __import__
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    monkeypatch.delenv(policy.ENV_VAR, raising=False)
    yield
    policy.nixl_import_error.cache_clear()


def test_without_nixl_reports_everything_else(no_nixl):
    data = info.collect_info()
    assert data["nixl"]["available"] is False and "nixl" in data["nixl"]["error"]
    assert data["nixl"]["plugins"] == []
    assert data["versions"]["numpy"] not in ("unknown", "not installed")
    assert data["transport"]["same_host"]["choice"] == "shm"
    assert data["transport"]["remote"]["choice"] == "tcp"
    json.dumps(data)  # `gputq info --json` must serialise it
    text = info.format_info(data)
    assert "nixl: unavailable" in text and "remote peer: tcp" in text


def test_rdma_forced_without_lanes_warns(no_nixl, monkeypatch):
    monkeypatch.setattr(info, "infiniband_devices", lambda: [])
    monkeypatch.setenv(policy.ENV_VAR, "rdma")
    data = info.collect_info()
    assert data["transport"]["remote"]["choice"] == "rdma"
    assert any("no InfiniBand" in w for w in data["warnings"])
    assert any("does not import" in w for w in data["warnings"])
    assert "warning:" in info.format_info(data)


def test_the_reported_request_is_the_configs(no_nixl, monkeypatch, tmp_path):
    """What info reports is what the config loaded here requests: YAML < GPUTQ_TRANSPORT."""
    data = info.collect_info()
    assert data["transport"]["requested"] == "auto" and data["transport"]["env"] is None
    assert "transport auto as configured (GPUTQ_TRANSPORT=unset" in info.format_info(data)
    path = tmp_path / "tq.yaml"
    path.write_text("transport: shm\n")
    monkeypatch.setenv("GPUTQ_CONFIG", str(path))
    data = info.collect_info()
    assert data["transport"]["requested"] == "shm"
    assert data["transport"]["remote"] == {"choice": "shm", "reason": "requested shm explicitly"}
    monkeypatch.setenv(policy.ENV_VAR, "tcp")  # the variable beats the file
    data = info.collect_info()
    assert data["transport"]["requested"] == "tcp" and data["transport"]["env"] == "tcp"
    assert data["transport"]["same_host"] == {"choice": "tcp", "reason": "requested tcp explicitly"}
    assert "transport tcp as configured (GPUTQ_TRANSPORT=tcp; a --transport flag wins" in info.format_info(data)


def test_bad_env_value_is_reported_not_raised(no_nixl, monkeypatch):
    monkeypatch.setenv(policy.ENV_VAR, "ib")
    data = info.collect_info()
    assert data["transport"]["remote"]["choice"] is None
    assert any(policy.ENV_VAR in w for w in data["warnings"])


def test_with_nixl_lists_plugins_and_auto_choices():
    policy.nixl_import_error.cache_clear()
    if policy.nixl_import_error() is not None:
        pytest.skip("nixl does not import here")
    data = info.collect_info()
    assert "UCX" in data["nixl"]["plugins"]
    assert data["ucx"]["bundled_version"]  # read from the wheel's libucp
    assert "cma" in data["ucx"]["bundled_modules"]
    expected = "tcp" if not data["infiniband"] else "rdma"
    if not data["transport"]["env"]:
        assert data["transport"]["same_host"]["choice"] == "shm"
        assert data["transport"]["remote"]["choice"] == expected


def test_gpudirect_needs_gpu_and_infiniband(monkeypatch):
    assert info._gpudirect([]) == {"possible": False, "reason": "no GPU"}
    monkeypatch.setattr(policy, "infiniband_devices", lambda: [])
    assert info._gpudirect(["GPU 0"]) == {"possible": False, "reason": "no InfiniBand/RoCE device"}


def test_install_hint_names_what_fixes_it(monkeypatch):
    installed = {"nixl-cu12": "1.5.1"}

    def version(dist):
        if dist in installed:
            return installed[dist]
        raise info.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(info.metadata, "version", version)
    hint = nixl_fix("libucs.so.0: cannot open shared object file")
    assert "nixl-cu12 1.5.1 is installed but does not load (libucs.so.0" in hint
    assert "--force-reinstall" in hint
    installed.clear()
    assert nixl_fix("No module named 'nixl'").startswith("pip install 'gputq[rdma]'")


def test_missing_nixl_report_carries_the_fix(no_nixl):
    data = info.collect_info()
    assert data["nixl"]["fix"] and "gputq[rdma]" in data["nixl"]["fix"]
    assert "fix:" in info.format_info(data)


def test_the_host_codec_of_packed_ids_is_reported_with_its_reason(no_nixl, monkeypatch):
    from gputq.kernels import host_native

    monkeypatch.setattr(host_native, "_state", {})
    monkeypatch.setenv("GPUTQ_HOST_CODEC", "numpy")
    data = info.collect_info()
    assert data["host_codec"] == {"native": False, "status": "GPUTQ_HOST_CODEC=numpy: packed IDs use numpy"}
    assert "packed expert IDs on the host: numpy (GPUTQ_HOST_CODEC=numpy" in info.format_info(data)
