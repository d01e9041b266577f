"""`flywheel bench ingest`: producer → Kafka → ingest → Postgres, against raw COPY.

Starts its own broker and Postgres in a temporary directory, so figures are comparable run
to run. Reports:
  trajectories_per_s  N trajectories from first send until every row is durable;
  copy_rows_per_s     COPY of the same rows into an identical table (the practical limit);
  naive_rows_per_s    one INSERT + commit per row, on a sample;
  ratio_vs_copy       trajectories_per_s / copy_rows_per_s.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer

from flywheel.bench.stack import temp_stack
from flywheel.config import Settings, settings_env
from flywheel.demo.samples import make_trajectory
from flywheel.trajectory import Trajectory, parse_trajectory

NAIVE_SAMPLE = 2_000


def _dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


async def _count(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval("SELECT count(*) FROM trajectories"))


async def _produce(bootstrap: str, topic: str, values: list[tuple[bytes, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=10,
                                max_batch_size=1 << 20, max_request_size=8 << 20)
    await producer.start()
    try:
        pending = []
        for key, value in values:
            pending.append(await producer.send(topic, value, key=key))
            if len(pending) >= 5_000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


def _row(t: Trajectory) -> tuple[Any, ...]:
    return (t.trajectory_id, t.agent, t.session_id, t.status, t.is_failure, t.model,
            t.adapter_version, t.started_at, t.ended_at, "bench", 0, 0,
            t.model_dump_json(exclude_none=True))


COLUMNS = ["trajectory_id", "agent", "session_id", "status", "is_failure", "model",
           "adapter_version", "started_at", "ended_at", "source_topic", "source_partition",
           "source_offset", "record"]


async def _pipeline(settings: Settings, values: list[tuple[bytes, bytes]], log: Path,
                    tick: Any, workers: int) -> float:
    assert settings.kafka.bootstrap and settings.db.url
    topic = settings.topics.trajectories
    conn = await asyncpg.connect(_dsn(settings.db.url))
    env = {**os.environ, **settings_env(settings)}
    with open(log, "ab") as out:
        procs = [subprocess.Popen([sys.executable, "-m", "consumers.ingest"], env=env,
                                  stdout=out, stderr=subprocess.STDOUT) for _ in range(workers)]
    try:
        # Warm-up record: the group has formed and written once before timing starts.
        await asyncio.sleep(settings.kafka.session_timeout_ms / 1000 if workers > 1 else 0)
        await _produce(settings.kafka.bootstrap, topic, [values[0]])
        while await _count(conn) < 1:
            _check(procs, log)
            await asyncio.sleep(0.05)
        n = len(values) - 1
        t0 = time.perf_counter()
        producing = asyncio.create_task(_produce(settings.kafka.bootstrap, topic, values[1:]))
        while (done := await _count(conn) - 1) < n:
            tick(done)
            _check(procs, log)
            await asyncio.sleep(0.1)
        elapsed = time.perf_counter() - t0
        await producing
        tick(n)
        return n / elapsed
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        await conn.close()


def _check(procs: list[subprocess.Popen[bytes]], log: Path) -> None:
    if any(p.poll() is not None for p in procs):
        raise RuntimeError(f"an ingest consumer died; see {log}")


async def _copy_and_naive(dsn: str, rows: list[tuple[Any, ...]]) -> tuple[float, float]:
    conn = await asyncpg.connect(dsn)
    try:
        for name in ("bench_copy", "bench_naive"):
            await conn.execute(f"CREATE TABLE {name} (LIKE trajectories INCLUDING ALL)")
        t0 = time.perf_counter()
        async with conn.transaction():
            await conn.copy_records_to_table("bench_copy", records=rows, columns=COLUMNS)
        copy_rate = len(rows) / (time.perf_counter() - t0)
        sample = rows[:NAIVE_SAMPLE]
        placeholders = ", ".join(f"${i}" for i in range(1, len(COLUMNS) + 1))
        sql = (f"INSERT INTO bench_naive ({', '.join(COLUMNS)}) VALUES "
               f"({placeholders.replace('$13', '$13::jsonb')})")
        t0 = time.perf_counter()
        for row in sample:
            await conn.execute(sql, *row)  # autocommit: one commit per row
        naive_rate = len(sample) / (time.perf_counter() - t0)
        return copy_rate, naive_rate
    finally:
        await conn.close()


def run_bench(n: int, *, workers: int = 1, progress: bool = True, seed: int = 0
              ) -> dict[str, Any]:
    from rich.progress import Progress

    rng = random.Random(seed)
    records = [make_trajectory(rng, chat_format=i % 3 == 0) for i in range(n + 1)]
    values = [(r["trajectory_id"].encode(), json.dumps(r).encode()) for r in records]
    rows = [_row(parse_trajectory(r)) for r in records[1:]]
    with temp_stack() as settings:
        assert settings.db.url
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("producer → kafka → postgres", total=n)
            rate = asyncio.run(_pipeline(settings, values, settings.home / "ingest.log",
                                         lambda done: bar.update(task, completed=done), workers))
        copy_rate, naive_rate = asyncio.run(_copy_and_naive(_dsn(settings.db.url), rows))
    return {
        "n": n,
        "ingest_workers": workers,
        "payload_bytes_mean": round(sum(len(v) for _, v in values) / len(values)),
        "trajectories_per_s": round(rate, 1),
        "copy_rows_per_s": round(copy_rate, 1),
        "naive_rows_per_s": round(naive_rate, 1),
        "ratio_vs_copy": round(rate / copy_rate, 3),
        "speedup_vs_naive": round(rate / naive_rate, 2),
    }
