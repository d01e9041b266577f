"""`flywheel tools …`: register, list, show, check and remove the agent's own toolsets.

`add` and `check` connect to the backend and read its tools before anything is written:
when the server is down, exits, or speaks an MCP protocol version this client does not,
the command says which, exits non-zero, and registers nothing. docs/TOOLS.md says what
runs live and how to point a toolset at a staging copy.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import shlex
from typing import Annotated, Any

import typer

from flywheel.cli.common import JsonOpt, console, db_call, fail, load_settings, print_result

tools_app = typer.Typer(no_args_is_help=True,
                        help="The agent's own tools: MCP servers and Python toolsets.")
ListOpt = list[str] | None


def _pairs(values: ListOpt, what: str) -> dict[str, str]:
    out = {}
    for value in values or []:
        key, sep, val = value.partition("=")
        if not sep or not key:
            fail(f"{what} {value!r}: write it as KEY=VALUE")
        out[key] = val
    return out


def _config(name: str, backend: dict[str, Any], common: dict[str, Any]) -> Any:
    from pydantic import TypeAdapter, ValidationError

    from flywheel.toolsets import ToolsetConfig

    if not backend:
        declared = load_settings().tools.toolsets.get(name)
        if declared is None:
            fail(f"say what toolset {name!r} is: --mcp-stdio COMMAND, --mcp-http URL or "
                 f"--python module:Class (or declare it in FLYWHEEL_TOOLS__TOOLSETS)")
        return declared.model_copy(update={k: v for k, v in common.items() if v})
    try:
        return TypeAdapter(ToolsetConfig).validate_python({**backend, **common})
    except ValidationError as exc:
        fail(f"toolset {name!r}: " + "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()))


def _read(name: str, config: Any) -> Any:
    from flywheel.tools.backend import ToolsetError
    from flywheel.tools.registry import read_toolset

    try:
        return asyncio.run(read_toolset(name, config))
    except ToolsetError as err:
        fail(f"{err} — nothing was registered")


def _register(read: Any) -> Any:
    from flywheel.tools.registry import register

    settings = load_settings()
    actor = f"cli:{getpass.getuser()}"
    return db_call(lambda conn: register(conn, read, actor=actor, topics=settings.topics))


def _said(done: Any, as_json: bool, verb: str) -> None:
    from flywheel.tools.registry import summary

    reg = done.registration
    out = {**summary(reg), "new_version": done.new}
    if as_json:
        print_result(out, True)
        return
    what = (f"{verb} toolset {reg.name} v{reg.version}" if done.new
            else f"toolset {reg.name} v{reg.version} unchanged")
    console.print(f"{what}: {out['tools']} tools ({reg.config.kind}"
                  + (f", MCP {reg.protocol_version}" if reg.protocol_version else "") + ")")
    if out["destructive"]:
        console.print(f"  destructive: {', '.join(out['destructive'])}; allowed live: "
                      f"{', '.join(out['allowed_live']) or 'none'}")
    if not reg.has_state:
        console.print("  no state() snapshot: tasks on it cannot check an end state")


@tools_app.command("add")
def tools_add(
    name: str,
    mcp_stdio: Annotated[str | None, typer.Option(
        "--mcp-stdio", help="Command that starts an MCP server on stdio.")] = None,
    mcp_http: Annotated[str | None, typer.Option(
        "--mcp-http", help="URL of a streamable-HTTP MCP server.")] = None,
    python: Annotated[str | None, typer.Option(
        "--python", help="A Python toolset class, package.module:Class.")] = None,
    header: Annotated[ListOpt, typer.Option(
        help="HTTP header K=V (V may be ${ENV_VAR}, read when connecting).")] = None,
    env: Annotated[ListOpt, typer.Option(help="Server environment K=V (stdio).")] = None,
    sessions: Annotated[str, typer.Option(
        help="stdio: process (a server per episode) or shared (the reset protocol).")
    ] = "process",
    max_starting: Annotated[int | None, typer.Option(
        help="stdio with sessions=process: server processes started at once (default: the "
             "cores).")] = None,
    on_divergence: Annotated[str | None, typer.Option(
        help="Replay rule off the logged path: live, end or mask.")] = None,
    allow_destructive: Annotated[ListOpt, typer.Option(
        help="A destructive tool this toolset may run live ('*': all). Staging only.")] = None,
    deny: Annotated[ListOpt, typer.Option(help="A tool to treat as destructive.")] = None,
    unannotated_destructive: Annotated[bool, typer.Option(
        "--unannotated-destructive/--unannotated-safe",
        help="MCP tools without side-effect annotations: destructive (MCP's reading, the "
             "default) or safe (only for a server whose unannotated tools are harmless).")
    ] = True,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Never call the backend in episodes: replay or stubs only.")] = False,
    stub: Annotated[ListOpt, typer.Option(help="Dry-run answer TOOL=TEXT.")] = None,
    max_sessions: Annotated[int | None, typer.Option(help="Episodes open at once.")] = None,
    call_timeout: Annotated[float | None, typer.Option(help="Seconds per call.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Register a toolset (or a new version of it): its tools are read from the backend."""
    backends = [b for b in (mcp_stdio, mcp_http, python) if b]
    if len(backends) > 1:
        fail("give one of --mcp-stdio, --mcp-http, --python")
    backend: dict[str, Any] = {}
    if mcp_stdio:
        command, *args = shlex.split(mcp_stdio)
        backend = {"kind": "mcp_stdio", "command": command, "args": args,
                   "env": _pairs(env, "--env"), "sessions": sessions}
        if max_starting is not None:
            backend["max_starting"] = max_starting
    elif mcp_http:
        backend = {"kind": "mcp_http", "url": mcp_http, "headers": _pairs(header, "--header")}
    elif python:
        backend = {"kind": "python", "target": python}
    common = {"on_divergence": on_divergence, "allow_destructive": allow_destructive,
              "deny": deny,
              "unannotated_destructive": None if unannotated_destructive else False,
              "dry_run": dry_run or None, "stubs": _pairs(stub, "--stub") or None,
              "max_sessions": max_sessions, "call_timeout_s": call_timeout}
    common = {k: v for k, v in common.items() if v is not None}
    config = _config(name, backend, common)
    _said(_register(_read(name, config)), as_json, "registered")


