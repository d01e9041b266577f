"""Acknowledged means stored: the records a broker acknowledged, held until Flywheel stored them.

A Kafka acknowledgement is a promise only from a durable broker. A local stack's bundled
broker keeps records in memory, so a record it acknowledged and then lost with its process
was never stored. `StoreConfirmer` holds each acknowledged record (its partition and offset)
until the consumer group that stores the topic (ingest for trajectories, the miner's feedback
group for feedback) has committed an offset past it; ingest commits only batches whose
transaction committed, in order, so a committed offset past a record means a row or a dead
letter.

A committed offset says something only about the broker instance it was read from, and a
replaced broker (the bundled one gets a fresh cluster id at every start, at the same address)
has offsets of its own that soon run past the lost instance's. So every record is confirmed
only against the instance that acknowledged it:

* the instance is the broker's cluster id (Metadata), read before the first send and again
  with every poll; a batch is tagged with the id known when it was handed to the producer.
  An instance, once gone, never comes back, so whatever acknowledged a batch is that
  instance or a later one;
* a poll reads the committed offsets first and the cluster id after them: a record whose tag
  equals the id read after the offsets was acknowledged by that instance, and the offsets came
  from it too (it ran before the send and after the read, so all along between);
* a record whose tag differs (a stale id, or none) is handed back to be sent again: a
  duplicate at worst, which ingest skips (it is idempotent on trajectory_id), never a loss.

Which brokers need it: `require=None` follows the broker — records are held while the
broker is a bundled one (`flywheel.runtime.kafka.is_bundled`) or not known yet, and counted
delivered at once by any other (a Kafka cluster's acks=all is durable). Only plain Kafka
APIs (Metadata, OffsetFetch through the admin client): no topic, no endpoint and no database
access of the producer's own.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from typing import Any, NamedTuple

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from flywheel.runtime.kafka import is_bundled
from producers.spool import Record


class Held(NamedTuple):
    offset: int
    instance: str | None
    """The cluster id known before the send: the instance that acknowledged it, or earlier."""
    seq: int
    """Order of arrival: a poll judges only what was held before its offsets were read."""
    record: Record


class StoreConfirmer:
    def __init__(self, bootstrap: str, topic: str, group: str, *, require: bool | None = None,
                 request_timeout_ms: int = 5000) -> None:
        """`require`: True holds every acknowledged record until stored; None only what a
        bundled broker (or one not known yet) acknowledged."""
        self._bootstrap, self._topic, self._group = bootstrap, topic, group
        self._require = require
        self._timeout_ms = request_timeout_ms
        self._admin: AIOKafkaAdminClient | None = None
        self._pending: dict[int, deque[Held]] = {}
        self._by_instance: Counter[str | None] = Counter()
        self._seq = 0
        self._instance: str | None = None
        """The broker's cluster id as last read (None: not read since the last connect)."""
        self.count = 0
        self.resent = 0
        """Records handed back because the instance that acknowledged them is gone."""

    def holds(self, instance: str | None) -> bool:
        """Whether what `instance` acknowledges waits until stored (else it is delivered)."""
        return bool(self._require) or instance is None or is_bundled(instance)

    @property
    def confirming(self) -> bool:
        """Whether records are held until stored now (`holds` for the broker last read)."""
        return self.holds(self._instance)

    def add(self, acked: list[tuple[int, int, Record]], instance: str | None) -> None:
        """(partition, offset, record) the broker acknowledged, in the order it did, for a
        batch sent while `instance` was the cluster id known (`before_send`)."""
        for partition, offset, record in acked:
            self._pending.setdefault(partition, deque()).append(
                Held(offset, instance, self._seq, record))
            self._seq += 1
        self._by_instance[instance] += len(acked)
        self.count += len(acked)

    def take_all(self) -> list[Record]:
        """Everything still pending (closing: it goes back to the spool)."""
        records = [h.record for q in self._pending.values() for h in q]
        self._pending, self._by_instance, self.count = {}, Counter(), 0
        return records

    async def start(self) -> None:
        """Learn the broker's cluster id before anything is sent (best effort: a broker that
        is down is read before the first send that reaches it)."""
        await self.before_send()

    def forget(self) -> None:
        """A new connection to the broker: read its cluster id again before the next send
        (else a replacement is seen only by the next poll, and that batch sent twice)."""
        self._instance = None

    async def before_send(self) -> str | None:
        """The cluster id to tag a batch with: the one known, else read now (None when the
        broker does not answer: what it acknowledges is then sent again once it is known)."""
        if self._instance is None:
            try:
                self._instance = await self._cluster_id()
            except Exception:  # the send will meet the same broker and say what is wrong
                pass
        return self._instance

    async def poll(self) -> tuple[int, list[Record]]:
        """(how many pending records are now delivered, records to send again). Nothing
        pending asks the broker nothing (an idle producer polls every `confirm_interval_s`)."""
        if not self.count:
            return 0, []
        judged = self._seq  # held before the offsets are read: judged by them
        parts = [TopicPartition(self._topic, p) for p, q in self._pending.items() if q]
        committed = await self._committed(parts)
        instance = self._instance = await self._cluster_id()  # after the offsets: see above
        resend: list[Record] = []
        if {i for i, n in self._by_instance.items() if n > 0} - {instance}:
            resend = self._drop_others(instance)
            self.resent += len(resend)
        if not self.count:
            return 0, resend
        if not self.holds(instance):  # a durable broker acknowledged what is left
            return len(self.take_all()), resend
        stored = 0
        for tp in parts:
            done = committed.get(tp)
            queue = self._pending.get(tp.partition)
            while done is not None and queue and queue[0].seq < judged \
                    and queue[0].offset < done.offset:
                queue.popleft()
                stored += 1
        self.count -= stored
        self._by_instance[instance] -= stored
        return stored, resend

    def _drop_others(self, instance: str | None) -> list[Record]:
        """Take out what another instance (or an unknown one) acknowledged, in order."""
        gone: list[Record] = []
        for partition, queue in self._pending.items():
            keep = deque(h for h in queue if h.instance == instance)
            gone += [h.record for h in queue if h.instance != instance]
            self._pending[partition] = keep
        self._by_instance = Counter({instance: self._by_instance[instance]})
        self.count -= len(gone)
        return gone

    async def _committed(self, parts: list[TopicPartition]) -> dict[TopicPartition, Any]:
        await self._connected()
        assert self._admin is not None
        try:
            result: dict[TopicPartition, Any] = await asyncio.wait_for(
                self._admin.list_consumer_group_offsets(self._group, partitions=parts),
                self._timeout_ms / 1000)
        except BaseException:
            await self.close()  # a fresh client next time: the old one may never reconnect
            raise
        return result

    async def _cluster_id(self) -> str | None:
        await self._connected()
        assert self._admin is not None
        try:
            described: dict[str, Any] = await asyncio.wait_for(
                self._admin.describe_cluster(), self._timeout_ms / 1000)
        except BaseException:
            await self.close()
            raise
        cluster = described.get("cluster_id")
        return str(cluster) if cluster is not None else None

    async def _connected(self) -> None:
        if self._admin is not None:
            return
        admin = AIOKafkaAdminClient(bootstrap_servers=self._bootstrap,
                                    request_timeout_ms=self._timeout_ms)
        try:
            await asyncio.wait_for(admin.start(), self._timeout_ms / 1000)
        except BaseException:
            await _close_quietly(admin, self._timeout_ms / 1000)
            raise
        self._admin = admin

    async def close(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            await _close_quietly(admin, self._timeout_ms / 1000)


async def _close_quietly(admin: AIOKafkaAdminClient, wait_s: float) -> None:
    try:
        await asyncio.wait_for(admin.close(), wait_s)
    except Exception:  # a client that lost its broker is discarded anyway
        pass
