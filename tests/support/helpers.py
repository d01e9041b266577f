"""Test helpers: child services as real processes, Kafka publishing, DB counts."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import asyncpg
from aiokafka import AIOKafkaProducer

from flywheel.config import GateSettings, Settings, settings_env


def spawn(module: str, settings: Settings, log: Path) -> subprocess.Popen[bytes]:
    """Run `python -m module` with `settings` in its environment."""
    # One intra-op thread: children run torch next to the test process (see torch_threads).
    env = {"OMP_NUM_THREADS": "1", **os.environ, **settings_env(settings)}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", module], env=env, stdout=out,
                                stderr=subprocess.STDOUT)


async def produce(bootstrap: str, topic: str, values: Iterable[bytes]) -> int:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        futures = [await producer.send(topic, v) for v in values]
        await asyncio.gather(*futures)
        return len(futures)
    finally:
        await producer.stop()


def dumps(records: Iterable[dict[str, object]]) -> list[bytes]:
    return [json.dumps(r).encode() for r in records]


async def scalar(dsn: str, sql: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(sql))
    finally:
        await conn.close()


async def wait_for(dsn: str, sql: str, expected: int, timeout: float = 60) -> int:
    """Poll `sql` until it returns `expected` (or the timeout passes); returns the last value."""
    deadline = asyncio.get_running_loop().time() + timeout
    value = -1
    while asyncio.get_running_loop().time() < deadline:
        value = await scalar(dsn, sql)
        if value == expected:
            return value
        await asyncio.sleep(0.25)
    return value


def machinery_gate(gate: GateSettings, **update: object) -> GateSettings:
    """`gate` loosened for tests of the gate's machinery with random adapters.

    Random adapters are not better than the base model and sample different failure mixes
    from run to run (a real vLLM server is not bit-reproducible across machines): the
    significance and gain checks pass by the documented `test_only_accept`, and every guard
    metric and behaviour-shift check (truncation, abstention, reply length, calls per turn,
    dropped calls) is opened wide, so what such a test sees is the machinery, not chance.
    Canaries stay: they test the verifiers, which are deterministic.
    """
    return gate.model_copy(update={
        "test_only_accept": True, "group_tolerance": 1.0, "invalid_tolerance": 1.0,
        "unsafe_tolerance": 1.0, "reward_tolerance": 1.0, "latency_p95_ratio": 100.0,
        "tokens_ratio": 100.0, "abstention_tolerance": 1.0, "truncation_tolerance": 1.0,
        "reply_length_ratio": 1000.0, "calls_per_turn_tolerance": 100.0,
        "dropped_calls_tolerance": 1.0, **update})
