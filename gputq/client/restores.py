"""A stream's restores: a fetched micro-batch widened into output buffers and shaped for slime.

Restored ahead (on the host, ``prefetch >= 2``), a micro-batch's restore is
queued on the stream's restore thread once its fetch is done, and waits
there for a free set of output buffers while the consumer holds them all.

Nothing here refers to the stream: the work a stream queued on its threads
must not keep alive a stream its consumer dropped unclosed (a training step
that raised out of its loop), whose next restore would otherwise wait for
its consumer's buffers for ever. Once such a stream is garbage, its reader
stops its work, ends its leases and takes its threads back (see
:meth:`~gputq.client.read_context.ReadContext.track`); the restore waiting
for buffers then gives up.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from gputq.client.fetch import Fetched
from gputq.client.plan import MicroPlan
from gputq.client.shape import SlimeShaper
from gputq.client.stream_buffers import StreamBuffers

__all__ = ["Restores", "run_into", "drop_fetched"]


def run_into(future: Future, work: Callable, *args) -> None:
    """Run ``work(*args)`` into ``future``, unless it was cancelled first (the stream closed: its close ends
    the leases of fetches never restored)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(work(*args))
    except BaseException as exc:
        future.set_exception(exc)


def drop_fetched(fetch: Future) -> None:
    """Give back what a fetch that will not be restored holds (if it fetched anything)."""
    if fetch.done() and not fetch.cancelled() and fetch.exception() is None:
        fetch.result().drop()


class Restores:
    """Restore a stream's fetched micro-batches: ``((layers, routed_experts, fields), outputs)`` each.

    Parameters
    ----------
    shaper:
        The stream's widen and slime shaping.
    buffers:
        The stream's buffers: each restore takes a set of outputs.
    thread:
        The stream's restore thread, for restores ahead.
    """

    def __init__(self, shaper: SlimeShaper, buffers: StreamBuffers, thread: ThreadPoolExecutor):
        self._shaper, self._buffers, self._thread = shaper, buffers, thread

    def restore(self, plan: MicroPlan, fetched: Fetched, outputs: dict) -> tuple[tuple, dict]:
        """Restore fetched ``plan`` into ``outputs``. Its compact buffer goes back, its leases end.

        A failure ends the stream (whose close takes every buffer back), so ``outputs`` is not given back here.
        """
        # Shaped once the leases are confirmed: its checks must see the bytes the leases vouch for.
        widened = fetched.restore(lambda source: self._shaper.widen(plan, source, outputs), plan.nbytes)
        return self._shaper.shape(plan, widened), outputs

    def ahead(self, plan: MicroPlan, fetch: Future, restore: Future) -> None:
        """Restore ``plan`` into ``restore`` on the restore thread once ``fetch`` is done.

        Called before the fetch can start: the callback then always runs on
        the fetch thread, never on a consumer that came late. Queued then,
        not now: a task queued now would only wait for the fetch, and waking
        the idle thread for it costs the consumer (who queues the next fetch
        as it takes a micro-batch).
        """
        fetch.add_done_callback(lambda done: self._queue(plan, done, restore))

    def _queue(self, plan: MicroPlan, fetch: Future, restore: Future) -> None:
        try:
            self._thread.submit(run_into, restore, self._restore_ahead, plan, fetch)
        except BaseException as exc:  # the stream's threads are shut down: the consumer gets the error
            if restore.set_running_or_notify_cancel():
                drop_fetched(fetch)
                restore.set_exception(exc)

    def _restore_ahead(self, plan: MicroPlan, fetch: Future) -> tuple[tuple, dict]:
        fetched = fetch.result()
        try:
            outputs = self._buffers.take(self._buffers.outputs)
        except BaseException:
            drop_fetched(fetch)
            raise
        return self.restore(plan, fetched, outputs)
