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
from flywheel.cli.losses import losses_app  # noqa: E402
from flywheel.cli.policy import policy_app  # noqa: E402
from flywheel.cli.publish import publish  # noqa: E402
from flywheel.cli.review import adapters_app, promotions_app, replay  # noqa: E402
from flywheel.cli.vllm import vllm_app  # noqa: E402

app.add_typer(policy_app, name="policy")
app.add_typer(promotions_app, name="promotions")
app.add_typer(vllm_app, name="vllm")
app.add_typer(adapters_app, name="adapters")
app.add_typer(losses_app, name="losses")
app.command()(replay)
app.command()(publish)
app.command()(baseline)


@app.command()
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

    settings = _settings()
    local_vllm = settings.rollout.engine == "vllm" and not settings.rollout.vllm_urls
    if detach:
        try:  # a local vLLM on CPU takes up to a minute or two to start
            run = detach_stack(settings, timeout=900 if local_vllm else 180,
                               repair_wait_s=repair_wait)
        except (RuntimeError, StackDegraded) as err:
            _fail(str(err))
            return
        _print_run(run, settings.home)
        return
    from flywheel.runtime.logs import configure_logging

    configure_logging()
    from flywheel.cli.vllm import build_server

    try:
        Stack(settings, vllm=build_server(settings)[1] if local_vllm else None).run()
    except RuntimeError as err:
        _fail(str(err))


def _print_run(run: dict[str, Any], home: Path) -> None:
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


@app.command()
def down(
    no_drain: Annotated[bool, typer.Option("--no-drain", help="Stop at once: whatever the "
                                           "bundled broker holds unconsumed is lost.")] = False,
    timeout: Annotated[float | None, typer.Option(help="Longest wait for the consumers to "
                                                  "catch up (default stack.drain_timeout_s)."
                                                  )] = None,
) -> None:
    """Stop intake, drain the consumers and the outbox (bounded), then stop everything."""
    from flywheel.stack.control import down as stop_stack

    settings = _settings()
    if not console.is_terminal:  # a log or a pipe: one line per change, no spinner
        said = stop_stack(settings, drain=not no_drain, drain_timeout_s=timeout,
                          progress=lambda line: console.print(line, soft_wrap=True))
    else:
        with console.status("stopping intake and draining…") as shown:
            said = stop_stack(settings, drain=not no_drain, drain_timeout_s=timeout,
                              progress=lambda line: shown.update(line))
    console.print("nothing running" if said is None else f"stopped: {said}", soft_wrap=True)


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
    """Pipeline counts, consumer lag, and the local stack's components (exit 1 when Postgres
    or Kafka does not answer: what is known is still printed)."""
    from flywheel.observe.status import collect
    from flywheel.runtime.endpoints import StackNotRunning

    try:
        data = asyncio.run(collect(_settings()))
    except StackNotRunning as err:
        _fail(str(err))
        return
    down = [name for name, dep in data["dependencies"].items() if not dep["up"]]
    if as_json:
        print(json.dumps(data, sort_keys=True))
    else:
        _print_status(data)
    if down:
        raise typer.Exit(1)


def _print_status(data: dict[str, Any]) -> None:
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
        table.add_row(f"[red]LOST[/red] {loss['id']}",
                      f"{loss['not_stored']} acknowledged records not stored ({per_topic}); "
                      "`flywheel losses ack` once handled")
    for note in stack.get("notes") or []:
        table.add_row("note", note)
    Console().print(table)
    warning = (data.get("gate") or {}).get("warning")
    if warning:
        console.print(f"[yellow]warning:[/yellow] {warning}")


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


