import asyncpg
import pytest

from flywheel.config import Settings
from flywheel.runtime.kafka import ensure_topics
from flywheel.stack.postgres import LocalPostgres


async def test_services_start_and_database_is_migrated(settings: Settings, pg_dsn: str) -> None:
    await ensure_topics(settings.kafka.bootstrap or "", settings.topics.all(), partitions=3)
    conn = await asyncpg.connect(pg_dsn)
    try:
        tables = {r[0] for r in await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    finally:
        await conn.close()
    assert {"trajectories", "events", "outbox", "dead_letters", "alembic_version"} <= tables


async def test_local_postgres_requires_its_password(postgres: LocalPostgres) -> None:
    assert postgres.password and postgres.password_file.stat().st_mode & 0o077 == 0
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{postgres.port}/postgres")
    conn = await asyncpg.connect(postgres.url.replace("+asyncpg", ""))
    await conn.close()
