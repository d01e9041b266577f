"""Calls that cannot do harm: which of a toolset's tools are destructive, and which may run live.

A tool is destructive when its backend marks it (MCP `destructiveHint: true`, `x-unsafe:
true` in a declared schema, a Python method marked `@destructive`), when the toolset's
`deny` list names it, or — `unannotated_destructive`, on by default — when an MCP server
says nothing about its side effects (MCP's own default reading: such a tool may be
destructive). `readOnlyHint: true` alone never makes a tool destructive. A destructive tool
runs live only when the toolset's `allow_destructive` names it (or is `["*"]`); any other
call to it is refused before it reaches the backend and is an unsafe action (reward 0). MCP
annotations are hints from the server: the deny list is how a user overrides a server that
under-declares.
"""

from __future__ import annotations

from flywheel.tools.descriptors import Registration, ToolDescriptor
from flywheel.toolsets import ToolsetConfig


def is_destructive(tool: ToolDescriptor, config: ToolsetConfig) -> bool:
    if tool.name in config.deny or tool.marked_destructive:
        return True
    if tool.annotations.get("readOnlyHint") is True:
        return False
    # Only an MCP server's silence means "may be destructive"; a Python class marks its
    # destructive methods itself (`@destructive`), so an unmarked method is not.
    return config.kind != "python" and config.unannotated_destructive and not tool.annotated


def allowed_live(name: str, config: ToolsetConfig) -> bool:
    return "*" in config.allow_destructive or name in config.allow_destructive


def unsafe_tools(registration: Registration) -> set[str]:
    """Tools a call to which is refused and scored an unsafe action."""
    cfg = registration.config
    return {t.name for t in registration.tools
            if is_destructive(t, cfg) and not allowed_live(t.name, cfg)}
