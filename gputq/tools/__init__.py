"""The tools: the ``gputq`` CLI, the demo and its scenarios, stats, info, capacity, synthetic rollouts.

The top layer: anything here may import any room below, nothing below
imports from here.
"""

__all__: list[str] = []
