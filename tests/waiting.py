"""Waiting in tests: on a condition, with a deadline, never a fixed sleep before an assert.

:func:`wait_until` is the one polling helper of the test suite. :func:`pause`
is for the few tests where time passing is itself the thing under test (a
client that stalls, an attacker that drips bytes); what such a test then
asserts is still awaited with :func:`wait_until`.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

__all__ = ["wait_until", "pause", "child_exit_code"]


def wait_until(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "the condition", *,
               interval: float = 0.005) -> Any:
    """Poll ``predicate`` until it returns something true, and return that.

    Parameters
    ----------
    predicate : callable
        Checked at once, then every ``interval`` seconds.
    timeout : float
        Seconds before giving up.
    what : str
        What is awaited, for the failure message.

    Raises
    ------
    AssertionError
        ``predicate`` did not hold within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(interval)


def pause(seconds: float) -> None:
    """Let ``seconds`` pass: a stall or a drip under test, never a wait for a result."""
    threading.Event().wait(seconds)


def child_exit_code(pid: int, timeout: float, what: str) -> int:
    """Wait for the forked child ``pid`` and return its exit code; kill it if it outlives ``timeout``."""

    def reaped():
        done, status = os.waitpid(pid, os.WNOHANG)
        return (status,) if done else None

    try:
        (status,) = wait_until(reaped, timeout, what)
    except AssertionError:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise
    return os.waitstatus_to_exitcode(status)
