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
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url
from flywheel.runtime.entrypoint import pause, run_loop

log = logging.getLogger("flywheel.relay")

_CLAIM = text("""
SELECT id, topic, key, value FROM outbox
WHERE published_at IS NULL AND error IS NULL ORDER BY id LIMIT :limit FOR UPDATE SKIP LOCKED
""")
_MARK = text("UPDATE outbox SET published_at = now() WHERE id = ANY(CAST(:ids AS bigint[]))")
_PARK = text("UPDATE outbox SET error = :error WHERE id = :id")
MAX_MESSAGE_BYTES = 8 * 1_048_576


def retriable(err: BaseException) -> bool:
    """Broker or network trouble that a later round can overcome."""
    if isinstance(err, KafkaError):
        return bool(getattr(err, "retriable", False)) or isinstance(
            err, KafkaConnectionError | KafkaTimeoutError)
    return isinstance(err, OSError | TimeoutError | DBAPIError)


async def relay_once(engine: AsyncEngine, producer: AIOKafkaProducer, limit: int) -> int:
    """Publish up to `limit` pending rows; returns how many were published.

    A row the broker refuses for good (too large, say) is parked with its error instead of
    blocking every row behind it; a retriable error rolls the round back for a later retry.
    """
    async with engine.begin() as conn:
        rows = (await conn.execute(_CLAIM, {"limit": limit})).all()
        if not rows:
            return 0
        sent: list[tuple[int, Any]] = []
        parked: list[tuple[int, str]] = []
        for row_id, topic, key, value in rows:
            try:
                sent.append((row_id, await producer.send(topic, value, key=key.encode())))
            except KafkaError as err:
                if retriable(err):
                    raise
                parked.append((row_id, f"{type(err).__name__}: {err}"))
        results = await asyncio.gather(*(f for _, f in sent), return_exceptions=True)
        ok = []
        for (row_id, _), result in zip(sent, results, strict=True):
            if isinstance(result, BaseException):
                if retriable(result):
                    raise result
                parked.append((row_id, f"{type(result).__name__}: {result}"))
            else:
                ok.append(row_id)
        await conn.execute(_MARK, {"ids": ok})
        for row_id, error in parked:
            log.error("outbox row %d refused by the broker, parked: %s", row_id, error)
            await conn.execute(_PARK, {"id": row_id, "error": error})
    return len(ok)


async def run_relay(settings: Settings, stop: asyncio.Event) -> None:
    engine = make_engine(resolve_db_url(settings), pool_size=1)
    producer = AIOKafkaProducer(bootstrap_servers=resolve_bootstrap(settings), acks="all",
                                linger_ms=5, max_request_size=MAX_MESSAGE_BYTES)
    await producer.start()
    cfg = settings.relay
    try:
        while not stop.is_set():
            try:
                sent = await relay_once(engine, producer, cfg.batch_size)
            except Exception as err:
                if not retriable(err):
                    raise
                log.warning("outbox relay round failed, retrying: %s", err)
                await pause(stop, min(5.0, 10 * cfg.poll_interval_s))
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
