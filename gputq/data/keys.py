"""Storage keys: how the rollout side names what it stores.

A key is unique within its unit and written once. Steps are stored under
:func:`step_key`, so the key says which rollout (partition), session and
model call the fields belong to, and a retried write of the same step
collides (a :class:`~gputq.errors.DuplicateKeyError`) instead of storing
the step twice.
"""

from __future__ import annotations

__all__ = ["step_key"]


def step_key(partition: str, session_id: str, step_index: int) -> str:
    """The storage key of one step's fields."""
    return f"{partition}/{session_id}/{step_index}"
