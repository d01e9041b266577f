import asyncpg

from flywheel.config import Settings
from flywheel.kafka import ensure_topics


async def test_services_start_and_database_is_migrated(settings: Settings, pg_dsn: str) -> None:
    await ensure_topics(settings.kafka.bootstrap or "", settings.topics.all(), partitions=3)
    conn = await asyncpg.connect(pg_dsn)
    try:
        tables = {r[0] for r in await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    finally:
        await conn.close()
    assert {"trajectories", "events", "outbox", "dead_letters", "alembic_version"} <= tables
