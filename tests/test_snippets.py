"""Every Python snippet of README.md and docs/integration.md runs against the real API, in the fast suite.

A snippet is taken from the page as it stands and executed, the snippets of
a page in order, in one namespace, as the story the page tells. Only what a
snippet leaves to its reader is supplied: the rollout's arrays, an SGLang
engine that answers, Megatron's ``mpu`` and ``RouterReplay``. Ray is not
started here: ``Deployment`` is a local one on in-process units over tcp,
whose ``start`` and methods take exactly the real ``Deployment``'s
arguments (bound against its signatures), so a renamed argument anywhere
in a snippet fails this test. ``tests/cluster/test_ray.py`` runs the
README's with Ray itself (``-m slow``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import pathlib
import re
import sys
import textwrap
import types

import numpy as np
import pytest

import gputq
from gputq.cluster.deploy import Deployment as RealDeployment
from gputq.integrations.sglang import encode_response
from gputq.integrations.slime import check_sample
from tests.conftest import local_units

pytestmark = pytest.mark.timeout(120)

ROOT = pathlib.Path(__file__).resolve().parents[1]
L, K, E = 4, 2, 16


def snippets(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)


class LocalDeployment:
    """In-process units standing in for Ray's, with the real Deployment's call signatures."""

    def __init__(self, stack: contextlib.ExitStack, config):
        self.config, self.units, self._clients = stack.enter_context(local_units(
            "tcp", units=2, routed_experts_dtype=config.routed_experts_dtype))
        self._stack = stack

    @classmethod
    def starter(cls, stack: contextlib.ExitStack):
        def start(config, **kwargs):
            inspect.signature(RealDeployment.start).bind(config, **kwargs)
            return cls(stack, config)
        return start

    def _bind(self, name: str, *args, **kwargs) -> None:
        inspect.signature(getattr(RealDeployment, name)).bind(self, *args, **kwargs)

    def membership(self, *args, **kwargs) -> dict:
        self._bind("membership", *args, **kwargs)
        return self._clients.membership

    def clients(self, *args, **kwargs):
        self._bind("clients", *args, **kwargs)
        return gputq.UnitClients(self._clients.membership, self.config)

    def unreachable(self, samples, **kwargs):
        self._bind("unreachable", samples, **kwargs)
        with self.clients() as clients:
            return gputq.unreachable_samples(samples, clients, **kwargs)

    def release_partition(self, partition: str, *args, **kwargs) -> dict:
        self._bind("release_partition", partition, *args, **kwargs)
        return {unit: self._clients.channel(unit).call("release_partition", timeout=10, partition=partition)
                for unit in self._clients.units}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class Replays:
    """Megatron's router replay as the snippets use it: records what each MoE layer is handed."""

    def __init__(self):
        self.data = []

    def set_replay_data(self, tensors) -> None:
        assert all(t.dtype == np.int32 and t.ndim == 2 and t.shape[1] == K for t in tensors)
        self.data.append(len(tensors))

    def record(self, handle) -> None:
        self.data.append(handle)


def _engine(rng):
    """An SGLang ``/generate`` that answers with a few tokens, their logprobs and routed experts."""
    def generate(prompt, start_len):
        n_out = int(rng.integers(2, 9))
        experts = rng.integers(1, E, (len(prompt) + n_out - 1 - start_len, L, K), dtype=np.int32)
        return encode_response(rng.integers(0, 1000, n_out), -rng.random(n_out), experts)
    return generate


def test_the_readme_snippets_run_in_order_on_the_real_api(monkeypatch):
    rng = np.random.default_rng(0)
    parser_args = ["--enable-transfer-queue", "--use-rollout-routing-replay", "--routed-experts-dtype", "uint8",
                   "--transport", "tcp"]
    with contextlib.ExitStack() as stack:
        scope = {"logprobs": -rng.random(20).astype(np.float32),
                 "experts": rng.integers(0, 200, (20, L, K), dtype=np.int32),
                 "args": gputq.add_transfer_queue_arguments(argparse.ArgumentParser()).parse_args(parser_args),
                 "L": L, "K": K, "first_prompt": rng.integers(0, 1000, 12), "generate": _engine(rng),
                 "tool_outputs": [rng.integers(0, 1000, 3) for _ in range(3)], "rank": 0, "world": 1, "np": np,
                 "argparse": argparse, "gputq": gputq}
        scope.update({name: getattr(gputq, name) for name in gputq.__all__})
        monkeypatch.setattr(gputq, "Deployment", types.SimpleNamespace(start=LocalDeployment.starter(stack)))
        scope["Deployment"] = gputq.Deployment
        from gputq.data.trajectory import lineage_segments
        from gputq.integrations.sglang import RolloutIngest
        from gputq.integrations.slime import hydrate, to_slime_sample

        scope.update(lineage_segments=lineage_segments, RolloutIngest=RolloutIngest, hydrate=hydrate,
                     to_slime_sample=to_slime_sample)
        ten_lines, multi_turn, streamed, flags = snippets("README.md")
        exec(compile(ten_lines, "README.md", "exec"), scope)
        np.testing.assert_array_equal(scope["fields"]["rollout_routed_experts"], scope["experts"])
        exec(compile(multi_turn, "README.md", "exec"), scope)
        (sample,) = scope["samples"]
        check_sample(sample)
        # The streamed loop, over a fresh step of the same deployment's kind.
        with local_units("tcp", units=1) as (config, _, clients), gputq.Writer(clients, config) as writer:
            refs = writer.put("s/0", "rollout-0", {"routed_experts": scope["experts"], "logprobs": scope["logprobs"]})
            writer.flush()
            replays = Replays()
            with gputq.Reader(clients, config) as reader:
                scope.update(reader=reader, shard=[{f: gputq.Layout.from_ref(r) for f, r in refs.items()}],
                             micro_batches=[[0]], first=1, stop=3, cp=0, CP=2, E=E, RouterReplay=replays,
                             train_step=lambda mb: None)
                exec(compile(streamed, "README.md", "exec"), scope)
            assert replays.data == [2]  # one micro-batch, its stage's two layers
        monkeypatch.setattr(sys, "argv", ["trainer", *parser_args])
        exec(compile(flags, "README.md", "exec"), scope)
        assert scope["config"].routed_experts_dtype == "uint8"


