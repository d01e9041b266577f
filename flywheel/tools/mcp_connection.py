"""One MCP client connection (the official `mcp` SDK's `Client`), owned by a task of its own.

The SDK's transports are anyio context managers: they must be left in the task that entered
them. Episodes open, call and close from whatever task the rollout loop runs them in, so
each connection lives in a task that enters the `Client`, reports ready, and leaves when
told to; any task may call through it meanwhile (the SDK multiplexes requests by JSON-RPC
id). Over stdio the connection owns the server process: closing it stops the server.

`connect_error` turns what the SDK raises while connecting into one line that names what
failed: the command could not start, the server exited (with its last stderr line), the URL
did not answer, or the server speaks a protocol version this SDK does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from typing import IO, Any, TextIO, cast

from flywheel.toolsets import McpHttp, McpStdio, expand_env


def _stdio_params(config: McpStdio) -> Any:
    from mcp import StdioServerParameters

    env = {k: expand_env(v, dict(os.environ)) for k, v in config.env.items()}
    return StdioServerParameters(command=config.command, args=list(config.args),
                                 env=env or None, cwd=config.cwd)


class McpConnection:
    """`await start()`, use `client`, `await close()`; `broken` once the server went away."""

    def __init__(self, config: McpStdio | McpHttp) -> None:
        self.config = config
        self.client: Any = None
        self.broken = False
        self._ready: asyncio.Future[None] | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._errlog: IO[str] | None = None
        self._said = ""

    @property
    def protocol_version(self) -> str | None:
        return self.client.protocol_version if self.client is not None else None

    async def start(self, timeout: float) -> None:
        """Connect (and, over stdio, start the server); raise what connecting raised."""
        self._ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(), name=f"mcp:{_label(self.config)}")
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except BaseException:
            await self.close()
            raise

    async def _run(self) -> None:
        from mcp import Client

        assert self._ready is not None
        try:
            async with contextlib.AsyncExitStack() as stack:
                if isinstance(self.config, McpStdio):
                    self._errlog = stack.enter_context(tempfile.TemporaryFile("w+"))
                    server: Any = _StdioTransport(_stdio_params(self.config), self._errlog)
                else:
                    server = await stack.enter_async_context(_http_transport(self.config))
                try:
                    self.client = await stack.enter_async_context(Client(server, cache=None))
                except BaseException:
                    self._said = self.stderr_tail()  # before the log file is closed
                    raise
                self._ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:  # handed to start(); after it, the calls see it
            self.broken = True
            if not self._ready.done():
                self._ready.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self.client = None

    def stderr_tail(self, lines: int = 3) -> str:
        """The server's last stderr lines (stdio only), for error messages."""
        if self._errlog is None or self._errlog.closed:
            return self._said
        with contextlib.suppress(OSError, ValueError):
            self._errlog.flush()
            self._errlog.seek(0)
            tail = [line.rstrip() for line in self._errlog.read().splitlines() if line.strip()]
            return " | ".join(tail[-lines:])
        return ""

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 10)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            except Exception:
                pass  # the connection is going away either way
        self.broken = True


class _StdioTransport:
    """`stdio_client` with the server's stderr captured (named in errors, not printed)."""

    def __init__(self, params: Any, errlog: IO[str]) -> None:
        from mcp.client.stdio import stdio_client

        self._cm = stdio_client(params, errlog=cast(TextIO, errlog))

    async def __aenter__(self) -> Any:
        return await self._cm.__aenter__()

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._cm.__aexit__(*exc)


@contextlib.asynccontextmanager
async def _http_transport(config: McpHttp) -> Any:
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    headers = {k: expand_env(v, dict(os.environ)) for k, v in config.headers.items()}
    timeout = httpx2.Timeout(config.open_timeout_s, read=max(config.call_timeout_s * 2, 60.0))
    async with httpx2.AsyncClient(headers=headers, timeout=timeout) as http:
        yield streamable_http_client(config.url, http_client=http)


def _label(config: McpStdio | McpHttp) -> str:
    return config.command if isinstance(config, McpStdio) else config.url


def connect_error(config: McpStdio | McpHttp, exc: BaseException, stderr: str = "") -> str:
    """What failed, in words (the exception's own text kept)."""
    from mcp.shared.exceptions import MCPError

    where = (f"MCP server `{' '.join([config.command, *config.args])}`"
             if isinstance(config, McpStdio) else f"MCP server at {config.url}")
    said = f" (its stderr: {stderr})" if stderr else ""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, KeyError):
        return f"{where}: {exc.args[0]}"
    if isinstance(exc, TimeoutError):
        return f"{where} did not answer within {config.open_timeout_s:g}s{said}"
    if isinstance(exc, FileNotFoundError | PermissionError):
        return f"{where} could not be started: {text}"
    if "Unsupported protocol version" in text or "protocol version" in text.lower() or (
            isinstance(exc, MCPError) and exc.code == -32022):
        from mcp_types.version import KNOWN_PROTOCOL_VERSIONS

        return (f"{where} speaks an MCP protocol version this client does not: {text} "
                f"(mcp SDK {_sdk_version()} speaks {', '.join(KNOWN_PROTOCOL_VERSIONS)})")
    if isinstance(exc, MCPError) and exc.code == -32000:
        return f"{where} closed the connection before the MCP handshake finished{said}"
    if isinstance(exc, MCPError):
        return f"{where} refused the MCP handshake: {text}{said}"
    if isinstance(exc, BaseExceptionGroup):
        inner = exc.exceptions[0] if exc.exceptions else exc
        return connect_error(config, inner, stderr)
    return f"{where} is unreachable: {type(exc).__name__}: {text}{said}"


def _sdk_version() -> str:
    from importlib.metadata import version

    return version("mcp")
