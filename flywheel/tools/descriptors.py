"""What a toolset offers, as read from its backend at registration: tools and registrations.

A `ToolDescriptor` keeps what the backend said about a tool — name, description, the JSON
schema of its arguments, MCP annotations as given (`destructiveHint`, `readOnlyHint`, …) —
and whether the backend marked it destructive. `openai_tool` is the flat OpenAI function
tool the model is offered (`{"type": "function", "name", "description", "parameters"}`), with
`x-unsafe: true` on a tool the toolset may not run live, so verifiers and the gate count a
call to it as an unsafe action. A `Registration` is one version of a toolset.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flywheel.toolsets import PROTOCOL_TOOLS, STATE_TOOL, ToolsetConfig, masked


class ToolDescriptor(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object",
                                                                  "properties": {}})
    annotations: dict[str, Any] = Field(default_factory=dict)
    """MCP tool annotations as the server sent them (camelCase keys)."""
    marked_destructive: bool = False
    """The backend says so: `destructiveHint: true`, `x-unsafe: true` in a declared schema,
    or a Python method marked `@destructive`."""

    @property
    def annotated(self) -> bool:
        """Whether the backend said anything about side effects."""
        return any(k in self.annotations for k in ("destructiveHint", "readOnlyHint"))


class Registration(BaseModel):
    """One version of a toolset: its configuration and the tools read at registration."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    version: int
    config: ToolsetConfig
    tools: list[ToolDescriptor]
    protocol_version: str | None = None
    """The MCP protocol version negotiated when the tools were read (None: Python)."""
    protocol_tools: list[str] = Field(default_factory=list)
    """Reset-protocol tools the server lists (`flywheel_reset`, `flywheel_state`, …)."""

    def tool(self, name: str) -> ToolDescriptor | None:
        return next((t for t in self.tools if t.name == name), None)

    @property
    def has_state(self) -> bool:
        """Whether the backend can snapshot an episode's state (end-state checks)."""
        return STATE_TOOL in self.protocol_tools


def from_mcp(tool: Any) -> ToolDescriptor:
    """A descriptor from an MCP `Tool` (any protocol revision the SDK parses)."""
    annotations = (tool.annotations.model_dump(by_alias=True, exclude_none=True)
                   if tool.annotations is not None else {})
    schema = dict(tool.input_schema) if not isinstance(tool.input_schema, BaseModel) \
        else tool.input_schema.model_dump(by_alias=True, exclude_none=True)
    schema.pop("title", None)  # the SDK's generated "<name>Arguments" says nothing to a model
    marked = annotations.get("destructiveHint") is True or schema.get("x-unsafe") is True
    return ToolDescriptor(name=tool.name, description=tool.description or "",
                          parameters=schema, annotations=annotations, marked_destructive=marked)


def split_protocol(tools: list[ToolDescriptor]) -> tuple[list[ToolDescriptor], list[str]]:
    """(the tools a model may be offered, the reset-protocol tools listed)."""
    offered = [t for t in tools if t.name not in PROTOCOL_TOOLS]
    return offered, sorted(t.name for t in tools if t.name in PROTOCOL_TOOLS)


def openai_tool(tool: ToolDescriptor, *, unsafe: bool) -> dict[str, Any]:
    flat: dict[str, Any] = {"type": "function", "name": tool.name,
                            "description": tool.description, "parameters": tool.parameters}
    if unsafe:
        flat["x-unsafe"] = True
    return flat


def public_config(config: ToolsetConfig) -> dict[str, Any]:
    """The configuration as the event log and `show` keep it: secrets masked."""
    data = config.model_dump(mode="json")
    for key in ("headers", "env"):
        if isinstance(data.get(key), dict):
            data[key] = {k: masked(v) for k, v in data[key].items()}
    return data


def digest(config: ToolsetConfig, tools: list[ToolDescriptor], protocol_tools: list[str]
           ) -> str:
    """What makes a version: the configuration and everything read about the tools."""
    body = {"config": config.model_dump(mode="json"),
            "tools": [t.model_dump(mode="json") for t in tools], "protocol": protocol_tools}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
