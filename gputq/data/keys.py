"""Storage keys: how the rollout side names what it stores.

A key is unique within its unit and written once. Steps are stored under
:func:`step_key`, so the key says which rollout (partition), session and
model call the fields belong to, and a retried write of the same step
collides (a :class:`~gputq.errors.DuplicateKeyError`) instead of storing
the step twice.
"""

from __future__ import annotations

from gputq.errors import InvalidInputError

__all__ = ["step_key", "checked_name", "MAX_KEY_BYTES"]

#: The longest key (or partition name) accepted, in UTF-8 bytes: names travel in control frames,
#: read requests and key listings, which a few very long ones would fill.
MAX_KEY_BYTES = 1024


def checked_name(value, what: str) -> str:
    """``value`` if it is a key or partition name a unit can store: a non-empty str of valid UTF-8 text
    (no lone surrogates) of at most :data:`MAX_KEY_BYTES` bytes; else ``InvalidInputError`` naming it."""
    if not isinstance(value, str) or not value:
        raise InvalidInputError(f"{what} must be a non-empty str, got {value!r}")
    try:
        nbytes = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"{what} {value!r} is not valid UTF-8 text: {exc.reason} at index "
                                f"{exc.start}") from None
    if nbytes > MAX_KEY_BYTES:
        raise InvalidInputError(f"{what} {value[:32]!r}... is {nbytes} bytes of UTF-8, more than "
                                f"{MAX_KEY_BYTES}")
    return value


def step_key(partition: str, session_id: str, step_index: int) -> str:
    """The storage key of one step's fields."""
    return f"{partition}/{session_id}/{step_index}"
