"""`flywheel publish`: JSONL replay through the SDK (spooling, batching, retries included).

Each line is a trajectory in any accepted shape (v1, Chat Completions transcript,
request/response pair), or with `feedback=True` a feedback record for the feedback topic.
"""

from __future__ import annotations

from typing import Any, TextIO

from flywheel.config import Settings
from flywheel.ingest.wire import load_json


async def publish_lines(settings: Settings, lines: TextIO, *, raw: bool = False,
                        strict: bool = False, progress: bool = True, agent: str | None = None,
                        feedback: bool = False, flush_timeout: float = 120) -> dict[str, Any]:
    """Publish every line; returns {published, invalid, errors: [{line, error}], spooled}:
    `spooled` counts the records not delivered when it ends (on a bundled broker: not
    stored yet, acknowledged or not), kept in the spool for the next client on it.

    `agent` names the agent of trajectories that name none (`flywheel publish --agent`)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from producers.feedback_client import FeedbackClient
    from producers.sdk import FlywheelClient

    errors: list[dict[str, Any]] = []
    published = 0
    client: FlywheelClient | FeedbackClient = (
        FeedbackClient.from_settings(settings) if feedback
        else FlywheelClient.from_settings(settings, agent=agent))
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
                        # the decoding boundary's own decision (ingest's, or the miner's for
                        # feedback); a bad line is counted, never a crash
                        record = load_json(line.encode("utf-8", "surrogateescape"))
                        if isinstance(record, tuple):
                            raise ValueError(record[1])
                        await client.log(record)
                    published += 1
                except ValueError as err:  # invalid, or too large for one Kafka record
                    errors.append({"line": number, "error": str(err)})
                bar.update(task, advance=1, invalid=len(errors))
                if errors and strict:
                    break
        try:
            await client.flush(timeout=flush_timeout)
        except TimeoutError:
            pass  # what is not delivered stays in the spool; reported below
    finally:
        await client.close(timeout=min(30.0, flush_timeout))
    # After close: whatever was not delivered (spooled, buffered, or acknowledged and not
    # stored) is in the spool.
    return {"published": published, "invalid": len(errors), "errors": errors,
            "spooled": int(client.stats["pending"])}
