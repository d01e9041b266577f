"""Environments: task data + tools + a verifier, loaded as plugins by name.

Plugins register under the entry-point group `flywheel.environments` (name → a class or
factory returning an `Environment`). The built-ins are `tool_call`, `workplace`, `code` and
`judge` (see pyproject.toml). Importing this package imports no environment; they load on
demand.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from flywheel.environments.base import Environment
from flywheel.environments.profile import profile_rewards
from flywheel.errors import PermanentError

GROUP = "flywheel.environments"

__all__ = ["GROUP", "Environment", "UnknownEnvironment", "available_environments",
           "load_environment", "profile_rewards"]


class UnknownEnvironment(PermanentError, LookupError):
    """No plugin of that name is installed."""


def available_environments() -> list[str]:
    return sorted({ep.name for ep in entry_points(group=GROUP)})


def load_environment(name: str) -> Environment:
    """A fresh instance of environment plugin `name` (its own session state)."""
    found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not found:
        raise UnknownEnvironment(
            f"unknown environment {name!r}; available: {', '.join(available_environments())}"
            f" (plugins register under the entry-point group {GROUP!r}; after adding one, "
            f"reinstall the package that declares it)")
    factory = found[0].load()
    env = factory()
    if not isinstance(env, Environment):
        raise TypeError(f"entry point {found[0].value!r} for environment {name!r} built a "
                        f"{type(env).__name__}, not a flywheel Environment")
    return env
