"""`flywheel publish`: JSONL replay through the SDK (spooling, batching, retries included)."""

from __future__ import annotations

from typing import Any, TextIO

from flywheel.config import Settings
from flywheel.ingest.decode import load_json


async def publish_lines(settings: Settings, lines: TextIO, *, raw: bool = False,
                        strict: bool = False, progress: bool = True,
                        flush_timeout: float = 120) -> dict[str, Any]:
    """Publish every line; returns {published, invalid, errors: [{line, error}], spooled}."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from producers.sdk import FlywheelClient

    errors: list[dict[str, Any]] = []
    published = 0
    client = FlywheelClient.from_settings(settings)
    await client.start()
    bar = Progress(TextColumn("publishing"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[invalid]} invalid"), disable=not progress,
                   transient=True)
    try:
        with bar:
            task = bar.add_task("publish", total=None, invalid=0)
            for number, line in enumerate(lines, start=1):
                line = line.strip()
                if not line:
                    continue
                try:
                    if raw:
                        await client.log_raw(line.encode("utf-8", "surrogateescape"))
                    else:
                        # ingest's own decision; a bad line is counted, never a crash
                        record = load_json(line.encode("utf-8", "surrogateescape"))
                        if isinstance(record, tuple):
                            raise ValueError(record[1])
                        await client.log(record)
                    published += 1
                except ValueError as err:  # invalid, or too large for one Kafka record
                    errors.append({"line": number, "error": str(err)})
                if errors and strict:
                    break
                bar.update(task, advance=1, invalid=len(errors))
        try:
            await client.flush(timeout=flush_timeout)
        except TimeoutError:
            pass  # what is not delivered stays in the spool; reported below
        stats = client.stats
    finally:
        await client.close()
    return {"published": published, "invalid": len(errors), "errors": errors,
            "spooled": int(stats.get("spooled", 0)) if stats.get("state") == "spooling" else 0}
