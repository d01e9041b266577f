"""Test session services: one real broker and one real Postgres, started by the session.

Each test gets its own database (a copy of a migrated template) and its own topic prefix,
so tests never see each other's data.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.config import DbSettings, KafkaSettings, Settings
from flywheel.db import migrate
from flywheel.db.engine import make_engine
from flywheel.runtime.broker import LocalBroker, free_port
from flywheel.runtime.postgres import LocalPostgres

TEMPLATE_DB = "flywheel_template"


@pytest.fixture(scope="session")
def services_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="flywheel-test-"))
    base.chmod(0o755)  # our own fresh directory: the unprivileged Postgres user must reach it
    yield base


@pytest.fixture(scope="session")
def broker(services_dir: Path) -> Iterator[LocalBroker]:
    if os.environ.get("FLYWHEEL_TEST_KAFKA"):
        pytest.skip("external broker configured")  # pragma: no cover
    b = LocalBroker(free_port(), services_dir / "broker.log")
    b.start()
    yield b
    b.stop()


@pytest.fixture(scope="session")
def postgres(services_dir: Path) -> Iterator[LocalPostgres]:
    pg = LocalPostgres(services_dir / "pg", free_port())
    pg.start()
    yield pg
    pg.stop()


def _pg_dsn(url: str, db: str) -> str:
    base = url.replace("postgresql+asyncpg://", "postgresql://").rsplit("/", 1)[0]
    return f"{base}/{db}"


@pytest.fixture(scope="session")
def template_db(postgres: LocalPostgres) -> str:
    import asyncio

    async def make() -> None:
        conn = await asyncpg.connect(_pg_dsn(postgres.url, "postgres"))
        try:
            await conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE_DB}")
            await conn.execute(f"CREATE DATABASE {TEMPLATE_DB}")
        finally:
            await conn.close()

    asyncio.run(make())
    url = postgres.url.rsplit("/", 1)[0] + f"/{TEMPLATE_DB}"
    migrate.upgrade(url)
    return url


@pytest.fixture
async def db_url(postgres: LocalPostgres, template_db: str) -> AsyncIterator[str]:
    """A fresh, migrated database for this test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(_pg_dsn(postgres.url, "postgres"))
    try:
        await conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    finally:
        await conn.close()
    yield postgres.url.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture
def pg_dsn(db_url: str) -> str:
    """The same database as `db_url`, as a plain asyncpg DSN (for assertions)."""
    return _pg_dsn(db_url, db_url.rsplit("/", 1)[1])


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    """An async SQLAlchemy engine on this test's database."""
    e = make_engine(db_url)
    yield e
    await e.dispose()


@pytest.fixture
def settings(broker: LocalBroker, db_url: str, tmp_path: Path) -> Settings:
    return Settings(
        home=tmp_path / "home",
        kafka=KafkaSettings(bootstrap=broker.bootstrap,
                            topic_prefix=f"t{uuid.uuid4().hex[:10]}",
                            session_timeout_ms=2000, heartbeat_interval_ms=500),
        db=DbSettings(url=db_url),
    )
