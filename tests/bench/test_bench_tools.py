"""The benchmarks' shared tools: the socket baseline, progress bars, region merging."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from bench.common import Progress, SocketBaseline, progress_range


@pytest.mark.timeout(60)
def test_socket_baseline_server_is_another_process_and_moves_bytes():
    with SocketBaseline(1 << 20) as sock:
        assert sock._process.pid != os.getpid() and sock._process.is_alive()
        assert sock.read(1 << 20) > 0
        assert sock.write(1 << 20) > 0
        with pytest.raises(ValueError):
            sock.read((1 << 20) + 1)
        process = sock._process
    assert not process.is_alive()


def test_progress_writes_steps_to_its_stream():
    stream = io.StringIO()
    with Progress("job", 2, width=4, stream=stream) as progress:
        progress.step("one")
        progress.step("two")
        progress.step("past the end stays at the total")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("job [....] 0/2")
    assert lines[1].startswith("job [##..] 1/2") and lines[1].endswith("one")
    assert lines[-1].startswith("job [####] 2/2")


def test_progress_range_yields_every_index(capsys):
    assert list(progress_range("r", 3)) == [0, 1, 2]
    assert "r [" in capsys.readouterr().err


def test_merge_regions_joins_touching_neighbours_only():
    nixl = pytest.importorskip("gputq.transport.nixl")  # bench.transport imports the NIXL backend module
    del nixl
    from bench.transport import merge_regions

    regions = np.array([[0, 256], [256, 512], [1024, 256], [1280, 256], [4096, 16]])
    assert merge_regions(regions).tolist() == [[0, 768], [1024, 512], [4096, 16]]
    # Out of order is not merged: the destination is packed in the order given.
    assert merge_regions(np.array([[256, 256], [0, 256]])).tolist() == [[256, 256], [0, 256]]
    assert merge_regions(np.array([[8, 8]])).tolist() == [[8, 8]]


def test_write_figures_without_matplotlib_says_so(capsys):
    from bench.plots import write_figures
    from gputq.errors import MissingDependencyError

    def draw(_):
        raise MissingDependencyError("figures need matplotlib: pip install 'gputq[bench]'")

    assert write_figures(draw, None) == []
    assert "gputq[bench]" in capsys.readouterr().err
    assert write_figures(lambda path: path, "a.png") == ["a.png"]
