"""The ingest service's write side: a batch of decoded records into Postgres, durably.

`write_batch` is one transaction: rows, dead letters, their events and outbox rows. `store`
makes every record end as exactly one row or one dead letter: a write Postgres refuses is
narrowed down to the record it refuses (`flywheel.runtime.consume.settle`), which becomes a
dead letter (`unstorable`) while the rest of its batch is stored; transient failures
(Postgres down) are retried with backoff, for as long as they last.

`WritePipeline` overlaps decoding with writing: at most one batch write is in flight, and
each commits its offsets (`flywheel.runtime.commits`) only once its transaction has
committed, in batch order. Should a write still fail (its dead letters cannot be written
either) the pipeline stops the process before anything later is committed: on restart the
batch is redelivered, and redelivery is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Coroutine, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.config import Topics
from flywheel.db.outbox import append_events
from flywheel.errors import Failure
from flywheel.events import Event
from flywheel.ingest.store import insert_dead_letters, insert_trajectories
from flywheel.ingest.wire import (
    Accepted,
    RawRecord,
    Rejected,
    dead_letter_event,
    ingested_event,
)
from flywheel.runtime.commits import OrderedCommits
from flywheel.runtime.consume import RetryPolicy, settle

log = logging.getLogger("flywheel.ingest")
Outcome = Accepted | Rejected


async def write_batch(engine: AsyncEngine, topics: Topics,
                      outcomes: Sequence[Outcome]) -> None:
    """One transaction: rows, dead letters, their events and outbox rows."""
    records = [o.source for o in outcomes]
    accepted = [o for o in outcomes if isinstance(o, Accepted)]
    rejected = [o for o in outcomes if isinstance(o, Rejected)]
    async with engine.begin() as conn:
        written = await insert_trajectories(conn, accepted)
        new_dead = await insert_dead_letters(conn, rejected)
        events: list[Event] = [dead_letter_event(r) for r in new_dead]
        if written.inserted or written.replaced or new_dead:
            events.append(ingested_event(records, inserted=written.inserted,
                                         duplicates=written.duplicates,
                                         failures=written.failures,
                                         dead_lettered=len(new_dead),
                                         replaced=written.replaced))
        await append_events(conn, events, topics)
    if new_dead:
        log.warning("dead-lettered %d of %d messages", len(new_dead), len(records))


def _position(o: Outcome) -> str:
    return f"{o.source.topic}[{o.source.partition}]@{o.source.offset}"


async def store(engine: AsyncEngine, topics: Topics, outcomes: Sequence[Outcome],
                policy: RetryPolicy) -> None:
    """Write a batch so that each record ends a row or a dead letter (see module doc)."""
    async def write(part: Sequence[Outcome]) -> None:
        await write_batch(engine, topics, part)

    async def refused(o: Outcome, failure: Failure) -> None:
        # Postgres refused a record validation let through: it is that record's dead letter.
        await write_batch(engine, topics, [Rejected(
            o.source, "unstorable", f"Postgres refused it ({failure.error}); fix the value "
            "it names, and report it: validation should have caught this")])

    await settle(outcomes, write, refused, policy, name=_position, logger=log)


class WritePipeline:
    """At most one batch write in flight; each commits its offsets once it is durable.

    A write task commits its own offsets after its transaction, and the next write starts
    only after `drain` has awaited the previous one, so commits happen in batch order and
    the committed position never runs ahead of what is in Postgres.
    """

    def __init__(self) -> None:
        self.pending: asyncio.Task[None] | None = None
        self.failed: BaseException | None = None
        self.commits = OrderedCommits(logger=log)

    async def drain(self) -> None:
        if self.failed is not None:
            raise RuntimeError("a batch write failed; the consumer is stopping") from self.failed
        if self.pending is None:
            return
        task, self.pending = self.pending, None
        try:
            await task
        except asyncio.CancelledError:
            raise  # shutdown gave up waiting: nothing was committed, the batch is redelivered
        except BaseException as err:
            # Fail-stop: nothing after this batch may be committed. The restart redelivers.
            self.failed = err
            log.error("writing a batch failed after retries; stopping: %s", err)
            os.kill(os.getpid(), signal.SIGTERM)
            raise

    def start(self, consumer: Any, records: list[RawRecord],
              write: Coroutine[Any, Any, None]) -> None:
        self.commits.open(records)

        async def write_then_commit() -> None:
            await write
            await self.commits.settled(consumer, records)

        self.pending = asyncio.create_task(write_then_commit())
