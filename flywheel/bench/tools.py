"""`flywheel bench tools`: toolset sessions — MCP (stdio, HTTP) against the Python toolset.

All legs run the bundled workplace world (`flywheel.environments.workplace_tools`), as a
Python toolset called in-process and served over MCP by `flywheel.tools.mcp_serve` (stdio,
and streamable HTTP on 127.0.0.1), in one run:

* **round trip** — one session, `calls` sequential read-only calls (`tickets_list`) after a
  warm-up: the median time of one call through the session layer on each backend, and of
  the class's method called directly (the floor);
* **episodes/s** — the same scripted episode (open on an initial state, four calls, the
  end-state snapshot, close) `episodes` times with N in flight and with one at a time, on
  each MCP transport: stdio with one shared server, HTTP, and stdio with a server process
  per episode (`sessions=process`, what isolation costs);
* **memory** — 32 stdio sessions in flight, a server process each: the servers' resident
  memory (RSS, and PSS where the kernel reports it: RSS counts shared pages once per
  process).

No model is involved: this measures the tools, not the policy. The load average before and
after is in the result: on a shared machine the figures move with it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

from flywheel.environments.workplace_tools import WorkplaceTools
from flywheel.tools.descriptors import Registration
from flywheel.tools.registry import read_toolset
from flywheel.tools.runtime import ToolsetRuntime
from flywheel.tools.session import EpisodePlan, ToolSession
from flywheel.toolsets import McpHttp, McpStdio, PythonClass, ToolsetConfig

TARGET = "flywheel.environments.workplace_tools:WorkplaceTools"
INITIAL = {"tickets": {"items": [{"id": "tkt-1", "title": "Printer jammed", "priority": 3,
                                  "status": "open", "assignee": None}]}}
EPISODE: list[tuple[str, dict[str, Any]]] = [
    ("tickets_update", {"ticket_id": "tkt-1", "status": "closed"}),
    ("tickets_create", {"title": "Toner low", "priority": 2}),
    ("email_send", {"to": "ana@example.com", "subject": "Printer fixed"}),
    ("tickets_list", {})]


def _stdio(sessions: Literal["process", "shared"]) -> McpStdio:
    return McpStdio(command=sys.executable, args=["-m", "flywheel.tools.mcp_serve", TARGET],
                    sessions=sessions, max_sessions=256)


async def _registered(name: str, config: ToolsetConfig) -> Registration:
    return (await read_toolset(name, config)).model_copy(update={"version": 1})


async def _open_one(runtime: ToolsetRuntime, key: str) -> ToolSession:
    (session,) = await runtime.open_sessions([EpisodePlan(key=key, initial_state=INITIAL)])
    if not isinstance(session, ToolSession):
        raise RuntimeError(f"{runtime.name}: {session}")
    return session


def _median_us(times: list[float]) -> float:
    return round(statistics.median(times) * 1e6, 1)


async def round_trip(reg: Registration, calls: int) -> float:
    """Median µs of one read-only call through the session layer (the median: the shared
    machine's other work lands on a few calls, not on the typical one)."""
    runtime = ToolsetRuntime(reg)
    session = await _open_one(runtime, "rt")
    try:
        for _ in range(20):
            await session.call("tickets_list", {})
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            await session.call("tickets_list", {})
            times.append(time.perf_counter() - started)
        return _median_us(times)
    finally:
        await runtime.close_session(session)
        await runtime.aclose()


def direct_call(calls: int) -> float:
    """Median µs of the Python toolset's method called directly (no session layer)."""
    tools = WorkplaceTools()
    tools.reset(INITIAL)
    for _ in range(20):
        tools.tickets_list()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        tools.tickets_list()
        times.append(time.perf_counter() - started)
    return _median_us(times)


async def _episode(runtime: ToolsetRuntime, key: str) -> None:
    session = await _open_one(runtime, key)
    try:
        for name, arguments in EPISODE:
            step = await session.call(name, arguments)
            if step.step.status != "ok":
                raise RuntimeError(f"{name}: {step.observation}")
        await session.snapshot()
    finally:
        await runtime.close_session(session)


async def episodes_per_s(reg: Registration, episodes: int, in_flight: int) -> float:
    runtime = ToolsetRuntime(reg)
    slots = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with slots:
            await _episode(runtime, f"ep-{in_flight}-{i}")

    try:
        await _episode(runtime, "warm-up")  # a shared server's start is not an episode's
        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(episodes)))
        return episodes / (time.perf_counter() - started)
    finally:
        await runtime.aclose()


