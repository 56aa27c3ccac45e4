"""Test helpers for copies shared in pieces (:mod:`gputq.transport.arena_copies`)."""

from __future__ import annotations

import numpy as np

from gputq.transport import arena_copies


class NumpyWithCopyto:
    """numpy as :mod:`gputq.transport.arena_copies` sees it, with ``copyto`` replaced."""

    def __init__(self, copyto):
        self.copyto = copyto

    def __getattr__(self, name):
        return getattr(np, name)


def share_every_copy(monkeypatch, piece_bytes: int, *, threads: int = 1) -> None:
    """Cut every host copy into ``piece_bytes`` pieces, with ``threads - 1`` pool threads."""
    monkeypatch.setattr(arena_copies, "COPY_THREADS", threads)
    monkeypatch.setattr(arena_copies, "PARALLEL_COPY_BYTES", 1)
    monkeypatch.setattr(arena_copies, "COPY_PIECE_BYTES", piece_bytes)
