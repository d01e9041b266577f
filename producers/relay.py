"""Outbox relay: publishes rows of the `outbox` table to Kafka, in order, at least once.

Reads:      `outbox` rows with `published_at IS NULL` (FOR UPDATE SKIP LOCKED, so several
            relays can run), oldest first.
Publishes:  each row's value to its topic, keyed by the event's aggregate id.
Writes:     `outbox.published_at` once the broker has acknowledged the row.

A crash between the domain commit and the publish loses nothing: the row is still pending
and is published on restart. A crash after publishing but before marking republishes the
row; consumers dedupe on `event_id`.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaProducer
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url
from flywheel.runtime.service import pause, run_loop

log = logging.getLogger("flywheel.relay")

_CLAIM = text("""
SELECT id, topic, key, value FROM outbox
WHERE published_at IS NULL ORDER BY id LIMIT :limit FOR UPDATE SKIP LOCKED
""")
_MARK = text("UPDATE outbox SET published_at = now() WHERE id = ANY(CAST(:ids AS bigint[]))")


async def relay_once(engine: AsyncEngine, producer: AIOKafkaProducer, limit: int) -> int:
    """Publish up to `limit` pending rows; returns how many were published."""
    async with engine.begin() as conn:
        rows = (await conn.execute(_CLAIM, {"limit": limit})).all()
        if not rows:
            return 0
        futures = [await producer.send(topic, value, key=key.encode())
                   for _, topic, key, value in rows]
        await asyncio.gather(*futures)
        await conn.execute(_MARK, {"ids": [r[0] for r in rows]})
    return len(rows)


async def run_relay(settings: Settings, stop: asyncio.Event) -> None:
    engine = make_engine(resolve_db_url(settings), pool_size=1)
    producer = AIOKafkaProducer(bootstrap_servers=resolve_bootstrap(settings), acks="all",
                                linger_ms=5)
    await producer.start()
    cfg = settings.relay
    try:
        while not stop.is_set():
            try:
                sent = await relay_once(engine, producer, cfg.batch_size)
            except (TimeoutError, OSError) as err:  # transient: retry next round
                log.warning("outbox relay round failed, retrying: %s", err)
                sent = 0
            if sent < cfg.batch_size:
                await pause(stop, cfg.poll_interval_s)
    finally:
        await producer.stop()
        await engine.dispose()


def main() -> None:
    run_loop(run_relay)


if __name__ == "__main__":
    main()
