"""`flywheel publish`: JSONL replay through the SDK (spooling, batching, retries included)."""

from __future__ import annotations

import json
from typing import Any, TextIO

from pydantic import ValidationError

from flywheel.config import Settings
from flywheel.ingest.decode import describe_validation_error
from flywheel.schemas import parse_trajectory


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
                if raw:
                    await client.log_raw(line.encode())
                    published += 1
                else:
                    try:
                        await client.log(parse_trajectory(json.loads(line)))
                        published += 1
                    except json.JSONDecodeError as err:
                        errors.append({"line": number, "error": f"not valid JSON: {err}"})
                    except ValidationError as err:
                        errors.append({"line": number, "error": describe_validation_error(err)})
                    except ValueError as err:
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
