"""A throwaway broker + Postgres for a benchmark run, so figures are comparable run to run."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flywheel.config import DbSettings, KafkaSettings, Settings
from flywheel.db import migrate
from flywheel.runtime.kafka import ensure_topics
from flywheel.stack.broker import LocalBroker, free_port
from flywheel.stack.postgres import LocalPostgres


@contextmanager
def temp_stack(**overrides: Any) -> Iterator[Settings]:
    """Settings pointing at a fresh, migrated Postgres and a broker with every topic."""
    base = Path(tempfile.mkdtemp(prefix="flywheel-bench-"))
    base.chmod(0o755)  # our own fresh directory: the unprivileged Postgres user must reach it
    broker = LocalBroker(free_port(), base / "broker.log")
    pg = LocalPostgres(base / "pg", free_port())
    try:
        broker.start()
        pg.start()
        migrate.upgrade(pg.url)
        settings = Settings(home=base, kafka=KafkaSettings(
            bootstrap=broker.bootstrap, session_timeout_ms=3000, heartbeat_interval_ms=500),
            db=DbSettings(url=pg.url), **overrides)
        asyncio.run(ensure_topics(broker.bootstrap, settings.topics.all(), partitions=3))
        yield settings
    finally:
        broker.stop()
        pg.stop()
        shutil.rmtree(base, ignore_errors=True)