def _async(code: str) -> str:
    """A snippet with ``await`` at its top level, as the body of a coroutine that returns its locals."""
    return "async def _snippet():\n" + textwrap.indent(code, "    ") + "    return locals()\n"


def test_the_integration_guide_runs_as_one_story_on_the_real_api(monkeypatch):
    rng = np.random.default_rng(1)
    generate = _engine(rng)
    flags = ["--enable-transfer-queue", "--use-rollout-routing-replay", "--routed-experts-dtype", "uint8",
             "--transport", "tcp"]
    monkeypatch.setattr(sys, "argv", ["proxy", *flags])

    async def sglang_generate(prompt_ids, **options):
        assert options["return_logprob"] and options["return_routed_experts"]
        return generate(prompt_ids, options["routed_experts_start_len"])

    mpu = types.SimpleNamespace(get_context_parallel_rank=lambda: 0, get_context_parallel_world_size=lambda: 1,
                                get_tensor_model_parallel_rank=lambda: 0,
                                get_tensor_model_parallel_world_size=lambda: 1)
    replays = Replays()
    with contextlib.ExitStack() as stack:
        monkeypatch.setattr(gputq, "Deployment", types.SimpleNamespace(start=LocalDeployment.starter(stack)))
        scope = {"L": L, "K": K, "rollout_id": 0, "episode_id": "episode-0", "prompt_ids": rng.integers(0, 1000, 9),
                 "sglang_generate": sglang_generate, "pp": 1, "cp": 1, "tp": 1, "mpu": mpu,
                 "my_moe_layers": range(L), "micro_batch_indices": [[0]], "RouterReplay": replays,
                 "forward_backward_step": lambda mb: None, "stage_moe_replays": [Replays() for _ in range(L)]}
        blocks = [code.replace('device="cuda")', 'device="cpu")')  # no GPU here; the argument is the same
                  for code in snippets("docs/integration.md")]
        episode, rollout = blocks[2], blocks[3]  # one agent episode, then its segments finalized

        def run(code: str, name: str) -> None:
            if "await " in code:
                exec(compile(_async(code), name, "exec"), scope)
                scope.update(asyncio.run(scope.pop("_snippet")()))
            else:
                exec(compile(code, name, "exec"), scope)

        checked = False
        for i, code in enumerate(blocks):
            if i > 3 and "finalize(" in code:  # the at-scale finalize, of an episode of its own
                scope["episode_id"] = f"episode-{i}"
                run(episode, "integration.md episode")
                scope["segments"] = scope["lineage_segments"](scope["session"])
            elif i > 3 and ("stream(" in code or "hydrate(" in code):
                # Each trainer snippet consumes (and releases) a rollout of its own: the guide's paths
                # are alternatives, not one after the other.
                scope["episode_id"] = f"episode-{i}"
                run(episode, "integration.md episode")
                run(rollout, "integration.md rollout")
                fresh = [scope["to_slime_sample"](seg) for seg in scope["segments"]]
                scope.update(my_samples=fresh, rollout_samples=fresh,
                             args=types.SimpleNamespace(sequence_parallel=False, data_pad_size_multiplier=1,
                                                        num_experts=E, allgather_cp=False))
            run(code, f"integration.md block {i}")
            if "hydrate(" in code:  # the small-job path: the rank's samples restored in place, as slime checks them
                for sample in scope["my_samples"]:
                    check_sample(sample)
                checked = True
            if "ingest" in scope:  # the rollout's partition, which the trainer snippets name
                scope.setdefault("partition", scope["ingest"].partition)
        assert checked and len(scope["samples"]) == len(scope["segments"]) > 0
        assert replays.data == [L]  # the streamed snippet handed Megatron every layer of the one micro-batch
        assert scope["lost"] == {}
