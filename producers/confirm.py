"""Acknowledged means stored: the records a broker acknowledged, held until Flywheel stored them.

A Kafka acknowledgement is a promise only from a durable broker. The bundled broker keeps
records in memory, so a record it acknowledged and then lost with its process was never
stored. `StoreConfirmer` holds each acknowledged record (its partition and offset) until the
consumer group that stores the topic (ingest for trajectories, the miner's feedback group
for feedback) has committed an offset past it; ingest commits only batches whose transaction
committed, in order, so a committed offset past a record means a row or a dead letter.

How the producer learns it: the group's committed offsets (OffsetFetch) and the broker's
cluster id (Metadata), both plain Kafka APIs read through the admin client — no topic, no
endpoint and no database access of its own. A broker that was replaced (the bundled broker
gets a fresh cluster id at every start; a Kafka cluster has its own) is noticed by its new
cluster id: every record the old one acknowledged and had not been seen stored is handed back
to be sent again. Ingest is idempotent on trajectory_id, so a re-send is never a duplicate row.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from flywheel.config import Settings
from producers.spool import Record


def confirm_stored(settings: Settings) -> bool:
    """Whether producers wait for Flywheel to store a record (`kafka.confirm_stored`):
    by default yes on the bundled memory-only broker, no on an external Kafka cluster,
    whose acknowledgement (acks=all) is already durable."""
    setting = settings.kafka.confirm_stored
    return settings.kafka.bootstrap is None if setting is None else setting


class StoreConfirmer:
    def __init__(self, bootstrap: str, topic: str, group: str, *,
                 request_timeout_ms: int = 5000) -> None:
        self._bootstrap, self._topic, self._group = bootstrap, topic, group
        self._timeout_ms = request_timeout_ms
        self._admin: AIOKafkaAdminClient | None = None
        self._pending: dict[int, deque[tuple[int, Record]]] = {}
        self._cluster: str | None = None
        """Cluster id last read: the broker that acknowledged what is pending."""
        self.count = 0
        self.resent = 0
        """Records handed back because the broker that acknowledged them was replaced."""

    def add(self, acked: list[tuple[int, int, Record]]) -> None:
        """(partition, offset, record) the broker acknowledged, in the order it did."""
        for partition, offset, record in acked:
            self._pending.setdefault(partition, deque()).append((offset, record))
        self.count += len(acked)

    def take_all(self) -> list[Record]:
        """Everything still pending (closing: it goes back to the spool)."""
        records = [r for q in self._pending.values() for _, r in q]
        self._pending, self.count = {}, 0
        return records

    async def start(self) -> None:
        """Learn the broker's cluster id before anything is sent (best effort: a broker that
        is down is read on the first poll, and what was pending then is sent again)."""
        try:
            self._cluster = await self._cluster_id()
        except Exception:
            await self.close()

    async def poll(self) -> tuple[int, list[Record]]:
        """(how many pending records are now stored, records to send again). Nothing
        pending asks the broker nothing (an idle producer polls every `confirm_interval_s`);
        a broker replaced while idle is then seen at the next poll with records pending and
        those are sent again — duplicates at worst, which ingest skips, never a loss."""
        if not self.count:
            return 0, []
        cluster = await self._cluster_id()
        if cluster != self._cluster:
            self._cluster = cluster
            resend = self.take_all()
            self.resent += len(resend)
            return 0, resend
        assert self._admin is not None
        parts = [TopicPartition(self._topic, p) for p, q in self._pending.items() if q]
        committed = await asyncio.wait_for(
            self._admin.list_consumer_group_offsets(self._group, partitions=parts),
            self._timeout_ms / 1000)
        stored = 0
        for tp in parts:
            done = committed.get(tp)
            queue = self._pending[tp.partition]
            while done is not None and queue and queue[0][0] < done.offset:
                queue.popleft()
                stored += 1
        self.count -= stored
        return stored, []

    async def _cluster_id(self) -> str | None:
        try:
            if self._admin is None:
                admin = AIOKafkaAdminClient(bootstrap_servers=self._bootstrap,
                                            request_timeout_ms=self._timeout_ms)
                await asyncio.wait_for(admin.start(), self._timeout_ms / 1000)
                self._admin = admin
            described: dict[str, Any] = await asyncio.wait_for(
                self._admin.describe_cluster(), self._timeout_ms / 1000)
        except BaseException:
            await self.close()  # a fresh client next time: the old one may never reconnect
            raise
        cluster = described.get("cluster_id")
        return str(cluster) if cluster is not None else None

    async def close(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            try:
                await asyncio.wait_for(admin.close(), self._timeout_ms / 1000)
            except Exception:  # a client that lost its broker is discarded anyway
                pass