@bench_app.command("otlp")
def bench_otlp(
    n: Annotated[int, typer.Option(help="Conversations (4 spans each) per leg.")] = 2000,
    batch: Annotated[int, typer.Option(help="Conversations per request.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """OTLP spans → /v1/traces → Postgres, against the gateway's trajectories/s, one run."""
    from flywheel.bench.otlp import run_bench

    print_result(run_bench(n, batch=batch), as_json)


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
    split: Annotated[str | None, typer.Option(
        help="train, validation (training tasks never trained on) or holdout")] = None,
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
    """Freeze today's holdout tasks as the next eval-set version (immutable), and report
    what the gate can see on it: the minimum detectable gain at its budget."""
    from flywheel.cli.review import power_line
    from flywheel.gate.evaluate import load_holdout
    from flywheel.gate.progress import eval_set_power, write_power
    from flywheel.mining.store import freeze_eval_set

    settings = _settings()

    async def go(conn: Any) -> Any:
        version, count = await freeze_eval_set(conn, settings.topics)
        holdout = await load_holdout(conn, settings.gate.max_tasks, settings.rollout.envs)
        found = await eval_set_power(conn, settings, holdout)
        await write_power(conn, settings.policy, found)
        return version, count, found

    version, count, found = _db_call(go)
    if as_json:
        print(json.dumps({"version": version, "tasks": count,
                          "power": found.model_dump(mode="json")}, sort_keys=True))
        return
    console.print(f"eval set v{version} frozen with {count} holdout tasks "
                  f"({found.tasks} in this policy's environments)")
    console.print(f"MDE {power_line(found.model_dump(mode='json'))}")
    if found.warning:
        console.print(f"[yellow]warning:[/yellow] {found.warning}")


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
    worker: Annotated[bool, typer.Option(
        help="Also run the groups through the rollout worker (Kafka, Postgres).")] = True,
    engine: Annotated[str, typer.Option(help="`worker`: the rollout worker vs the configured "
                                        "engine called directly; `vllm`: vLLM vs the local "
                                        "engine on the same groups.")] = "worker",
    vllm_url: Annotated[str | None, typer.Option(help="With --engine vllm: a running "
                                                 "server (default: start one, then stop it)."
                                                 )] = None,
    lora: Annotated[bool, typer.Option(help="With --engine vllm: also through a LoRA "
                                       "version.")] = False,
    gpu: Annotated[bool, typer.Option(help="With --engine vllm: start vLLM with the GPU "
                                      "flags.")] = False,
    in_flight: Annotated[int | None, typer.Option(
        "--in-flight", help="Instead: groups/s of the configured engine with this many "
        "groups in flight vs one at a time (same tasks and seeds).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Groups through the rollout worker vs the engine directly, and the engine with prompts
    shared vs run in full (same prompts and seeds); or (`--engine vllm`) vLLM vs the local
    engine on the same groups; or (`--in-flight N`) N groups at once vs one at a time."""
    if engine == "vllm":
        from flywheel.bench.engines import run_engine_bench
        from flywheel.stack.vllm_server import VLLMStartError

        try:
            result = run_engine_bench(groups, group_size=group_size, max_tokens=max_tokens,
                                      vllm_url=vllm_url, lora=lora, gpu=gpu)
        except VLLMStartError as err:
            _fail(str(err))
        print_result(result, as_json)
        return
    if engine != "worker":
        _fail(f"--engine must be worker or vllm, not {engine!r}")
    if in_flight is not None:
        from flywheel.bench.inflight import run_inflight_rollout_bench

        print_result(run_inflight_rollout_bench(groups=groups, inflight=in_flight,
                                                group_size=group_size, max_tokens=max_tokens,
                                                settings=_settings()), as_json)
        return
    from flywheel.bench.rollout import run_bench

    result = run_bench(groups, group_size=group_size, max_tokens=max_tokens, worker=worker)
    print_result(result, as_json)


@bench_app.command("gate")
def bench_gate(
    tasks: Annotated[int, typer.Option(help="Holdout tasks of each set.")] = 24,
    inflight: Annotated[int, typer.Option(help="Tasks in flight on the new path.")] = 64,
    rounds: Annotated[int, typer.Option(help="Gate rounds on each side.")] = 1,
    as_json: JsonOpt = False,
) -> None:
    """Samples/s of gate rounds on the same holdouts (the demo's tasks; the same with large
    tool schemas): one task after another vs all in flight, on the configured engine."""
    from flywheel.bench.inflight import run_gate_bench

    print_result(run_gate_bench(tasks=tasks, inflight=inflight, rounds=rounds,
                                settings=_settings()), as_json)


@bench_app.command("learning")
def bench_learning(
    steps: Annotated[int, typer.Option(help="GRPO steps.")] = 30,
    tasks: Annotated[int, typer.Option(help="Fixed tool_call tasks.")] = 6,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 2e-4,
    sft_steps: Annotated[int, typer.Option(
        help="SFT warm-start steps before GRPO, on demonstrations of other requests (the "
             "untuned model calls no tool, so GRPO alone has no signal).")] = 12,
    max_tokens: Annotated[int, typer.Option(
        help="Most tokens per completion (a tool call in the chat format is 40-50).")] = 64,
    heldout_tasks: Annotated[int, typer.Option(
        help="Requests never trained on, for GRPO's gain over its start.")] = 25,
    heldout_samples: Annotated[int, typer.Option(
        help="Samples per held-out request and side (tasks × samples ≥ 200).")] = 8,
    as_json: JsonOpt = False,
) -> None:
    """Mean reward on fixed tasks: base policy [vs SFT] vs after K GRPO steps (local engine),
    and GRPO's gain over its start on ≥ 200 held-out samples with 95% intervals."""
    from flywheel.bench.learning import run_learning

    if heldout_tasks * heldout_samples < 200:
        _fail(f"--heldout-tasks × --heldout-samples is {heldout_tasks * heldout_samples}: "
              "use at least 200 held-out samples")
    result = run_learning(steps, tasks=tasks, lr=lr, sft_steps=sft_steps,
                          max_tokens=max_tokens, heldout_tasks=heldout_tasks,
                          heldout_samples=heldout_samples)
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
         minutes: Annotated[float, typer.Option(help="Time budget of the whole demo.")] = 20.0,
         seed: Annotated[int | None, typer.Option(
             help="Seed of the simulated traffic (tasks, holdout split); default: a new one "
                  "each run, printed.")] = None,
         ) -> None:
    """The whole loop on the embedded default: trajectories → tasks → baseline → SFT/GRPO →
    gate → promotion decisions; writes .flywheel/demo-summary.json."""
    from flywheel.demo.run import run_demo

    raise typer.Exit(run_demo(_settings(), keep=keep, minutes=minutes, seed=seed))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
