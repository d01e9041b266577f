"""`flywheel tasks …` (tasks mined from failures) and `flywheel evalset …` (frozen holdouts)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console

from flywheel.cli.common import JsonOpt, console, db_call, fail, load_settings, uuid_arg

tasks_app = typer.Typer(no_args_is_help=True, help="Environment tasks mined from failures.")
evalset_app = typer.Typer(no_args_is_help=True, help="Frozen held-out evaluation sets.")


@tasks_app.command("ls")
def tasks_ls(
    split: Annotated[str | None, typer.Option(
        help="train, validation (training tasks never trained on) or holdout")] = None,
    env: Annotated[str | None, typer.Option(help="Environment name.")] = None,
    limit: Annotated[int, typer.Option(help="Most rows.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List tasks (newest first)."""
    from flywheel.mining.queries import list_tasks

    rows = db_call(lambda conn: list_tasks(conn, split=split, env=env, limit=limit))
    if as_json:
        print(json.dumps(rows, sort_keys=True, default=str))
        return
    from rich.table import Table

    table = Table("task_id", "env", "failure_mode", "split", "sources", "expected_from")
    for r in rows:
        table.add_row(str(r["task_id"]), r["env"], r["failure_mode"], r["split"],
                      str(r["sources"]), r["expected_from"])
    Console().print(table)


@tasks_app.command("show")
def tasks_show(task_id: str, as_json: JsonOpt = False) -> None:
    """One task: split, env, failure mode, sources, verifier spec."""
    from flywheel.mining.queries import get_task

    try:
        uid = uuid_arg(task_id)
    except ValueError:
        fail(f"not a task id: {task_id!r} (a UUID, see `flywheel tasks ls`)")
        return
    row = db_call(lambda conn: get_task(conn, uid))
    if row is None:
        fail(f"no task {task_id}")
    print(json.dumps(row, sort_keys=True, default=str, indent=None if as_json else 2))


@evalset_app.command("freeze")
def evalset_freeze(as_json: JsonOpt = False) -> None:
    """Freeze today's holdout tasks as the next eval-set version (immutable), and report
    what the gate can see on it: the minimum detectable gain at its budget."""
    from flywheel.cli.review import power_line
    from flywheel.gate.evaluate import load_holdout
    from flywheel.gate.progress import eval_set_power, write_power
    from flywheel.mining.store import freeze_eval_set

    settings = load_settings()

    async def go(conn: Any) -> Any:
        version, count = await freeze_eval_set(conn, settings.topics)
        holdout = await load_holdout(conn, settings.gate.max_tasks, settings.rollout.envs)
        found = await eval_set_power(conn, settings, holdout)
        await write_power(conn, settings.policy, found)
        return version, count, found

    version, count, found = db_call(go)
    if as_json:
        print(json.dumps({"version": version, "tasks": count,
                          "power": found.model_dump(mode="json")}, sort_keys=True))
        return
    console.print(f"eval set v{version} frozen with {count} holdout tasks "
                  f"({found.tasks} in this policy's environments)")
    console.print(f"MDE {power_line(found.model_dump(mode='json'))}")
    if found.warning:
        console.print(f"[yellow]warning:[/yellow] {found.warning}")
