"""slime's lazy replay handles over a stream: each micro-batch restored at its first layer's replay.

slime's ``fill_routing_replay`` records every micro-batch's routes before
training; with a stream it records :class:`LayerRef` handles instead
(:meth:`MicroBatchStream.replay_handles
<gputq.client.stream.MicroBatchStream.replay_handles>`). Training then
materialises each layer as Megatron's router replays it: a micro-batch is
restored when its first layer is asked for (in micro-batch order; the
stream keeps prefetching the next ones) and released once every layer was
materialised for the ``release_after`` direction. Live micro-batches are
those between their first forward and last backward: a pipeline
schedule's in-flight ones.
"""

from __future__ import annotations

import threading
from typing import Callable

from gputq.errors import InvalidInputError

__all__ = ["LayerRef", "LazyReplay", "DIRECTIONS"]

#: The passes a layer is materialised for.
DIRECTIONS = ("forward", "backward")


class LayerRef:
    """One layer of one micro-batch for slime's ``RoutingReplay.record``, restored when first replayed."""

    def __init__(self, replay: "LazyReplay", index: int, position: int):
        self._replay, self.index, self.position = replay, index, position

    def materialize_for_routing_replay(self, direction: str):
        """The layer's int32 ``[tokens, topk]`` tensor for the ``"forward"`` or ``"backward"`` replay."""
        if direction not in DIRECTIONS:
            raise InvalidInputError(f"direction must be 'forward' or 'backward', got {direction!r}")
        return self._replay.materialize(self.index, self.position, direction)


class LazyReplay:
    """The handles' bookkeeping: which micro-batch is live, how many of its layers were replayed.

    Parameters
    ----------
    release_after:
        ``"backward"`` for a training pass, ``"forward"`` for a forward-only one.
    lock:
        The stream's lock: materialising and the stream's own state change together.
    live:
        ``live(index)``: the micro-batch if it is restored and not released, else None.
    take:
        ``take(index)``: restore micro-batch ``index``, the next in order (a typed error otherwise).
    finish:
        ``finish(batch)``: release a micro-batch whose every layer was replayed.
    """

    def __init__(self, release_after: str, lock: threading.RLock, live: Callable, take: Callable,
                 finish: Callable):
        if release_after not in DIRECTIONS:
            raise InvalidInputError(f"release_after must be 'forward' or 'backward', got {release_after!r}")
        self.release_after = release_after
        self._lock, self._live, self._take, self._finish = lock, live, take, finish
        self._uses: dict[int, int] = {}
        self._retiring = None  # replayed for good; released at the next call, once its tensor is used

    def handles(self, layers_per_batch: list[tuple[int, int]]) -> list[list[LayerRef]]:
        """Per ``(micro-batch index, its layer count)``, one handle per layer."""
        return [[LayerRef(self, index, j) for j in range(count)] for index, count in layers_per_batch]

    def materialize(self, index: int, position: int, direction: str):
        """Layer ``position`` of micro-batch ``index``, restoring the micro-batch first if need be."""
        with self._lock:
            retiring, self._retiring = self._retiring, None
            if retiring is not None and retiring.index != index:
                self._finish(retiring)  # the tensor handed out last is used by now
            elif retiring is not None:
                self._retiring = retiring
            batch = self._live(index)
            if batch is None:
                batch = self._take(index)
                self._uses[index] = 0
            tensor = batch.routed_experts[position]
            if direction == self.release_after:
                self._uses[index] += 1
                if self._uses.get(index) == len(batch.routed_experts):
                    # Released at the next call: the restore thread must not refill a buffer whose
                    # tensor the caller is still reading.
                    del self._uses[index]
                    self._retiring = batch
            return tensor

    def close(self) -> None:
        """Release the micro-batch replayed last (its tensor is no longer read). Idempotent."""
        retiring, self._retiring = self._retiring, None
        if retiring is not None:
            self._finish(retiring)