@tools_app.command("sync")
def tools_sync(as_json: JsonOpt = False) -> None:
    """Register every toolset declared in the settings (FLYWHEEL_TOOLS__TOOLSETS) whose
    tools or configuration changed."""
    declared = load_settings().tools.toolsets
    if not declared:
        fail("no toolsets are declared in the settings (FLYWHEEL_TOOLS__TOOLSETS)")
    results = []
    for name, config in declared.items():
        done = _register(_read(name, config))
        results.append({"name": name, "version": done.registration.version,
                        "new_version": done.new})
        if not as_json:
            console.print(f"{name}: v{done.registration.version}"
                          + (" (new)" if done.new else " (unchanged)"))
    if as_json:
        print_result(results, True)


@tools_app.command("ls")
def tools_ls(as_json: JsonOpt = False) -> None:
    """Registered toolsets, the newest version of each."""
    from flywheel.tools.registry import list_toolsets

    rows = db_call(list_toolsets)
    if as_json:
        print(json.dumps(rows, sort_keys=True, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "version", "kind", "tools", "destructive (allowed live)",
                  "on_divergence", "dry_run", "state")
    for r in rows:
        danger = ", ".join(f"{d}{' (live)' if d in r['allowed_live'] else ''}"
                           for d in r["destructive"])
        table.add_row(r["name"], str(r["version"]), r["kind"], str(r["tools"]), danger or "-",
                      r["on_divergence"], str(r["dry_run"]), str(r["state"]))
    Console().print(table)


@tools_app.command("show")
def tools_show(name: str, as_json: JsonOpt = False) -> None:
    """One toolset: configuration (secrets masked), tools and schemas, versions."""
    from flywheel.tools.registry import show

    found = db_call(lambda conn: show(conn, name))
    if found is None:
        fail(f"no toolset {name!r} is registered (flywheel tools ls)")
    print(json.dumps(found, sort_keys=True, default=str, indent=None if as_json else 2))


@tools_app.command("check")
def tools_check(name: str, as_json: JsonOpt = False) -> None:
    """Connect to a registered toolset and read its tools again: a new version when they or
    the configuration changed; a clear error (exit 2) when the backend cannot be read."""
    from flywheel.tools.registry import current

    reg = db_call(lambda conn: current(conn, name))
    if reg is None:
        fail(f"no toolset {name!r} is registered (flywheel tools ls)")
    read = _read(name, reg.config)
    before = {t.name: t for t in reg.tools}
    after = {t.name: t for t in read.tools}
    changes = {"added": sorted(set(after) - set(before)),
               "removed": sorted(set(before) - set(after)),
               "changed": sorted(n for n in set(before) & set(after) if before[n] != after[n])}
    done = _register(read)
    if as_json:
        print_result({"name": name, "version": done.registration.version,
                      "new_version": done.new, **changes}, True)
        return
    _said(done, False, "re-registered")
    for kind, names in changes.items():
        if names:
            console.print(f"  {kind}: {', '.join(names)}")


@tools_app.command("rm")
def tools_rm(name: str, as_json: JsonOpt = False) -> None:
    """Remove a toolset: no new episode runs on it (its versions stay in the event log)."""
    from flywheel.tools.registry import NotRegistered, remove

    settings = load_settings()
    actor = f"cli:{getpass.getuser()}"
    try:
        event = db_call(lambda conn: remove(conn, name, actor=actor, topics=settings.topics))
    except NotRegistered as err:
        fail(str(err))
    if as_json:
        print_result(event.model_dump(mode="json"), True)
    else:
        console.print(f"removed toolset {name} (was v{event.payload.version})")
