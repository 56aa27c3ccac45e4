"""One Ray node per namespace host: a head on host 0, ``ray start --address`` on the others.

Token authentication is on (``RAY_AUTH_MODE=token``, one ``RAY_AUTH_TOKEN``
for every node and driver). Every Ray process of the cluster keeps its
files, its ``ray_current_cluster`` pointer included, under the hosts' temp
folder (``RAY_TMPDIR`` and ``--temp-dir``), which the hosts' teardown
removes: the machine's default ``/tmp/ray`` is neither read nor written,
and no other Ray user of the machine is disturbed. Nodes are torn down with
the hosts (every process in their namespaces is killed by id), never with
``ray stop``, which would stop every Ray of the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

from tests.cluster.netns import Hosts

__all__ = ["start_ray", "ray_env", "GCS_PORT"]

#: The head's GCS port, inside host 0's own network namespace (nothing else listens there).
GCS_PORT = 6379
# Node death is noticed after period x threshold (Ray's defaults: 3 s x 5).
_HEALTH = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4",
           "RAY_health_check_timeout_ms": "500"}


def ray_env(hosts: Hosts, token: str) -> dict:
    """The environment of every Ray process and driver of ``hosts``' cluster."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_TMPDIR=hosts.tmp,
                RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=root, **_HEALTH)


def start_ray(hosts: Hosts, *, num_cpus: int = 1, object_store_bytes: int = 80 << 20) -> dict:
    """Start a node on every host (each with a ``host<i>`` resource); return the drivers' environment.

    The nodes start in the background; a driver waits for them to be alive
    (``ray.nodes()``). Each node has its own temp dir, ``<hosts.tmp>/ray<i>``:
    nodes started at once in one dir race for the same socket names. Their
    logs go to ``<hosts.tmp>/ray-host<i>.log``.
    """
    env = ray_env(hosts, secrets.token_hex(16))
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    for i in range(hosts.n):
        role = (["--head", "--include-dashboard=false", f"--port={GCS_PORT}"] if i == 0
                else [f"--address={hosts.addresses[0]}:{GCS_PORT}"])
        with open(os.path.join(hosts.tmp, f"ray-host{i}.log"), "w") as log:
            hosts.popen(i, [ray, "start", *role, f"--node-ip-address={hosts.addresses[i]}",
                            f"--num-cpus={num_cpus}", "--num-gpus=0", f"--resources={json.dumps({f'host{i}': 1})}",
                            f"--object-store-memory={object_store_bytes}", f"--temp-dir={hosts.tmp}/ray{i}",
                            "--disable-usage-stats", "--block"],
                        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return env
