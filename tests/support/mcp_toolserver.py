"""A stateful MCP server built with the `mcp` SDK's own server side (`MCPServer`), for tests.

The world is small — notes and a counter — and kept per episode under the session key each
call carries in `_meta` (`io.flywheel/session`), the reset protocol of docs/TOOLS.md, so one
shared server (HTTP, or stdio with `sessions=shared`) keeps episodes apart and a server
process per episode works the same way. Every call it receives is appended, one JSON line
each, to the file named by `TOOLSERVER_LOG` (tool, arguments, session key, pid): the tests
read that record to see what reached the server, destructive calls above all.

    python tests/support/mcp_toolserver.py            # stdio
    python tests/support/mcp_toolserver.py http PORT  # streamable HTTP on 127.0.0.1:PORT/mcp
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

app = MCPServer("flywheel-test-notes")
WORLDS: dict[str, dict[str, Any]] = {}
KEYLESS = os.environ.get("TOOLSERVER_KEYLESS") == "1"
"""One world for every caller and no reset protocol: a server that cannot keep episodes
apart (fine one process per episode, refused as a shared server)."""


def _key(ctx: Context) -> str:
    meta = ctx.request_context.meta or {}
    return "-" if KEYLESS else str(meta.get("io.flywheel/session", "-"))


def _record(tool: str, arguments: dict[str, Any], ctx: Context) -> dict[str, Any]:
    path = os.environ.get("TOOLSERVER_LOG")
    if path:
        line = json.dumps({"tool": tool, "arguments": arguments, "session": _key(ctx),
                           "pid": os.getpid()}) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    return WORLDS.setdefault(_key(ctx), {"notes": [], "counter": 0})


@app.tool(annotations=ToolAnnotations(destructive_hint=False))
def add_note(text: str, ctx: Context) -> str:
    """Add a note."""
    world = _record("add_note", {"text": text}, ctx)
    world["notes"].append(text)
    return f"added note {len(world['notes'])}"


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
def list_notes(ctx: Context) -> str:
    """List the notes."""
    return json.dumps(_record("list_notes", {}, ctx)["notes"])


@app.tool(annotations=ToolAnnotations(destructive_hint=False))
def bump(by: int, ctx: Context) -> str:
    """Add `by` to the counter and say its new value."""
    world = _record("bump", {"by": by}, ctx)
    world["counter"] += by
    return f"counter is {world['counter']}"


@app.tool(annotations=ToolAnnotations(destructive_hint=True))
def wipe_notes(ctx: Context) -> str:
    """Delete every note. Irreversible."""
    world = _record("wipe_notes", {}, ctx)
    count = len(world["notes"])
    world["notes"] = []
    return f"deleted {count} notes"


@app.tool()
def clear_counter(ctx: Context) -> str:
    """Set the counter to zero (the server says nothing about its side effects)."""
    world = _record("clear_counter", {}, ctx)
    world["counter"] = 0
    return "counter is 0"


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
async def sleep(seconds: float, ctx: Context) -> str:
    """Wait, then answer (a tool that hangs)."""
    _record("sleep", {"seconds": seconds}, ctx)
    await asyncio.sleep(seconds)
    return "awake"


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
def whoami(ctx: Context) -> str:
    """This server's process id."""
    _record("whoami", {}, ctx)
    return str(os.getpid())


def flywheel_reset(ctx: Context, initial_state: dict[str, Any] | None = None) -> str:
    state = initial_state or {}
    _record("flywheel_reset", {"initial_state": state}, ctx)
    WORLDS[_key(ctx)] = {"notes": list(state.get("notes", [])),
                         "counter": int(state.get("counter", 0))}
    return "reset"


def flywheel_state(ctx: Context) -> str:
    return json.dumps(WORLDS.get(_key(ctx), {"notes": [], "counter": 0}))


def flywheel_close(ctx: Context) -> str:
    WORLDS.pop(_key(ctx), None)
    return "closed"


if not KEYLESS:
    for protocol_tool in (flywheel_reset, flywheel_state, flywheel_close):
        app.tool()(protocol_tool)


def _slow_start() -> None:
    """`TOOLSERVER_START_DELAY` seconds before serving (a server slow to start), its start
    and end (CLOCK_MONOTONIC, shared by the machine's processes) appended to
    `TOOLSERVER_STARTS`."""
    import time

    delay = float(os.environ.get("TOOLSERVER_START_DELAY", "0"))
    began = time.monotonic()
    time.sleep(delay)
    path = os.environ.get("TOOLSERVER_STARTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "began": began,
                                "ready": time.monotonic()}) + "\n")


if __name__ == "__main__":
    _slow_start()
    if sys.argv[1:2] == ["http"]:
        app.settings.log_level = "WARNING"
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
