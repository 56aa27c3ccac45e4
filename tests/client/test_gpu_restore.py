"""The reader restoring into GPU memory, checked against the inline path (needs a GPU).

Over shm the restore reads compact bytes in place from the mapped arenas
(zero-copy) up to a size threshold and copies them to the GPU first above
it, in spans of the arenas; both are checked.
"""

from __future__ import annotations

import numpy as np
import pytest

from gputq import kernels
from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.data.trajectory import inline_fields, lineage_segments, timeline_segments
from gputq.tools.synthetic import SyntheticConfig, build_sessions
from tests.conftest import local_units

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not kernels.cuda_available(), reason="no CUDA device")]


def restore_and_compare(transport_name, dtype, *, device: str = "cuda", **overrides) -> int:
    """Restore every segment of synthetic sessions into GPU memory (``device``); check each against
    the inline path and that every tensor is on ``device``.

    Returns the number of segments compared.
    """
    torch = pytest.importorskip("torch")
    on_device = torch.device(device if ":" in device else "cuda:0")  # a plain "cuda" reader uses device 0
    compared = 0
    # 100 experts: packed IDs take 7 bits, so rows of 8 straddle bytes
    synth = SyntheticConfig(sessions=4, steps_per_session=3, layers=6, topk=8, num_experts=100,
                            prompt_tokens=300, tokens_per_step=400, tool_tokens=17, branch_prob=0.5,
                            rewrite_prob=0.3, seed=11)
    with local_units(transport_name, routed_experts_dtype=dtype, num_experts=synth.num_experts,
                     **overrides) as (config, _, clients):
        fields = config.field_registry(synth.layers, synth.topk)
        with Writer(clients, config) as writer:
            sessions = build_sessions(synth, fields=fields, writer=writer)
            writer.flush()
        with Reader(clients, config, device=device) as reader:
            for view in (timeline_segments, lineage_segments):
                segments = [seg for s in sessions for seg in view(s)]
                restored = reader.fetch([seg.layouts for seg in segments])
                assert len(restored) == len(segments)
                for seg, got in zip(segments, restored):
                    expected = inline_fields(seg)
                    assert set(got) == set(expected)
                    for name, want in expected.items():
                        tensor = got[name]
                        assert tensor.is_cuda and tensor.device == on_device
                        assert tuple(tensor.shape) == want.shape
                        assert tensor.dtype == {np.int32: torch.int32, np.float32: torch.float32}[want.dtype.type]
                        assert np.array_equal(tensor.cpu().numpy(), want), (seg.segment_id, name)
                    compared += 1
    return compared


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32", "packed"])
def test_gpu_restore_matches_inline_path(transport_name, dtype):
    assert restore_and_compare(transport_name, dtype) > 0


@pytest.mark.parametrize("zero_copy", [True, False], ids=["in-place", "copied"])
@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
def test_gpu_restore_over_shm_in_place_or_copied(monkeypatch, zero_copy, dtype):
    from gputq.kernels import MappedSource

    cp = pytest.importorskip("cupy")
    launches = []
    original = MappedSource.widen_scatter
    monkeypatch.setattr(MappedSource, "widen_scatter",
                        lambda self, *a, **k: launches.append(self) or original(self, *a, **k))
    assert restore_and_compare("shm", dtype, zero_copy_max_bytes=float("inf") if zero_copy else 0) > 0
    assert launches
    # in place the kernel reads the page-locked arenas (host memory); copied, a copy in device memory
    kinds = {int(cp.cuda.runtime.pointerGetAttributes(int(address)).type)
             for source in launches for address in source.addresses}
    host, device = 1, 2  # cudaMemoryTypeHost, cudaMemoryTypeDevice
    assert kinds == ({host} if zero_copy else {device})
