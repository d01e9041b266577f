"""The workplace world as a toolset, served like any user's: a Python class, or over MCP.

`WorkplaceTools` is a Python toolset (`flywheel.tools.python_backend`) over the same world
and tool functions as the `workplace` environment (`workplace_world`): it declares the nine
tools' schemas (`flywheel_tools`, `tickets_purge` marked `x-unsafe`), `reset` loads an
episode's initial state, and `state()` is the canonical world (ids, `next_id` and order
left out), so any path to the same world has the same snapshot. Register it as

    flywheel tools add workplace --python flywheel.environments.workplace_tools:WorkplaceTools

or serve it over MCP (stdio, or streamable HTTP with `--http PORT`) and register that:

    python -m flywheel.tools.mcp_serve flywheel.environments.workplace_tools:WorkplaceTools
"""

from __future__ import annotations

from typing import Any

from flywheel.environments.workplace_world import (
    WORKPLACE_TOOLS,
    State,
    apply_call,
    canonical_state,
    normalize_state,
)


class WorkplaceTools:
    flywheel_tools = WORKPLACE_TOOLS

    def __init__(self) -> None:
        self._state: State = normalize_state({})

    def reset(self, initial_state: dict[str, Any] | None) -> None:
        self._state = normalize_state(initial_state or {})

    def state(self) -> State:
        return canonical_state(self._state)

    def _apply(self, name: str, arguments: dict[str, Any]) -> str:
        self._state, observation = apply_call(self._state, name, arguments)
        if observation.startswith("error:"):
            raise ValueError(observation.removeprefix("error:").strip())
        return observation

    def calendar_create_event(self, **arguments: Any) -> str:
        return self._apply("calendar_create_event", arguments)

    def calendar_delete_event(self, **arguments: Any) -> str:
        return self._apply("calendar_delete_event", arguments)

    def calendar_list_events(self, **arguments: Any) -> str:
        return self._apply("calendar_list_events", arguments)

    def email_send(self, **arguments: Any) -> str:
        return self._apply("email_send", arguments)

    def email_list_inbox(self, **arguments: Any) -> str:
        return self._apply("email_list_inbox", arguments)

    def tickets_create(self, **arguments: Any) -> str:
        return self._apply("tickets_create", arguments)

    def tickets_update(self, **arguments: Any) -> str:
        return self._apply("tickets_update", arguments)

    def tickets_list(self, **arguments: Any) -> str:
        return self._apply("tickets_list", arguments)

    def tickets_purge(self, **arguments: Any) -> str:
        return self._apply("tickets_purge", arguments)
