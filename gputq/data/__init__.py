"""The data model: references, fields, trajectories and storage keys.

What the rollout side composes and the trainer side resolves: a
:class:`~gputq.data.refs.FieldRef` names one stored blob, a
:class:`~gputq.data.refs.Layout` one target tensor, and sessions, steps and
segments (:mod:`gputq.data.trajectory`) hold only those. Pure Python and
numpy; imports nothing of gputq but :mod:`gputq.errors`.
"""

__all__: list[str] = []
