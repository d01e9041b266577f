"""Helpers for the toolset tests: the test servers as configurations, started for real."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flywheel.tools.descriptors import Registration
from flywheel.tools.registry import read_toolset
from flywheel.toolsets import McpHttp, McpStdio, PythonClass, ToolsetConfig

ROOT = Path(__file__).resolve().parents[2]
SERVER = str(ROOT / "tests" / "support" / "mcp_toolserver.py")
NOTES = "tests.support.py_toolset:Notes"


def stdio(log: Path, **config: Any) -> McpStdio:
    env = {"TOOLSERVER_LOG": str(log), **config.pop("env", {})}
    return McpStdio(command=sys.executable, args=[SERVER], env=env, **config)


def python(**config: Any) -> PythonClass:
    return PythonClass(target=NOTES, **config)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def http_server(log: Path, **config: Any) -> Iterator[tuple[McpHttp, subprocess.Popen[bytes]]]:
    """The test server over streamable HTTP, in a process of its own, and its config."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)],
                            env={**os.environ, "TOOLSERVER_LOG": str(log)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the MCP test server did not start") from None
                time.sleep(0.1)
        yield McpHttp(url=f"http://127.0.0.1:{port}/mcp", **config), proc
    finally:
        proc.terminate()
        proc.wait(10)


async def registered(name: str, config: ToolsetConfig) -> Registration:
    """The toolset read from its backend, as version 1 (what `flywheel tools add` stores)."""
    return (await read_toolset(name, config)).model_copy(update={"version": 1})


def received(log: Path) -> list[dict[str, Any]]:
    """Every call the test server(s) writing `log` received, in order."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
