"""The names a gputq deployment has on Ray, and Ray itself, loaded when first needed.

The controller is the named actor :data:`CONTROLLER_NAME` in the
:data:`NAMESPACE` namespace, and each unit ``<controller>/<unit>``
(:func:`unit_actor_name`), so tools such as ``gputq stats`` can attach to a
running job. Everything that talks to Ray imports it through
:func:`import_ray`, so ``import gputq`` works where Ray is not installed.
"""

from __future__ import annotations

from gputq.errors import MissingDependencyError

__all__ = ["CONTROLLER_NAME", "NAMESPACE", "unit_actor_name", "import_ray"]

CONTROLLER_NAME = "gputq-controller"
NAMESPACE = "gputq"


def unit_actor_name(unit: str, controller_name: str = CONTROLLER_NAME) -> str:
    """The Ray actor name of ``unit`` (in :data:`NAMESPACE`)."""
    return f"{controller_name}/{unit}"


def import_ray():
    """The ``ray`` module; :class:`~gputq.errors.MissingDependencyError` saying what to install if absent."""
    try:
        import ray
    except ImportError:
        raise MissingDependencyError("this needs Ray: pip install 'gputq[ray]'") from None
    return ray
