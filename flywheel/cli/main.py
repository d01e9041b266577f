"""`flywheel` CLI entry point. Heavy modules are imported inside commands: `--help` is instant."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Flywheel: production agent failures → better models, safely.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (ratios against a baseline "
                        "measured in the same run).")
app.add_typer(bench_app, name="bench")
tasks_app = typer.Typer(no_args_is_help=True, help="Environment tasks mined from failures.")
app.add_typer(tasks_app, name="tasks")
evalset_app = typer.Typer(no_args_is_help=True, help="Frozen held-out evaluation sets.")
app.add_typer(evalset_app, name="evalset")
verify_app = typer.Typer(no_args_is_help=True, help="Run verifiers on outputs; profile rewards.")
app.add_typer(verify_app, name="verify")
from flywheel.cli.baseline import baseline  # noqa: E402
from flywheel.cli.common import (  # noqa: E402
    JsonOpt,
    _db_call,
    _fail,
    _settings,
    console,
    print_result,
    uuid_arg,
)
from flywheel.cli.policy import policy_app  # noqa: E402
from flywheel.cli.review import adapters_app, promotions_app, replay  # noqa: E402

app.add_typer(policy_app, name="policy")
app.add_typer(promotions_app, name="promotions")
app.add_typer(adapters_app, name="adapters")
app.command()(replay)
app.command()(baseline)


@app.command()
def up(detach: Annotated[bool, typer.Option("--detach", "-d",
                                            help="Return once everything is ready.")] = False
       ) -> None:
    """Start the broker, Postgres, migrations, the API and every consumer."""
    from flywheel.runtime.stack import Stack
    from flywheel.runtime.stack import detach as detach_stack

    settings = _settings()
    if detach:
        try:
            run = detach_stack(settings)
        except RuntimeError as err:
            _fail(str(err))
            return
        _print_run(run)
        return
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    Stack(settings).run()


def _print_run(run: dict[str, Any]) -> None:
    console.print("[green]flywheel is up[/green]")
    console.print(f"  kafka     {run['kafka_bootstrap']}")
    console.print(f"  postgres  {run['database_url']}")
    console.print(f"  api       {run['api_url']}")
    if run.get("dashboard_url"):
        console.print(f"  dashboard {run['dashboard_url']}")
    console.print(f"  logs      {run['logs']}")
    console.print("  tokens    in .flywheel/run.json (publish / operate)")


@app.command()
def down() -> None:
    """Stop everything `flywheel up --detach` started."""
    from flywheel.runtime.stack import down as stop_stack

    if stop_stack(_settings()):
        console.print("stopped")
    else:
        console.print("nothing running")


@app.command()
def migrate() -> None:
    """Apply database migrations (`alembic upgrade head`) to the configured database."""
    from flywheel.db import migrate as m
    from flywheel.runtime.endpoints import StackNotRunning, resolve_db_url

    try:
        m.upgrade(resolve_db_url(_settings()))
    except StackNotRunning as err:
        _fail(str(err))


@app.command()
def status(as_json: JsonOpt = False) -> None:
    """Pipeline counts and consumer lag."""
    from flywheel.api.status import collect
    from flywheel.runtime.endpoints import StackNotRunning

    try:
        data = asyncio.run(collect(_settings()))
    except StackNotRunning as err:
        _fail(str(err))
        return
    if as_json:
        print(json.dumps(data, sort_keys=True))
        return
    from rich.table import Table

    table = Table(title="flywheel status", show_header=False)
    for key in ("trajectories", "failures", "dlq", "outbox_pending", "events"):
        table.add_row(key, str(data[key]))
    for group, lag in data["lag"].items():
        table.add_row(f"lag {group}", str(lag["total"]))
    Console().print(table)


@app.command()
def publish(
    file: Annotated[str, typer.Argument(help="JSONL file of trajectories, or - for stdin.")],
    raw: Annotated[bool, typer.Option(help="Send lines as they are; ingest validates and "
                                      "dead-letters bad ones.")] = False,
    strict: Annotated[bool, typer.Option(help="Stop at the first invalid line.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Publish trajectories (flywheel v1 or Chat Completions, auto-detected per line)."""
    from flywheel.runtime.endpoints import StackNotRunning
    from producers.replay import publish_lines

    if file != "-" and not Path(file).exists():
        _fail(f"no such file: {file}")
    stream = sys.stdin if file == "-" else open(file, encoding="utf-8")
    try:
        report = asyncio.run(publish_lines(_settings(), stream, raw=raw, strict=strict,
                                           progress=not as_json))
    except StackNotRunning as exc:
        _fail(str(exc))
        return
    finally:
        if stream is not sys.stdin:
            stream.close()
    if as_json:
        print(json.dumps(report, sort_keys=True))
    else:
        console.print(f"published {report['published']}, invalid {report['invalid']}")
        for problem in report["errors"][:10]:
            console.print(f"  line {problem['line']}: {problem['error']}")
    if report["invalid"] and strict:
        raise typer.Exit(1)


