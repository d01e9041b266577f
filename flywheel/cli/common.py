"""Helpers every CLI command module shares: settings, errors without tracebacks, the DB.
Nothing heavy at import: `flywheel --help` loads only typer and rich."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console

if TYPE_CHECKING:  # settings load pydantic-settings: not on the path of `--help`
    from flywheel.config import Settings

console = Console(stderr=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output, stable keys.")]


def fail(message: str) -> NoReturn:
    console.print(f"[red]error:[/red] {message}", soft_wrap=True)  # whole lines for scripts
    raise typer.Exit(2)


def load_settings() -> Settings:
    from flywheel.config import Settings

    return Settings()


def db_call(fn: Any) -> Any:
    """Run `fn(conn)` in one transaction against the configured database."""
    from flywheel.db.engine import make_engine
    from flywheel.runtime.endpoints import StackNotRunning, resolve_db_url

    async def go() -> Any:
        engine = make_engine(resolve_db_url(load_settings()), pool_size=1)
        try:
            async with engine.begin() as conn:
                return await fn(conn)
        finally:
            await engine.dispose()

    try:
        return asyncio.run(go())
    except StackNotRunning as exc:
        fail(str(exc))


def print_result(result: Any, as_json: bool) -> None:
    """A command's result: one JSON line for scripts (`--json`), else pretty JSON."""
    if as_json:
        print(json.dumps(result, sort_keys=True, default=str))
    else:
        console.print_json(json.dumps(result, default=str))


def uuid_arg(value: str) -> uuid.UUID:
    return uuid.UUID(value)