def _children(marker: str, exclude: set[int]) -> list[int]:
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == me and int(entry.name) not in exclude and marker in (
                    entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _kib(pid: int, field: str, file: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


async def memory_in_flight(reg: Registration, sessions: int,
                           exclude: set[int]) -> dict[str, Any]:
    runtime = ToolsetRuntime(reg)
    opened = await runtime.open_sessions([EpisodePlan(key=f"m{i}", initial_state=INITIAL)
                                          for i in range(sessions)])
    try:
        live = [s for s in opened if isinstance(s, ToolSession)]
        await asyncio.gather(*(s.call("tickets_list", {}) for s in live))
        pids = _children("flywheel.tools.mcp_serve", exclude)
        rss = [_kib(p, "VmRSS", "status") for p in pids]
        pss = [_kib(p, "Pss", "smaps_rollup") for p in pids]
        return {"sessions": len(live), "server_processes": len(pids),
                "rss_mib_total": round(sum(rss) / 1024, 1),
                "rss_mib_per_session": round(statistics.fmean(rss) / 1024, 1) if rss else None,
                "pss_mib_total": round(sum(pss) / 1024, 1) if any(pss) else None}
    finally:
        await asyncio.gather(*(runtime.close_session(s) for s in opened
                               if isinstance(s, ToolSession)))
        await runtime.aclose()


def _serve_http() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "flywheel.tools.mcp_serve", TARGET,
                             "--http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}/mcp"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the workplace MCP server did not start") from None
            time.sleep(0.1)


async def _run(calls: int, episodes: int, in_flight: int, sessions: int) -> dict[str, Any]:
    proc, url = _serve_http()
    try:
        regs = {"python": await _registered("wp-python", PythonClass(target=TARGET)),
                "stdio": await _registered("wp-stdio", _stdio("shared")),
                "http": await _registered("wp-http", McpHttp(url=url, max_sessions=256)),
                "stdio_process": await _registered("wp-proc", _stdio("process"))}
        load_before = os.getloadavg()[0]
        trip = {"python_direct_us": direct_call(calls * 10)}
        for kind in ("python", "stdio", "http"):
            trip[f"{kind}_us"] = await round_trip(regs[kind], calls)
        trip["stdio_vs_python"] = round(trip["stdio_us"] / trip["python_us"], 1)
        trip["http_vs_python"] = round(trip["http_us"] / trip["python_us"], 1)
        rates: dict[str, Any] = {}
        for kind in ("python", "stdio", "http", "stdio_process"):
            n = episodes if kind != "stdio_process" else max(in_flight, episodes // 4)
            many = await episodes_per_s(regs[kind], n, in_flight)
            one = await episodes_per_s(regs[kind], max(n // 4, 2), 1)
            rates[kind] = {"episodes": n, f"in_flight_{in_flight}": round(many, 1),
                           "in_flight_1": round(one, 1), "speedup": round(many / one, 2)}
        memory = await memory_in_flight(regs["stdio_process"], sessions, {proc.pid})
    finally:
        proc.terminate()
        proc.wait(10)
    return {"round_trip": trip, "episodes_per_s": rates, "memory": memory,
            "calls": calls, "in_flight": in_flight, "cpus": os.cpu_count(),
            "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
            "mcp": _version("mcp")}


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def run_tools_bench(*, calls: int = 300, episodes: int = 64, in_flight: int = 32,
                    sessions: int = 32) -> dict[str, Any]:
    return asyncio.run(_run(calls, episodes, in_flight, sessions))
