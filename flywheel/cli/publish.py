"""`flywheel publish`: JSONL files of trajectories or feedback onto the topics."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from flywheel.cli.common import JsonOpt, _fail, _settings, console

INVALID_EXIT = 1
"""Exit status when a line was invalid (and `--allow-invalid` was not given)."""


def publish(
    file: Annotated[str, typer.Argument(help="JSONL file (one record a line), or - for stdin.")],
    raw: Annotated[bool, typer.Option(help="Send lines as they are; ingest (the miner for "
                                      "--feedback) validates and dead-letters bad ones.")
                   ] = False,
    strict: Annotated[bool, typer.Option(help="Stop at the first invalid line.")] = False,
    agent: Annotated[str | None, typer.Option(help="Names the agent of records that do not "
                                              "name one (otherwise 'unknown').")] = None,
    feedback: Annotated[bool, typer.Option("--feedback", help="Lines are feedback (ratings, "
                                           "outcomes, corrections) for stored trajectories."
                                           )] = False,
    allow_invalid: Annotated[bool, typer.Option("--allow-invalid", help="Exit 0 even when "
                                                "lines were invalid (they are still "
                                                "reported).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Publish trajectories (flywheel v1, Chat Completions transcripts, request/response
    pairs: auto-detected per line) or, with --feedback, feedback. Exits 1 when a line was
    invalid, unless --allow-invalid."""
    from flywheel.runtime.endpoints import StackNotRunning
    from producers.replay import publish_lines

    if raw and agent:
        _fail("--agent names the agent of records it validates; --raw sends lines unread. "
              "Drop one (with --raw, name the agent in each record or in the Kafka header "
              "'flywheel-agent')")
    if feedback and agent:
        _fail("--agent names trajectories; feedback belongs to the trajectory it names")
    if file != "-" and not Path(file).exists():
        _fail(f"no such file: {file}")
    # surrogateescape: a line that is not UTF-8 is reported as invalid, not a crash mid-file
    stream = (io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="surrogateescape")
              if file == "-" else open(file, encoding="utf-8", errors="surrogateescape"))
    try:
        report = asyncio.run(publish_lines(_settings(), stream, raw=raw, strict=strict,
                                           progress=not as_json, agent=agent,
                                           feedback=feedback))
    except StackNotRunning as exc:
        _fail(str(exc))
        return
    finally:
        if file != "-":
            stream.close()
    if as_json:
        print(json.dumps(report, sort_keys=True))
    else:
        what = "feedback records" if feedback else "trajectories"
        console.print(f"published {report['published']} {what}, invalid {report['invalid']}"
                      + (f", spooled {report['spooled']}" if report["spooled"] else ""))
        for problem in report["errors"][:10]:
            console.print(f"  line {problem['line']}: {problem['error']}")
        if report["invalid"] > 10:
            console.print(f"  … and {report['invalid'] - 10} more (--json lists all)")
    if report["invalid"] and not allow_invalid:
        raise typer.Exit(INVALID_EXIT)
