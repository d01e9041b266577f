"""A Python toolset served over MCP (stdio or streamable HTTP), with the reset protocol.

    python -m flywheel.tools.mcp_serve package.module:Class [--http PORT [--host HOST]]

Each episode (the session key in a call's `_meta`) gets an instance of its own: created by
`flywheel_reset` (or on its first call), snapshotted by `flywheel_state`, dropped by
`flywheel_close`. Tools, schemas and validation are the Python toolset's
(`flywheel.tools.python_backend`); a destructive tool is announced with `destructiveHint`.
This is how the bundled `workplace` world is served to an agent over MCP, and what
`flywheel bench tools` measures the MCP round trip against.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from flywheel.tools.python_backend import PythonBackend, PythonSession, tools_of
from flywheel.toolsets import (
    CLOSE_TOOL,
    RESET_TOOL,
    SESSION_META_KEY,
    STATE_TOOL,
    PythonClass,
)

CALL_TIMEOUT_S = 300.0


def build_server(target: str) -> Any:
    """An `mcp` low-level `Server` serving the Python toolset at `target`."""
    import mcp_types as types
    from mcp.server.lowlevel import Server

    backend = PythonBackend(target, PythonClass(target=target))
    tools = tools_of(backend._load())[0]
    sessions: dict[str, PythonSession] = {}
    empty = {"type": "object", "properties": {}}
    listed = [types.Tool(name=t.name, description=t.description, input_schema=t.parameters,
                         annotations=types.ToolAnnotations(
                             destructive_hint=t.marked_destructive)) for t in tools]
    listed += [types.Tool(name=RESET_TOOL, description="Start the episode on a state.",
                          input_schema={"type": "object",
                                        "properties": {"initial_state": {}}}),
               types.Tool(name=STATE_TOOL, description="The episode's state.",
                          input_schema=empty),
               types.Tool(name=CLOSE_TOOL, description="End the episode.", input_schema=empty)]

    def text(value: str, error: bool = False) -> Any:
        return types.CallToolResult(content=[types.TextContent(type="text", text=value)],
                                    is_error=error)

    async def session(key: str, initial: dict[str, Any] | None = None,
                      fresh: bool = False) -> PythonSession:
        if fresh or key not in sessions:
            sessions[key] = await backend.open(key, initial, CALL_TIMEOUT_S)
        return sessions[key]

    async def list_tools(ctx: Any, params: Any) -> Any:
        return types.ListToolsResult(tools=listed)

    async def call_tool(ctx: Any, params: Any) -> Any:
        key = str((ctx.meta or {}).get(SESSION_META_KEY, "-"))
        args = dict(params.arguments or {})
        if params.name == RESET_TOOL:
            await session(key, args.get("initial_state"), fresh=True)
            return text("reset")
        if params.name == STATE_TOOL:
            return text(json.dumps(await (await session(key)).state()))
        if params.name == CLOSE_TOOL:
            sessions.pop(key, None)
            return text("closed")
        if params.name not in {t.name for t in tools}:
            return text(f"unknown tool {params.name!r}", error=True)
        result = await (await session(key)).call(params.name, args, CALL_TIMEOUT_S)
        return text(result.text, error=result.status != "ok")

    return Server(target.rsplit(":", 1)[-1], on_list_tools=list_tools,
                  on_call_tool=call_tool)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="package.module:Class")
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    server = build_server(args.target)
    import anyio

    if args.http is None:
        from mcp.server.stdio import stdio_server

        async def stdio() -> None:
            async with stdio_server() as (read, write):
                await server.run(read, write, server.create_initialization_options())

        anyio.run(stdio)
        return
    import uvicorn

    app = server.streamable_http_app(host=args.host)
    uvicorn.run(app, host=args.host, port=args.http, log_level="warning")


if __name__ == "__main__":
    main()
