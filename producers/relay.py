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
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError, UnknownError
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


UNKNOWN_STRIKES = 5
"""Rounds a row may meet the broker's UNKNOWN_SERVER_ERROR before it is parked."""


def _retry(err: BaseException, row_id: int, strikes: dict[int, int]) -> bool:
    """Whether the round is retried for this row's error (else the row is parked)."""
    if retriable(err):
        return True
    if isinstance(err, UnknownError):
        strikes[row_id] = strikes.get(row_id, 0) + 1
        return strikes[row_id] < UNKNOWN_STRIKES
    return False


def retriable(err: BaseException) -> bool:
    """Broker or network trouble that a later round can overcome."""
    if isinstance(err, KafkaError):
        return bool(getattr(err, "retriable", False)) or isinstance(
            err, KafkaConnectionError | KafkaTimeoutError)
    return isinstance(err, OSError | TimeoutError | DBAPIError)


async def relay_once(engine: AsyncEngine, producer: AIOKafkaProducer, limit: int,
                     strikes: dict[int, int] | None = None) -> int:
    """Publish up to `limit` pending rows; returns how many were published.

    A row the broker refuses for good (too large, say) is parked with its error instead of
    blocking every row behind it; a retriable error rolls the round back for a later retry.
    The broker's UNKNOWN_SERVER_ERROR is retried the same way until a row has met it in
    `UNKNOWN_STRIKES` rounds (counted in `strikes`, which the caller keeps), then parked:
    the bundled broker answers it for a write race that a resend wins, but it must not
    block every row behind one forever.
    """
    strikes = {} if strikes is None else strikes
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
                if _retry(err, row_id, strikes):
                    await asyncio.gather(*(f for _, f in sent), return_exceptions=True)
                    raise
                parked.append((row_id, f"{type(err).__name__}: {err}"))
        results = await asyncio.gather(*(f for _, f in sent), return_exceptions=True)
        ok, again = [], None
        for (row_id, _), result in zip(sent, results, strict=True):
            if isinstance(result, BaseException):
                if _retry(result, row_id, strikes):
                    again = again or result
                else:
                    parked.append((row_id, f"{type(result).__name__}: {result}"))
            else:
                ok.append(row_id)
                strikes.pop(row_id, None)
        if again is not None:
            raise again
        await conn.execute(_MARK, {"ids": ok})
        for row_id, error in parked:
            log.error("outbox row %d refused by the broker, parked: %s", row_id, error)
            await conn.execute(_PARK, {"id": row_id, "error": error})
    for row_id, _ in parked:  # committed: a parked row is no longer counted
        strikes.pop(row_id, None)
    return len(ok)


async def run_relay(settings: Settings, stop: asyncio.Event) -> None:
    engine = make_engine(resolve_db_url(settings), pool_size=1)
    producer = AIOKafkaProducer(bootstrap_servers=resolve_bootstrap(settings), acks="all",
                                linger_ms=5, max_request_size=MAX_MESSAGE_BYTES)
    await producer.start()
    cfg = settings.relay
    strikes: dict[int, int] = {}
    try:
        while not stop.is_set():
            try:
                sent = await relay_once(engine, producer, cfg.batch_size, strikes)
            except Exception as err:
                if not (retriable(err) or isinstance(err, UnknownError)):
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
