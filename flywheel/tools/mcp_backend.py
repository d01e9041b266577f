"""MCP toolsets through the official `mcp` SDK: stdio (a command) and streamable HTTP (a URL).

Sessions. Over stdio with `sessions="process"` every episode starts its own server process
(closing the episode stops it), so no two episodes can share state whatever the server
does; at most `start_bound` of them start at once (`McpStdio.max_starting`). Over HTTP, and
over stdio with `sessions="shared"`, one connection serves every
episode of the toolset in this process, and the episodes are kept apart by the reset
protocol (`flywheel.toolsets`): each call carries the episode's key in `_meta`, and a
server that lists `flywheel_reset` is reset to the episode's initial state first. A shared
server that lists no reset tool is refused unless every tool it offers is read-only — it
could not keep two episodes apart. A connection that breaks (the server died) fails the
calls in flight as not run; the next episode opens a new one.

A call's `isError` result is the tool message's text (status `error`); the per-call timeout
is a `timeout` message; a JSON-RPC error the server answered (unknown tool, invalid params)
is an `error` message too — the server spoke, the model's call was wrong. A closed
connection or a transport failure is `RolloutNotRun("toolset_unavailable")`.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, cast

from flywheel.tasks import RolloutNotRun
from flywheel.tools.backend import (
    CallResult,
    Described,
    ToolsetError,
    timeout_result,
    unavailable,
)
from flywheel.tools.descriptors import Registration, from_mcp
from flywheel.tools.mcp_connection import McpConnection, connect_error
from flywheel.toolsets import (
    CLOSE_TOOL,
    RESET_TOOL,
    SESSION_META_KEY,
    STATE_TOOL,
    McpHttp,
    McpStdio,
)

_CLOSED, _TIMEOUT = -32000, -32001


def result_text(result: Any) -> str:
    """A `CallToolResult` as the tool message: its text blocks, else its structured content,
    else a note of what it held."""
    texts = [block.text for block in result.content if getattr(block, "type", "") == "text"]
    if texts:
        return "\n".join(texts)
    if result.structured_content is not None:
        return json.dumps(result.structured_content)
    kinds = sorted({getattr(block, "type", "?") for block in result.content})
    return f"[{', '.join(kinds)} content]" if kinds else ""


class McpBackend:
    def __init__(self, name: str, config: McpStdio | McpHttp,
                 registration: Registration | None = None) -> None:
        self.name, self.config, self.registration = name, config, registration
        self._shared: McpConnection | None = None
        self._lock = asyncio.Lock()

    @property
    def _per_process(self) -> bool:
        return isinstance(self.config, McpStdio) and self.config.sessions == "process"

    @property
    def start_bound(self) -> int | None:
        """Sessions that may start at once in this process (`McpStdio.max_starting`, else
        the cores): only per-episode server processes are bounded; None otherwise."""
        if not self._per_process:
            return None
        asked = cast(McpStdio, self.config).max_starting
        if asked is not None:
            return asked
        try:
            return len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return os.cpu_count() or 1

    async def describe(self, timeout: float) -> Described:
        conn = McpConnection(self.config)
        try:
            await conn.start(timeout)
            listed = await asyncio.wait_for(list_all_tools(conn.client), timeout)
            return Described([from_mcp(t) for t in listed], conn.protocol_version)
        except Exception as exc:
            raise ToolsetError(connect_error(self.config, exc, conn.stderr_tail())) from exc
        finally:
            await conn.close()

    async def open(self, key: str, initial_state: dict[str, Any] | None,
                   timeout: float) -> McpSession:
        reg = self._registration()
        if not self._per_process and RESET_TOOL not in reg.protocol_tools and not all(
                t.annotations.get("readOnlyHint") is True for t in reg.tools):
            raise unavailable(self.name, f"its server lists no {RESET_TOOL} tool, so episodes "
                              "on one shared server would share state; implement the reset "
                              "protocol (docs/TOOLS.md) or use sessions=process over stdio")
        if initial_state is not None and RESET_TOOL not in reg.protocol_tools:
            raise unavailable(self.name, f"the episode starts from an initial state but its "
                              f"server lists no {RESET_TOOL} tool to load it")
        conn = await self._connection(timeout)
        session = McpSession(self, conn, key, owns=self._per_process)
        try:
            if RESET_TOOL in reg.protocol_tools:
                reply = await session.call(RESET_TOOL, {"initial_state": initial_state},
                                               timeout)
                if reply.status != "ok":
                    raise unavailable(self.name, f"{RESET_TOOL} failed: {reply.text[:300]}")
        except BaseException:
            await session.close()
            raise
        return session

    def _registration(self) -> Registration:
        if self.registration is None:
            raise RuntimeError(f"toolset {self.name!r}: sessions need a registration (its "
                               "tools read by describe)")
        return self.registration

    async def _connection(self, timeout: float) -> McpConnection:
        if self._per_process:
            return await self._connect(timeout)
        async with self._lock:
            if self._shared is None or self._shared.broken:
                if self._shared is not None:  # its episodes have failed already: reap it
                    await self._shared.close()
                self._shared = await self._connect(timeout)
            return self._shared

    async def _connect(self, timeout: float) -> McpConnection:
        conn = McpConnection(self.config)
        try:
            await conn.start(timeout)
            await asyncio.wait_for(list_all_tools(conn.client), timeout)  # the SDK checks results
        except Exception as exc:                                       # against the listing
            await conn.close()
            raise unavailable(self.name, connect_error(self.config, exc,
                                                       conn.stderr_tail())) from exc
        return conn

    async def aclose(self) -> None:
        if self._shared is not None:
            await self._shared.close()
            self._shared = None


async def list_all_tools(client: Any) -> list[Any]:
    """Every tool an MCP client's server lists, page by page."""
    tools, cursor = [], None
    for _ in range(100):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            break
    return tools


