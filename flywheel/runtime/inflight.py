"""Several records of one subscriber in flight at once, their offsets committed in order.

A rollout worker keeps N groups sampling together (the engine batches them), so a handler
cannot settle its record before returning: it hands the record to `InFlight` and returns,
and FastStream delivers the next one. `InFlight.submit` waits while N are in flight, settles
each record as `flywheel.runtime.consume.handle` does (processed or parked, transient failures
retried), and commits a partition's offset only up to its earliest record still in flight
(`flywheel.runtime.commits`): a crash never skips a record that was not recorded, it redelivers the
unfinished ones (idempotent for the rollout worker: a recorded group is not sampled again).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flywheel.errors import describe
from flywheel.runtime.commits import OrderedCommits
from flywheel.runtime.consume import Park, Process, RetryPolicy, label, rewind, settle

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer, ConsumerRecord

log = logging.getLogger("flywheel.consume")


class InFlight:
    """Settles up to `limit` submissions at once and commits their offsets in order."""

    def __init__(self, limit: int, process: Process, park: Park, policy: RetryPolicy, *,
                 logger: logging.Logger = log) -> None:
        self.process, self.park, self.policy, self.log = process, park, policy, logger
        self._slots = asyncio.Semaphore(limit)
        self.commits = OrderedCommits(logger=logger)
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, records: Sequence[ConsumerRecord[bytes, bytes]],
                     consumer: AIOKafkaConsumer) -> None:
        """Start settling `records` once a slot is free; returns without waiting for them."""
        await self._slots.acquire()
        self.commits.open(records)
        task = asyncio.create_task(self._settle(list(records), consumer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle(self, records: list[ConsumerRecord[bytes, bytes]],
                      consumer: AIOKafkaConsumer) -> None:
        try:
            await settle(records, self.process, self.park, self.policy, name=label,
                         logger=self.log)
        except asyncio.CancelledError:
            raise  # left open: nothing commits past them; redelivered after a restart
        except Exception as err:
            rewind(consumer, records)  # left open, fetched again and settled then
            self.log.critical("could not settle %d records, not even park them (%s); they "
                              "are redelivered", len(records), describe(err), exc_info=err)
            await asyncio.sleep(self.policy.max_s)  # no hot loop
            return
        finally:
            self._slots.release()
        await self.commits.settled(consumer, records)

    async def close(self) -> None:
        """Stop every submission still running (they are redelivered: never committed)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
