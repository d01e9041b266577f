"""`flywheel verify …`: run verifiers on outputs, profile rewards over stored tasks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from flywheel.cli.common import JsonOpt, console, db_call, fail, load_settings

verify_app = typer.Typer(no_args_is_help=True, help="Run verifiers on outputs; profile rewards.")


@verify_app.command("check")
def verify_check(
    task: Annotated[Path, typer.Option(help="TASK.json: a task spec (`flywheel tasks show`).")],
    outputs: Annotated[Path, typer.Option(help="OUTPUTS.jsonl: one output per line (an "
                                          "assistant message with tool_calls, a list of "
                                          "calls, the raw text as a JSON string, or an end "
                                          "state).")],
    raw: Annotated[bool, typer.Option(help="The outputs are the model's reply texts (JSON "
                                      "strings): parse them with the policy's chat format, "
                                      "as rollouts do, before scoring.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Score each output against the task: one JSON line per output."""
    from pydantic import ValidationError

    from flywheel.environments import load_environment
    from flywheel.mining.verify import check
    from flywheel.tasks import TaskSpec

    try:
        spec = TaskSpec.model_validate_json(task.read_text())
    except (OSError, ValidationError) as exc:
        fail(f"cannot read task {task}: {exc}")
        return
    try:
        lines = [json.loads(line) for line in outputs.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        fail(f"cannot read outputs {outputs}: {exc}")
        return
    if raw and load_environment(spec.env).reads == "message":
        from flywheel.policy.factory import policy_chat_format

        fmt = policy_chat_format(load_settings())
        lines = [fmt.parse(line) if isinstance(line, str) else line for line in lines]
    for result in check(spec, lines):
        print(json.dumps(result, sort_keys=True))


@verify_app.command("profile")
def verify_profile(
    env: Annotated[str, typer.Option(help="Environment name (tool_call, workplace, code…).")],
    sample: Annotated[int, typer.Option(help="Tasks to sample.")] = 200,
    as_json: JsonOpt = False,
) -> None:
    """Reward distribution over stored tasks: production attempts and the references."""
    from flywheel.mining.verify import profile

    data = db_call(lambda conn: profile(conn, env, sample))
    if as_json:
        print(json.dumps(data, sort_keys=True))
        return
    console.print_json(json.dumps(data))
