"""Kafka plumbing shared by services: topic creation and consumer-group lag.

Lag is `highwater − committed` per partition. The highwater is read from a fetch response
(seek to the committed offset, fetch one record), which every Kafka-protocol broker answers
correctly; ListOffsets-based `end_offsets` is not used.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, UnknownError

from flywheel.config import Settings
from flywheel.errors import is_transient

BUNDLED_CLUSTER_PREFIX = "flywheel-bundled-"
"""How a local stack's bundled broker names its cluster (a fresh id at every start). It keeps
records in memory only, so its acknowledgement is not storage: a producer that reads this
from the broker (Metadata's cluster id) waits for Flywheel to store what it sends
(`producers.confirm`). A Kafka cluster's id is a base64 UUID of 22 characters: never this."""

RESEND_BACKOFF_S = (0.1, 0.3, 1.0, 2.0)
"""Pauses between resends of what a broker failed to store (the last one repeats)."""


def is_bundled(cluster_id: str | None) -> bool:
    """Whether a broker that reports `cluster_id` is a local stack's bundled broker."""
    return cluster_id is not None and cluster_id.startswith(BUNDLED_CLUSTER_PREFIX)


def resendable(exc: BaseException) -> bool:
    """A failed send worth sending again: what is transient for everyone, and the broker's
    UNKNOWN_SERVER_ERROR (-1), which is a broker-side failure and not a verdict on the
    record. The bundled broker answers it when two producers write a fresh partition's
    first batch at once (its object store refuses the second write of offset 0); the
    same send a moment later is stored at the next offset."""
    return isinstance(exc, UnknownError) or is_transient(exc)


async def send_all(producer: AIOKafkaProducer, topic: str,
                   records: Sequence[tuple[bytes | None, bytes]], *,
                   deadline_s: float = 60.0) -> int:
    """Send every (key, value) and wait until the broker has acknowledged each; what fails
    resendably is sent again (only that) with backoff until `deadline_s`, then the last
    error is raised, as is at once any other. Every future is awaited: none is left with
    an exception never retrieved. Resends may duplicate: consumers must be idempotent.
    Returns how many sends were resends."""
    deadline, pending, resent, attempt = time.monotonic() + deadline_s, list(records), 0, 0
    while True:
        futures = []
        for key, value in pending:
            try:
                futures.append(await producer.send(topic, value, key=key))
            except Exception as refused:  # before it was queued (e.g. no metadata)
                futures.append(_failed(refused))
        results = await asyncio.gather(*futures, return_exceptions=True)
        failed = [(rec, r) for rec, r in zip(pending, results, strict=True)
                  if isinstance(r, BaseException)]
        if not failed:
            return resent
        for _, error in failed:
            if not resendable(error):  # a refusal, or a cancelled send
                raise error
        pause = RESEND_BACKOFF_S[min(attempt, len(RESEND_BACKOFF_S) - 1)]
        if time.monotonic() + pause > deadline:
            raise failed[-1][1]
        await asyncio.sleep(pause)
        attempt, pending = attempt + 1, [rec for rec, _ in failed]
        resent += len(pending)


def _failed(err: BaseException) -> asyncio.Future[None]:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_exception(err)
    return future


def consumer_groups(settings: Settings) -> list[tuple[str, str]]:
    """(group, topic) of every consumer group the stack runs: whose lag is reported, and
    what `flywheel down` drains."""
    topics = settings.topics
    return [(settings.ingest.group_id, topics.trajectories),
            (settings.miner.group_id, topics.trajectories),
            (settings.miner.feedback_group_id, topics.feedback),
            (settings.rollout.group_id, topics.rollout_requests),
            (settings.trainer.group_id, topics.rollouts),
            (settings.gate.group_id, topics.adapters),
            (settings.validation.group_id, topics.adapters)]


async def ensure_topics(bootstrap: str, topics: Iterable[str], *, partitions: int,
                        replication_factor: int = 1, retention_ms: int | None = None) -> None:
    """Create the topics that are missing (existing ones are left as they are)."""
    configs = {"retention.ms": str(retention_ms)} if retention_ms else {}
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [t for t in topics if t not in existing]
        if missing:
            try:
                await admin.create_topics([NewTopic(t, partitions, replication_factor,
                                                    topic_configs=configs)
                                           for t in missing])
            except TopicAlreadyExistsError:
                pass  # created concurrently by another process
    finally:
        await admin.close()


async def group_lag(bootstrap: str, group_id: str, topic: str) -> dict[int, int]:
    """Per-partition lag of `group_id` on `topic` (uncommitted partitions count from 0)."""
    return {p: max(0, high - done)
            for p, (done, high) in (await group_positions(bootstrap, group_id, topic)).items()}


async def group_positions(bootstrap: str, group_id: str, topic: str
                          ) -> dict[int, tuple[int, int]]:
    """Per partition of `topic`: (offset `group_id` committed, highwater)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group_id,
                                enable_auto_commit=False)
    try:  # stopped even when starting fails (broker down) or is cancelled
        await consumer.start()
        parts = consumer.partitions_for_topic(topic)
        if not parts:
            await consumer._client.force_metadata_update()
            parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        if not tps:
            return {}
        committed = {tp: (await consumer.committed(tp)) or 0 for tp in tps}
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, committed[tp])
        highwater: dict[TopicPartition, int | None] = dict.fromkeys(tps)
        deadline = asyncio.get_running_loop().time() + 5
        while any(v is None for v in highwater.values()):
            await consumer.getmany(*[tp for tp, v in highwater.items() if v is None],
                                   timeout_ms=200, max_records=1)
            for tp in tps:
                if highwater[tp] is None:
                    highwater[tp] = consumer.highwater(tp)
            if asyncio.get_running_loop().time() > deadline:
                break
        return {tp.partition: (committed[tp], highwater[tp] or committed[tp]) for tp in tps}
    finally:
        await consumer.stop()
