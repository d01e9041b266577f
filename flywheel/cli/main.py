"""`flywheel` CLI entry point. Heavy modules are imported inside commands: `--help` is instant."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from flywheel.config import Settings

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Flywheel: production agent failures → better models, safely.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (ratios against a baseline "
                        "measured in the same run).")
app.add_typer(bench_app, name="bench")
console = Console(stderr=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output, stable keys.")]


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


def _settings() -> Settings:
    return Settings()


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
    from flywheel.runtime.endpoints import StackNotRunning
    from flywheel.status import collect

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
    from flywheel.publish import publish_lines
    from flywheel.runtime.endpoints import StackNotRunning

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
    if as_json:
        print(json.dumps(result, sort_keys=True))
    else:
        for k, v in result.items():
            console.print(f"{k:>22}: {v}")


@app.command()
def demo() -> None:
    """The main job on the embedded default (grows with each pipeline stage)."""
    from flywheel.demo import run_demo

    raise typer.Exit(run_demo(_settings()))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
