"""The offset ledger of a consumer that holds records past their fetch (the trainer's batch):
which offsets it has seen per partition, and how far each partition may be committed while
some records are still held — never past the first one whose effect is not durable yet."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer

log = logging.getLogger("flywheel.runtime")


class OffsetLedger:
    """The next offset seen per partition; the commit stops at the first record still held."""

    def __init__(self) -> None:
        self.consumed: dict[TopicPartition, int] = {}

    def seen(self, tp: TopicPartition, offset: int) -> None:
        """A record was fetched: everything up to it may move once nothing before it is held."""
        self.consumed[tp] = max(self.consumed.get(tp, 0), offset + 1)

    def committable(self, held: Iterable[tuple[TopicPartition, int]]) -> dict[TopicPartition, int]:
        """Per partition: every offset seen, up to (not past) the first `held` one."""
        safe = dict(self.consumed)
        for tp, offset in held:
            safe[tp] = min(safe.get(tp, offset), offset)
        return safe

    async def commit(self, consumer: AIOKafkaConsumer,
                     held: Iterable[tuple[TopicPartition, int]]) -> None:
        """Commit what `committable` allows; a failed commit only means redelivery, which the
        consumer recognises (its effects are idempotent), so it is logged, not raised."""
        try:
            await consumer.commit(self.committable(held))
        except KafkaError as err:
            log.warning("offset commit skipped (%s); redelivered records are skipped", err)
