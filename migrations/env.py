"""Alembic environment (async). The DSN comes from Flywheel's settings, never from a file."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from flywheel.db.engine import make_engine
from flywheel.db.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from flywheel.config import Settings
    from flywheel.runtime.endpoints import resolve_db_url

    return resolve_db_url(Settings())


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata,
                      compare_type=True, compare_server_default=True)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    engine = make_engine(_url(), pool_size=1)
    async with engine.connect() as conn:
        await conn.run_sync(_run)
    await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_async())