@bench_app.command("ingest")
def bench_ingest(
    n: Annotated[int, typer.Option(help="Trajectories to push through.")] = 50_000,
    workers: Annotated[int, typer.Option(help="Ingest processes (one consumer group).")] = 1,
    as_json: JsonOpt = False,
) -> None:
    """Producer → Kafka → Postgres until every row is durable, against raw COPY."""
    from flywheel.bench.ingest import run_bench

    result = run_bench(n, workers=workers, progress=not as_json)
    print_result(result, as_json)


@app.command()
def simulate(
    agents: Annotated[int, typer.Option(help="Simulated agents (1-3: support, ops, code).")] = 3,
    n: Annotated[int, typer.Option(help="Trajectories to write.")] = 2000,
    failure_rate: Annotated[float, typer.Option(help="Share of failed attempts.")] = 0.3,
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same output).")] = 0,
    chat_share: Annotated[float, typer.Option(help="Share written as Chat Completions "
                                              "transcripts.")] = 0.2,
) -> None:
    """Write realistic agent trajectories as JSONL to stdout (pipe into `flywheel publish -`)."""
    from flywheel.demo.simulate import simulate as run

    out = sys.stdout
    for record in run(n, agents=agents, failure_rate=failure_rate, seed=seed,
                      chat_share=chat_share):
        out.write(json.dumps(record) + "\n")


