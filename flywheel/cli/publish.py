"""`flywheel publish`: JSONL files of trajectories or feedback, or OTLP/JSON span files,
onto the topics."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path
from typing import Annotated, TextIO

import typer

from flywheel.cli.common import JsonOpt, console, fail, load_settings

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
    file_format: Annotated[str, typer.Option("--format", help="jsonl (one record a line) or "
                                             "otlp-json: OpenTelemetry spans as OTLP/JSON "
                                             "(one export a line, as the Collector's file "
                                             "exporter writes, or one in the file); each "
                                             "trajectory's spans count as one line.")
                           ] = "jsonl",
    as_json: JsonOpt = False,
) -> None:
    """Publish trajectories (flywheel v1, Chat Completions transcripts, request/response
    pairs: auto-detected per line; OpenTelemetry spans with --format otlp-json) or, with
    --feedback, feedback. Exits 1 when a line was
    invalid, unless --allow-invalid."""
    from flywheel.runtime.endpoints import StackNotRunning
    from producers.replay import publish_lines

    if raw and agent:
        fail("--agent names the agent of records it validates; --raw sends lines unread. "
              "Drop one (with --raw, name the agent in each record or in the Kafka header "
              "'flywheel-agent')")
    if feedback and agent:
        fail("--agent names trajectories; feedback belongs to the trajectory it names")
    if file != "-" and not Path(file).exists():
        fail(f"no such file: {file}")
    if file_format not in ("jsonl", "otlp-json"):
        fail(f"--format {file_format!r}: use jsonl or otlp-json")
    if file_format == "otlp-json" and (raw or feedback):
        fail("--format otlp-json reads spans; --raw and --feedback read JSONL records")
    # surrogateescape: a line that is not UTF-8 is reported as invalid, not a crash mid-file
    stream: TextIO = (io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8",
                                       errors="surrogateescape")
                      if file == "-" else open(file, encoding="utf-8", errors="surrogateescape"))
    if file_format == "otlp-json":
        stream = _span_groups(stream)
    try:
        report = asyncio.run(publish_lines(load_settings(), stream, raw=raw, strict=strict,
                                           progress=not as_json, agent=agent,
                                           feedback=feedback))
    except StackNotRunning as exc:
        fail(str(exc))
        return
    finally:
        if file != "-":
            stream.close()
    if as_json:
        print(json.dumps(report, sort_keys=True))
    else:
        what = "feedback records" if feedback else "trajectories"
        console.print(f"published {report['published']} {what}, invalid {report['invalid']}"
                      + (f", not delivered yet {report['spooled']} (kept in the spool: the "
                         "next `flywheel publish` sends them)" if report["spooled"] else ""))
        for problem in report["errors"][:10]:
            console.print(f"  line {problem['line']}: {problem['error']}")
        if report["invalid"] > 10:
            console.print(f"  … and {report['invalid'] - 10} more (--json lists all)")
    if report["invalid"] and not allow_invalid:
        raise typer.Exit(INVALID_EXIT)


def _span_groups(stream: TextIO) -> TextIO:
    """An OTLP/JSON file as JSONL records: one `otel_spans` record per trajectory, one per
    span that cannot be read (reported as invalid with its reason)."""
    from flywheel.ingest.otel import OTEL_RECORD, group_spans
    from flywheel.ingest.otlp import BadExport, read_otlp_json_file

    try:
        spans = read_otlp_json_file(stream.read())
    except BadExport as err:
        fail(f"not OTLP/JSON: {err}")
    finally:
        stream.close()
    groups, bad = group_spans(spans)
    return io.StringIO("".join(json.dumps({OTEL_RECORD: g}) + "\n"
                               for g in [*groups, *([b] for b in bad)]))
