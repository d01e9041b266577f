"""The backend contract every toolset kind implements (MCP over stdio or HTTP, a Python class).

A backend reads its tools (`describe`, at registration and on `check`) and opens sessions:
one per episode, started on the episode's initial state. A session runs calls and may
snapshot its state. The split of blame is the contract's core:

* what the *model* did wrong — an unknown tool, arguments the tool rejects, a tool that
  raised or did not answer within the per-call timeout — is a `CallResult` with status
  `error` or `timeout`: its text goes back to the model as the tool message, as production
  would send it, and the episode goes on;
* what the *infrastructure* failed to do — the server is down, crashed, or answered
  something that is not MCP — raises `RolloutNotRun("toolset_unavailable")`: the attempt
  is not run (retried, masked from training, counted), never scored 0.

`ToolsetError` is for registration and `check`: the message names what failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from flywheel.errors import PermanentError
from flywheel.tasks import RolloutNotRun
from flywheel.tools.descriptors import ToolDescriptor


class ToolsetError(PermanentError):
    """A toolset could not be reached or read; the message says which and why."""


@dataclass(frozen=True)
class CallResult:
    text: str
    status: Literal["ok", "error", "timeout"] = "ok"


@dataclass(frozen=True)
class Described:
    """What a backend says about itself."""

    tools: list[ToolDescriptor]
    """Every tool it lists, the reset protocol's included."""
    protocol_version: str | None = None


def unavailable(toolset: str, what: str) -> RolloutNotRun:
    return RolloutNotRun("toolset_unavailable", f"toolset {toolset!r}: {what}")


def timeout_result(name: str, seconds: float) -> CallResult:
    return CallResult(f"error: {name} did not answer within {seconds:g}s (timed out)",
                      "timeout")


class BackendSession(Protocol):
    async def call(self, name: str, arguments: dict[str, Any], timeout: float) -> CallResult:
        """Run one call; raise `RolloutNotRun` only for an infrastructure failure."""

    async def state(self) -> dict[str, Any] | None:
        """The episode's state (None: this backend keeps no snapshot)."""

    async def close(self) -> None:
        """End the episode (idempotent, never raises)."""


class Backend(Protocol):
    async def describe(self, timeout: float) -> Described:
        """Read the tools; raise `ToolsetError` naming what failed."""

    async def open(self, key: str, initial_state: dict[str, Any] | None,
                   timeout: float) -> BackendSession:
        """A session of its own for episode `key`, on `initial_state` (None: the backend's
        own fresh state); raise `RolloutNotRun` when it cannot be started."""

    async def aclose(self) -> None:
        """Release what the backend shares between sessions (a server connection)."""