@tasks_app.command("ls")
def tasks_ls(
    split: Annotated[str | None, typer.Option(help="train or holdout")] = None,
    env: Annotated[str | None, typer.Option(help="Environment name.")] = None,
    limit: Annotated[int, typer.Option(help="Most rows.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List tasks (newest first)."""
    from flywheel.mining.queries import list_tasks

    rows = _db_call(lambda conn: list_tasks(conn, split=split, env=env, limit=limit))
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
        _fail(f"not a task id: {task_id!r} (a UUID, see `flywheel tasks ls`)")
        return
    row = _db_call(lambda conn: get_task(conn, uid))
    if row is None:
        _fail(f"no task {task_id}")
    print(json.dumps(row, sort_keys=True, default=str, indent=None if as_json else 2))


@evalset_app.command("freeze")
def evalset_freeze(as_json: JsonOpt = False) -> None:
    """Freeze today's holdout tasks as the next eval-set version (immutable)."""
    from flywheel.mining.store import freeze_eval_set

    topics = _settings().topics
    version, count = _db_call(lambda conn: freeze_eval_set(conn, topics))
    if as_json:
        print(json.dumps({"version": version, "tasks": count}))
    else:
        console.print(f"eval set v{version} frozen with {count} holdout tasks")


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
        _fail(f"cannot read task {task}: {exc}")
        return
    try:
        lines = [json.loads(line) for line in outputs.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        _fail(f"cannot read outputs {outputs}: {exc}")
        return
    if raw and load_environment(spec.env).reads == "message":
        from flywheel.policy.factory import policy_chat_format

        fmt = policy_chat_format(_settings())
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

    data = _db_call(lambda conn: profile(conn, env, sample))
    if as_json:
        print(json.dumps(data, sort_keys=True))
        return
    console.print_json(json.dumps(data))


@bench_app.command("rollout")
def bench_rollout(
    groups: Annotated[int, typer.Option(help="Groups to sample on each side.")] = 6,
    group_size: Annotated[int, typer.Option(help="G: completions per group.")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Token limit per completion.")] = 32,
    as_json: JsonOpt = False,
) -> None:
    """Groups through the rollout worker vs the engine directly (same prompts and seeds)."""
    from flywheel.bench.rollout import run_bench

    result = run_bench(groups, group_size=group_size, max_tokens=max_tokens)
    print_result(result, as_json)


@bench_app.command("learning")
def bench_learning(
    steps: Annotated[int, typer.Option(help="GRPO steps.")] = 30,
    tasks: Annotated[int, typer.Option(help="Fixed tool_call tasks.")] = 6,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 2e-4,
    sft_steps: Annotated[int, typer.Option(
        help="SFT warm-start steps before GRPO, on demonstrations of other requests.")] = 0,
    max_tokens: Annotated[int, typer.Option(
        help="Most tokens per completion (a tool call in the chat format is 40-50).")] = 64,
    as_json: JsonOpt = False,
) -> None:
    """Mean reward on fixed tasks: base policy [vs SFT] vs after K GRPO steps (local engine)."""
    from flywheel.bench.learning import run_learning

    result = run_learning(steps, tasks=tasks, lr=lr, sft_steps=sft_steps,
                          max_tokens=max_tokens)
    print_result(result, as_json)


@bench_app.command("prefix")
def bench_prefix(
    batch: Annotated[int, typer.Option(help="B: prompts (groups) per step.")] = 4,
    group_size: Annotated[int, typer.Option(help="G: completions per prompt.")] = 8,
    tokens: Annotated[int, typer.Option(help="Tokens per completion.")] = 32,
    repeats: Annotated[int, typer.Option(help="Timed runs per side (best counts).")] = 1,
    as_json: JsonOpt = False,
) -> None:
    """A GRPO and an SFT step: each prompt run once vs every prompt + completion in full."""
    from flywheel.bench.prefix import run_prefix_bench

    print_result(run_prefix_bench(batch=batch, group_size=group_size, tokens=tokens,
                                  repeats=repeats), as_json)


@bench_app.command("trainer")
def bench_trainer(
    steps: Annotated[int, typer.Option(help="GRPO steps on each side.")] = 3,
    batch: Annotated[int, typer.Option(help="B: trainable groups per step.")] = 2,
    group_size: Annotated[int, typer.Option(help="G: completions per group.")] = 8,
    max_tokens: Annotated[int, typer.Option(
        help="Token limit per completion (a tool call in the chat format is 40-50).")] = 64,
    staleness: Annotated[int, typer.Option(help="Versions sampling may run ahead of "
                                           "training.")] = 1,
    sequential: Annotated[bool, typer.Option(help="Also time the same pipeline without "
                                             "overlap (all cores per phase).")] = True,
    trl: Annotated[bool, typer.Option(help="Also run TRL's GRPOTrainer (the baseline).")] = True,
    as_json: JsonOpt = False,
) -> None:
    """K GRPO steps: Flywheel's overlapped sampling + training vs TRL's GRPOTrainer (CPU)."""
    from flywheel.bench.trainer import run_trainer_bench

    if min(steps, batch, staleness) < 1 or group_size < 2:
        _fail("--steps, --batch and --staleness must be ≥ 1, --group-size ≥ 2")
    result = run_trainer_bench(steps, batch=batch, group_size=group_size,
                               max_tokens=max_tokens, staleness=staleness,
                               sequential=sequential, trl=trl)
    print_result(result, as_json)


@app.command()
def demo(keep: Annotated[bool, typer.Option(help="Leave the stack running afterwards.")] = False,
         minutes: Annotated[float, typer.Option(help="Time budget of the whole demo.")] = 18.0,
         ) -> None:
    """The whole loop on the embedded default: trajectories → tasks → baseline → SFT/GRPO →
    gate → promotion decisions; writes .flywheel/demo-summary.json."""
    from flywheel.demo.run import run_demo

    raise typer.Exit(run_demo(_settings(), keep=keep, minutes=minutes))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
