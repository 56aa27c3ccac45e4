"""A process that made a NIXL agent exits cleanly, whatever UCX modules the host's libraries offer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gputq.transport.policy import nixl_import_error

pytestmark = [pytest.mark.rdma, pytest.mark.skipif(nixl_import_error() is not None,
                                                   reason=f"NIXL not importable: {nixl_import_error()}")]

_MAKE_AGENT = """
import os
from gputq.transport.nixl_pool import LocalAgent
LocalAgent.get()
print(os.environ.get("UCX_MODULES"))
"""


def _run(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _MAKE_AGENT], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(90)
def test_a_process_with_an_agent_exits_zero():
    # With libibverbs installed and no InfiniBand device, UCX's ib module crashed such a process at exit.
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = _run(env)
    assert done.returncode == 0, done.stderr[-2000:]
    from gputq.transport.policy import infiniband_devices

    assert done.stdout.split()[-1] == ("None" if infiniband_devices() else "^ib")


@pytest.mark.timeout(90)
def test_an_operators_ucx_modules_is_left_alone():
    done = _run({**os.environ, "UCX_MODULES": "^ib,cuda"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "^ib,cuda"
