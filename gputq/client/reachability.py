"""Which samples live on units that are lost now: asked before the data-parallel split, not mid-step.

A trainer otherwise learns that a unit is lost when a read fails in the
middle of a step, several micro-batches in, after the other data-parallel
ranks have trained on theirs. The rollout manager asks first
(:func:`unreachable_samples`, or ``Deployment.unreachable``) and drops or
rolls again the samples named; a stream refuses at its start when a unit it
needs is already known lost (:func:`refuse_lost`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from gputq.client.fanout import fan_out
from gputq.data.refs import Layout, checked_shard
from gputq.errors import UnitLostError

__all__ = ["unreachable_samples", "refuse_lost", "units_of"]


def units_of(sample: Mapping[str, Layout]) -> set[str]:
    """The units holding bytes one sample references."""
    return {ref.unit for layout in sample.values() for ref in layout.refs()}


def unreachable_samples(samples: Sequence[Mapping[str, Layout]], clients, *,
                        timeout: float | None = None) -> dict[int, list[str]]:
    """Per sample (by position) whose bytes live on a unit lost or unreachable now, those units.

    One probe per unit the samples use, all in parallel
    (:meth:`UnitClients.ping <gputq.client.clients.UnitClients.ping>`, within
    ``timeout``, default the config's ``probe_timeout_s``): a unit that does
    not answer is marked lost, a lost one that answers is re-admitted. A
    unit outside the membership counts as unreachable. Samples on live
    units are left out: an empty result means every sample can be read.
    """
    shard = checked_shard(samples)
    per_sample = [units_of(sample) for sample in shard]
    members = set(clients.units)
    needed = sorted(set().union(*per_sample)) if per_sample else []
    answered = fan_out([u for u in needed if u in members], lambda unit: clients.ping(unit, timeout))
    down = {unit for unit in needed if answered.get(unit) is not True}
    return {i: sorted(units & down) for i, units in enumerate(per_sample) if units & down}


def refuse_lost(shard: Sequence[Mapping[str, Layout]], lost: Mapping[str, str]) -> None:
    """Raise ``UnitLostError`` naming the samples of ``shard`` whose bytes live on a unit in ``lost``
    (unit -> why it is lost), before anything is read."""
    if not lost:  # the usual case: no sample's units need collecting (a stream opens on its step's path)
        return
    on_lost = {i: sorted(units_of(sample) & set(lost)) for i, sample in enumerate(shard)}
    on_lost = {i: units for i, units in on_lost.items() if units}
    if not on_lost:
        return
    units = sorted({unit for units in on_lost.values() for unit in units})
    samples = sorted(on_lost)
    raise UnitLostError(f"units {units} are lost ({lost[units[0]]}): samples {samples[:16]}"
                        f"{' ...' if len(samples) > 16 else ''} of the shard live there; drop them or roll them "
                        f"again before the split (Deployment.unreachable names them)", unit=units[0],
                        reason=lost[units[0]])
