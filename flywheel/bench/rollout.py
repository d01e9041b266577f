"""`flywheel bench rollout`: groups through the rollout worker vs the engine called directly.

Both sides sample the same tool_call prompts with the same group size, token limit and
seeds, in the same run. The worker side goes through everything a production group does:
the request on Kafka, the worker's consumer, task loading, admission, verification, the
group record and its event in Postgres. Reports completions/s and tokens/s for both and
`overhead_ratio` = direct throughput / worker throughput (target ≤ 1.10).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import asyncpg

from flywheel.bench.stack import temp_stack
from flywheel.config import RolloutSettings, Settings, Topics, settings_env
from flywheel.db.engine import make_engine
from flywheel.demo.simulate import simulate
from flywheel.environments.prompt import task_messages, task_tools
from flywheel.mining.service import mine_batch
from flywheel.policy.base import SamplingParams
from flywheel.rollout.store import request_rollouts
from flywheel.schemas import parse_trajectory
from flywheel.tasks import TaskSpec


async def _tasks(db_url: str, n: int) -> list[TaskSpec]:
    engine = make_engine(db_url)
    async with engine.begin() as conn:
        records = simulate(40 * n, agents=1, failure_rate=0.8, seed=7)
        await mine_batch(conn, [parse_trajectory(r) for r in records], holdout_fraction=0.0,
                         topics=Topics.for_prefix("bench"))
        from sqlalchemy import text

        rows = (await conn.execute(text(
            "SELECT spec FROM tasks WHERE env = 'tool_call' ORDER BY task_id LIMIT :n"),
            {"n": n})).scalars()
        tasks = [TaskSpec.model_validate(r) for r in rows]
    await engine.dispose()
    return tasks


async def _worker_side(settings: Settings, tasks: list[TaskSpec], log: Path) -> dict[str, Any]:
    assert settings.db.url
    dsn = settings.db.url.replace("+asyncpg", "")
    env = {**os.environ, **settings_env(settings)}
    procs = [subprocess.Popen([sys.executable, "-m", m], env=env, stdout=open(log, "ab"),
                              stderr=subprocess.STDOUT)
             for m in ("consumers.rollout", "producers.relay")]
    engine = make_engine(settings.db.url)
    conn = await asyncpg.connect(dsn)
    try:
        async def done() -> int:
            return int(await conn.fetchval("SELECT count(*) FROM rollout_groups"))

        async def submit(batch: list[TaskSpec]) -> None:
            async with engine.begin() as c:
                await request_rollouts(c, [t.task_id for t in batch], None, settings.topics)

        await submit(tasks[:1])  # warm-up: model loaded, group joined
        while await done() < 1:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a bench service died; see {log}")
            await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        await submit(tasks[1:])
        while await done() < len(tasks):
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a bench service died; see {log}")
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - t0
        rows = await conn.fetch("""
            SELECT g.task_id, g.group_id,
                   (SELECT coalesce(sum(jsonb_array_length(t -> 'token_ids')), 0)
                    FROM jsonb_array_elements(g.rollouts) r,
                         jsonb_array_elements(r -> 'turns') t) AS tokens
            FROM rollout_groups g""")
        seeds = {r["task_id"]: zlib.crc32(r["group_id"].bytes) for r in rows}
        tokens = sum(int(r["tokens"]) for r in rows if r["task_id"] != tasks[0].task_id)
        completions = (len(tasks) - 1) * settings.rollout.group_size
        return {"seconds": elapsed, "completions": completions, "tokens": tokens,
                "seeds": seeds}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        await conn.close()
        await engine.dispose()


async def _direct_side(settings: Settings, tasks: list[TaskSpec],
                       seeds: list[int]) -> dict[str, Any]:
    from flywheel.policy.factory import make_policy

    policy = make_policy(settings)
    cfg = settings.rollout
    try:
        async def one(task: TaskSpec, seed: int) -> int:
            params = SamplingParams(n=cfg.group_size, max_tokens=cfg.max_tokens,
                                    temperature=cfg.temperature, seed=seed)
            out = await policy.sample(task_messages(task), params, tools=task_tools(task))
            return sum(len(c.token_ids) for c in out)

        await one(tasks[0], seeds[0])  # warm-up, as on the worker side
        t0 = time.perf_counter()
        tokens = 0
        for task, seed in zip(tasks[1:], seeds[1:], strict=True):
            tokens += await one(task, seed)
        return {"seconds": time.perf_counter() - t0,
                "completions": (len(tasks) - 1) * cfg.group_size, "tokens": tokens}
    finally:
        await policy.close()


def run_bench(groups: int, *, group_size: int = 8, max_tokens: int = 32) -> dict[str, Any]:
    rollout = RolloutSettings(group_size=group_size, max_tokens=max_tokens,
                              max_staleness=10_000, rollout_timeout_s=600)
    with temp_stack(rollout=rollout) as settings:
        assert settings.db.url
        tasks = asyncio.run(_tasks(settings.db.url, groups + 1))
        worker = asyncio.run(_worker_side(settings, tasks, settings.home / "services.log"))
        # Same prompts, same seeds as the worker used: both sides sample the same tokens.
        seeds = [worker["seeds"][t.task_id] for t in tasks]
        direct = asyncio.run(_direct_side(settings, tasks, seeds))
    w_cps = worker["completions"] / worker["seconds"]
    d_cps = direct["completions"] / direct["seconds"]
    return {
        "groups": groups, "group_size": group_size, "max_tokens": max_tokens,
        "worker_completions_per_s": round(w_cps, 2),
        "worker_tokens_per_s": round(worker["tokens"] / worker["seconds"], 1),
        "direct_completions_per_s": round(d_cps, 2),
        "direct_tokens_per_s": round(direct["tokens"] / direct["seconds"], 1),
        "overhead_ratio": round(d_cps / w_cps, 3),
        "same_tokens": worker["tokens"] == direct["tokens"],
    }


