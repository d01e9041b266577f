"""The local stack: `up`, `down`, `migrate`, `status` (the supervisor is `flywheel.stack`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from flywheel.cli.common import JsonOpt, console, fail, load_settings


def up(detach: Annotated[bool, typer.Option("--detach", "-d",
                                            help="Return once everything is ready.")] = False,
       repair_wait: Annotated[float, typer.Option(
           help="On a running stack: how long to wait for what is dead to come back.")] = 60.0,
       ) -> None:
    """Start the broker, Postgres, migrations, the API and every consumer; on a running
    stack, check it and restart what is dead (non-zero exit when that fails)."""
    from flywheel.stack.control import StackDegraded
    from flywheel.stack.control import detach as detach_stack
    from flywheel.stack.supervisor import Stack

    settings = load_settings()
    local_vllm = settings.rollout.engine == "vllm" and not settings.rollout.vllm_urls
    if detach:
        try:  # a local vLLM on CPU takes up to a minute or two to start
            run = detach_stack(settings, timeout=900 if local_vllm else 180,
                               repair_wait_s=repair_wait)
        except (RuntimeError, StackDegraded) as err:
            fail(str(err))
            return
        print_run(run, settings.home)
        return
    from flywheel.runtime.logs import configure_logging

    configure_logging()
    from flywheel.cli.vllm import build_server

    try:
        Stack(settings, vllm=build_server(settings)[1] if local_vllm else None).run()
    except RuntimeError as err:
        fail(str(err))


def print_run(run: dict[str, Any], home: Path) -> None:
    from flywheel.runtime.logs import mask_url
    from flywheel.stack.broker import MEMORY_ONLY_NOTE

    home = Path(run.get("home") or home).resolve()  # what the running supervisor uses
    repaired = run.get("repaired") or []
    console.print("[green]flywheel is up[/green]"
                  + (f" (repaired: {', '.join(repaired)} restarted)" if repaired else ""))
    # soft_wrap: a long path is printed whole, never folded, so it can be copied.
    console.print(f"  home      FLYWHEEL_HOME={home}", soft_wrap=True)
    console.print(f"  kafka     {run['kafka_bootstrap']}")
    console.print(f"  postgres  {mask_url(run['database_url'])}", soft_wrap=True)
    console.print(f"  api       {run['api_url']}")
    if run.get("vllm_url"):
        console.print(f"  vllm      {run['vllm_url']}")
    if run.get("dashboard_url"):
        console.print(f"  dashboard {run['dashboard_url']}")
    console.print(f"  logs      {run['logs']}")
    console.print(f"  secrets   database password and tokens (publish / operate) in "
                  f"{home / 'run.json'} (mode 0600)", soft_wrap=True)
    for note in run.get("notes") or []:
        console.print(f"  note      {note}", soft_wrap=True)
    if run.get("broker"):
        console.print(f"[yellow]  broker    {MEMORY_ONLY_NOTE}[/yellow]", soft_wrap=True)


def down(
    no_drain: Annotated[bool, typer.Option("--no-drain", help="Stop at once: whatever the "
                                           "bundled broker holds unconsumed is lost.")] = False,
    timeout: Annotated[float | None, typer.Option(help="Longest wait for the consumers to "
                                                  "catch up (default stack.drain_timeout_s)."
                                                  )] = None,
) -> None:
    """Stop intake, drain the consumers and the outbox (bounded), then stop everything."""
    from flywheel.stack.control import down as stop_stack

    settings = load_settings()
    if not console.is_terminal:  # a log or a pipe: one line per change, no spinner
        said = stop_stack(settings, drain=not no_drain, drain_timeout_s=timeout,
                          progress=lambda line: console.print(line, soft_wrap=True))
    else:
        with console.status("stopping intake and draining…") as shown:
            said = stop_stack(settings, drain=not no_drain, drain_timeout_s=timeout,
                              progress=lambda line: shown.update(line))
    console.print("nothing running" if said is None else f"stopped: {said}", soft_wrap=True)


def migrate() -> None:
    """Apply database migrations (`alembic upgrade head`) to the configured database."""
    from flywheel.db import migrate as m
    from flywheel.runtime.endpoints import StackNotRunning, resolve_db_url

    try:
        m.upgrade(resolve_db_url(load_settings()))
    except StackNotRunning as err:
        fail(str(err))


def status(as_json: JsonOpt = False) -> None:
    """Pipeline counts, consumer lag, and the local stack's components (exit 1 when Postgres
    or Kafka does not answer: what is known is still printed)."""
    from flywheel.observe.status import collect
    from flywheel.runtime.endpoints import StackNotRunning

    try:
        data = asyncio.run(collect(load_settings()))
    except StackNotRunning as err:
        fail(str(err))
        return
    down = [name for name, dep in data["dependencies"].items() if not dep["up"]]
    if as_json:
        print(json.dumps(data, sort_keys=True))
    else:
        print_status(data)
    if down:
        raise typer.Exit(1)


def print_status(data: dict[str, Any]) -> None:
    from rich.table import Table

    from flywheel.cli.review import gate_lines, validation_line

    table = Table(title="flywheel status", show_header=False)
    for name, dep in data["dependencies"].items():
        table.add_row(name, "[green]up[/green]" if dep["up"]
                      else f"[red]down[/red]: {dep['error']}")
    for key in ("trajectories", "failures", "awaiting_outcome", "feedback_pending", "dlq",
                "outbox_pending", "events"):
        if key in data:
            table.add_row(key, str(data[key]))
    for consumer, reasons in (data.get("dlq_by_consumer") or {}).items():
        table.add_row(f"  dlq {consumer}", ", ".join(f"{r} {n}" for r, n in reasons.items()))
    for group, lag in data["lag"].items():
        table.add_row(f"lag {group}", str(lag["total"]))
    if "trainer" in data:  # Postgres answered (else only lag, dependencies and stack)
        trainer = data["trainer"]
        table.add_row("trainer", f"{trainer['state']}" + (f": {trainer['detail']}"
                                                           if trainer["detail"] else ""))
    if "gate" in data:
        for key, value in gate_lines(data["gate"]):
            table.add_row(key, value)
    if "validation" in data:
        table.add_row(*validation_line(data["validation"], data.get("tasks_by_split") or {}))
    stack = data.get("stack") or {}
    for name, info in (stack.get("components") or {}).items():
        state = info.get("state")
        colour = "green" if state == "up" else "yellow" if state == "stopped" else "red"
        extra = f", {info['restarts']} restarts" if info.get("restarts") else ""
        error = f" — {info['last_error']}" if info.get("last_error") and state != "up" else ""
        table.add_row(f"stack {name}", f"[{colour}]{state}[/{colour}] (pid {info.get('pid')}"
                                       f"{extra}){error}")
    for loss in (stack.get("broker") or {}).get("losses") or []:
        per_topic = ", ".join(f"{t} {d['not_stored']}" for t, d in loss["topics"].items())
        what = (f"{loss['not_stored']} acknowledged records not stored ({per_topic})"
                if loss.get("not_stored") is not None else
                "acknowledged records not stored: how many is not known (no read of the "
                "broker came before it was lost)")
        table.add_row(f"[red]LOST[/red] {loss['id']}", f"{what}; `flywheel losses ack` once "
                      "handled")
    for note in stack.get("notes") or []:
        table.add_row("note", note)
    Console().print(table)
    warning = (data.get("gate") or {}).get("warning")
    if warning:
        console.print(f"[yellow]warning:[/yellow] {warning}")