class McpSession:
    def __init__(self, backend: McpBackend, conn: McpConnection, key: str, *,
                 owns: bool) -> None:
        self.backend, self.conn, self.key, self.owns = backend, conn, key, owns
        self._closed = False

    async def call(self, name: str, arguments: dict[str, Any], timeout: float) -> CallResult:
        """Any tool, the reset protocol's included (the session layer keeps those from the
        model), with the episode's key in `_meta`."""
        from mcp.shared.exceptions import MCPError

        client = self.conn.client
        if client is None or self.conn.broken:
            raise unavailable(self.backend.name, "the server connection is gone "
                              f"{self._stderr()}")
        try:
            # The SDK's read timeout is the per-call timeout; the outer bound only guards
            # against a transport that never returns.
            result = await asyncio.wait_for(
                client.call_tool(name, arguments, read_timeout_seconds=timeout,
                                 meta={SESSION_META_KEY: self.key}), timeout + 5.0)
        except MCPError as err:
            if err.code == _TIMEOUT:
                return timeout_result(name, timeout)
            if err.code == _CLOSED:
                self.conn.broken = True
                raise unavailable(self.backend.name, f"the server closed the connection "
                                  f"during {name}{self._stderr()}") from err
            return CallResult(f"error: {err.message}", "error")
        except TimeoutError:
            return timeout_result(name, timeout)
        except RolloutNotRun:
            raise
        except Exception as exc:  # transport failures, results that are not MCP
            self.conn.broken = True  # the next episode connects afresh
            raise unavailable(self.backend.name, f"{name} failed in transport: "
                              f"{type(exc).__name__}: {exc}"[:500]) from exc
        return CallResult(result_text(result), "error" if result.is_error else "ok")

    def _stderr(self) -> str:
        tail = self.conn.stderr_tail()
        return f" (server stderr: {tail})" if tail else ""

    async def state(self) -> dict[str, Any] | None:
        reg = self.backend._registration()
        if STATE_TOOL not in reg.protocol_tools:
            return None
        reply = await self.call(STATE_TOOL, {}, reg.config.call_timeout_s)
        if reply.status != "ok":
            raise unavailable(self.backend.name, f"{STATE_TOOL} failed: {reply.text[:300]}")
        try:
            state = json.loads(reply.text)
        except json.JSONDecodeError as exc:
            raise unavailable(self.backend.name, f"{STATE_TOOL} did not answer a JSON "
                              f"object: {reply.text[:200]!r}") from exc
        if not isinstance(state, dict):
            raise unavailable(self.backend.name, f"{STATE_TOOL} answered "
                              f"{type(state).__name__}, not a JSON object")
        return state

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        reg = self.backend.registration
        if not self.owns and reg is not None and CLOSE_TOOL in reg.protocol_tools \
                and not self.conn.broken:
            try:
                await self.call(CLOSE_TOOL, {}, reg.config.call_timeout_s)
            except RolloutNotRun:
                pass
        if self.owns:
            await self.conn.close()
