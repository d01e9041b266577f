"""`flywheel status`: pipeline counts from Postgres and consumer lag from Kafka."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.kafka import group_lag
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url

_COUNTS = text("""
SELECT (SELECT count(*) FROM trajectories)                          AS trajectories,
       (SELECT count(*) FROM trajectories WHERE is_failure)         AS failures,
       (SELECT count(*) FROM dead_letters)                          AS dlq,
       (SELECT count(*) FROM outbox WHERE published_at IS NULL)     AS outbox_pending,
       (SELECT count(*) FROM events)                                AS events
""")
_DLQ_REASONS = text("SELECT reason, count(*) FROM dead_letters GROUP BY reason ORDER BY reason")


async def collect(settings: Settings) -> dict[str, Any]:
    """Stable keys: trajectories, failures, dlq, dlq_by_reason, outbox_pending, events, lag."""
    engine = make_engine(resolve_db_url(settings), pool_size=1)
    try:
        async with engine.connect() as conn:
            row = (await conn.execute(_COUNTS)).mappings().one()
            reasons = {r: int(n) for r, n in (await conn.execute(_DLQ_REASONS)).all()}
    finally:
        await engine.dispose()
    bootstrap = resolve_bootstrap(settings)
    topics = settings.topics
    lag_parts = await group_lag(bootstrap, settings.ingest.group_id, topics.trajectories)
    return {
        **{k: int(v) for k, v in row.items()},
        "dlq_by_reason": reasons,
        "lag": {settings.ingest.group_id: {"topic": topics.trajectories,
                                           "total": sum(lag_parts.values()),
                                           "partitions": lag_parts}},
    }
