"""A real local Ray cluster: deployment, the demo path, per-node placement."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="Ray not installed (pip install 'gputq[ray]')")

from gputq.cluster.deploy import Deployment  # noqa: E402
from gputq.config import GputqConfig  # noqa: E402
from gputq.tools.demo import DemoOptions, run_demo  # noqa: E402
from tests.conftest import TRANSPORT_PARAMS  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
@pytest.mark.parametrize("dtype", ["uint8", "int32"])
def test_demo_path_is_bit_exact_over_ray(transport, dtype):
    options = DemoOptions(sessions=3, steps=3, units=2, ranks=2, dtype=dtype, layers=8, topk=8,
                          experts=250, tokens=64, transport=transport, seed=3)
    result = run_demo(options, progress=False)
    assert result["verified"] is True and result["mismatched"] == []
    assert result["transport"] == [transport]
    assert all(u <= r for u, r in zip(result["unique_keys_fetched_per_rank"],
                                      result["referenced_keys_per_rank"]))
    # What crosses Ray is references, far smaller than the payload.
    assert result["sample_bytes_through_ray"] * 5 < result["bytes_offloaded"]
    assert result["bytes_fetched"] >= result["bytes_offloaded"] // 2
    assert result["keys_left_after_release"] == 0


def test_one_unit_per_node_with_hard_affinity():
    config = GputqConfig(transport="tcp", unit_capacity_bytes=8 << 20)
    with Deployment.start(config, per_node=True) as deployment:
        alive = [n for n in ray.nodes() if n["Alive"]]
        assert len(deployment.units) == len(alive)
        nodes = ray.get(deployment.controller.nodes.remote())
        assert set(nodes.values()) == {n["NodeID"] for n in alive}
        stats = deployment.stats()
        assert stats["totals"]["capacity"] == len(alive) * (8 << 20)
        assert stats["totals"]["keys"] == 0


def test_readme_example_runs_and_restores_exactly():
    import pathlib
    import re

    import numpy as np

    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    code = re.search(r"## In ten lines\s+```python\n(.*?)```", readme, re.S).group(1)
    rng = np.random.default_rng(0)
    scope = {"logprobs": -rng.random(50, dtype=np.float32),
             "experts": rng.integers(0, 300, size=(50, 4, 2), dtype=np.int32)}
    exec(compile(code, "README.md", "exec"), scope)
    fields = scope["fields"]
    assert np.array_equal(fields["rollout_routed_experts"], scope["experts"])
    assert fields["rollout_routed_experts"].dtype == np.int32
    assert np.array_equal(fields["rollout_log_probs"], scope["logprobs"])


def test_stats_attaches_to_a_running_deployment():
    import json
    import os
    import subprocess
    import sys

    from gputq.cluster.names import CONTROLLER_NAME, NAMESPACE

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = GputqConfig(transport="tcp", unit_capacity_bytes=8 << 20, num_units=2)
    with Deployment.start(config) as deployment:
        assert ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE) is not None
        ray.get(deployment.controller.open_partition.remote("rollout-7"))
        address = ray.get_runtime_context().gcs_address
        env = {**os.environ, "PYTHONPATH": root}
        proc = subprocess.run([sys.executable, "-m", "gputq.tools.cli", "stats", "--address", address, "--json",
                               "--check"], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert sorted(report["units"]) == ["su-0", "su-1"]
        assert all(u["capacity"] == 8 << 20 and u["keys"] == 0 and u["rss_bytes"] > 0
                   for u in report["units"].values())
        assert report["partitions"] == ["rollout-7"]
        from gputq.cluster.controller import Controller

        if hasattr(Controller, "check_invariants"):
            assert report["check"]["available"] is True and report["check"]["ok"] is True
        else:
            assert report["check"] == {"available": False,
                                       "reason": "this deployment's controller has no check_invariants"}
        table = subprocess.run([sys.executable, "-m", "gputq.tools.cli", "stats", "--address", address, "--once"],
                               capture_output=True, text=True, timeout=120, env=env)
        assert table.returncode == 0 and table.stdout.splitlines()[0].startswith("unit")
        assert "partitions: rollout-7" in table.stdout


def test_stats_without_a_deployment_is_one_line():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-m", "gputq.tools.cli", "stats", "--address", address, "--once"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 2 and "no gputq deployment on this Ray cluster" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_stats_names_a_controller_that_does_not_answer_instead_of_hanging(monkeypatch, capsys):
    """A hung controller (an actor of that name whose calls never return) is one error line and exit 1 within
    the answer timeout: an operator runs ``gputq stats`` on the very cluster that hangs."""
    from gputq.cluster.names import CONTROLLER_NAME, NAMESPACE
    from gputq.errors import GputqTimeoutError
    from gputq.tools import cli, stats

    @ray.remote(num_cpus=0)
    class Hung:
        def membership(self):
            import threading

            threading.Event().wait()  # never set: a call that never returns (the actor is killed below)
    actor = Hung.options(name=CONTROLLER_NAME, namespace=NAMESPACE).remote()
    try:
        monkeypatch.setattr(stats, "ANSWER_TIMEOUT_S", 1.0)
        with pytest.raises(GputqTimeoutError, match="the controller's membership did not answer within 1 s"):
            stats.run_stats(once=True)
        address = ray.get_runtime_context().gcs_address
        assert cli.main(["stats", "--once", "--address", address]) == 1
        err = capsys.readouterr().err
        assert err.startswith("gputq stats: error: the controller's membership did not answer within 1 s")
        assert "Traceback" not in err
    finally:
        ray.kill(actor)


def test_readme_multi_turn_path_runs_and_passes_slimes_checks(tmp_path):
    import argparse
    import pathlib
    import re

    import numpy as np

    from gputq import GputqConfig as Config
    from gputq import Reader, Writer, add_transfer_queue_arguments
    from gputq.data.trajectory import lineage_segments
    from gputq.integrations.sglang import RolloutIngest, encode_response
    from gputq.integrations.slime import LOG_PROBS, ROUTED_EXPERTS_KEY, check_sample, hydrate, to_slime_sample

    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    code = re.search(r"## The multi-turn path.*?```python\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "tq.yaml").write_text("unit_capacity_bytes: 8388608\n")
    args = add_transfer_queue_arguments(argparse.ArgumentParser()).parse_args(
        ["--enable-transfer-queue", "--use-rollout-routing-replay", "--routed-experts-dtype", "uint8",
         "--transport", "tcp", "--transfer-queue-config", str(tmp_path / "tq.yaml")])
    rng = np.random.default_rng(0)
    L, K = 4, 2
    sent = []

    def generate(prompt, start_len):
        n_out = int(rng.integers(1, 9))
        experts = rng.integers(0, 200, (len(prompt) + n_out - 1 - start_len, L, K), dtype=np.int32)
        sent.append(experts)
        return encode_response(rng.integers(0, 1000, n_out), -rng.random(n_out), experts)

    scope = {"args": args, "L": L, "K": K, "first_prompt": rng.integers(0, 1000, 12),
             "tool_outputs": [rng.integers(0, 1000, 3) for _ in range(4)], "generate": generate,
             "rank": 0, "world": 1, "np": np, "GputqConfig": Config, "Deployment": Deployment,
             "Writer": Writer, "Reader": Reader, "RolloutIngest": RolloutIngest,
             "lineage_segments": lineage_segments, "to_slime_sample": to_slime_sample, "hydrate": hydrate}
    exec(compile(code, "README.md", "exec"), scope)
    (sample,) = scope["samples"]
    check_sample(sample)
    assert np.array_equal(sample[ROUTED_EXPERTS_KEY], np.concatenate(sent))
    assert sample[LOG_PROBS].dtype == np.float32 and len(sample[LOG_PROBS]) == sample["response_length"]
