"""`flywheel bench rollout`: groups through the rollout worker vs the engine called directly,
and the engine with prompts shared vs every row running its prompt in full.

Every side samples the same tool_call prompts (simulator tasks, mined) with the same group
size, token limit and seeds, in the same run. The worker side goes through everything a
production group does: the request on Kafka, the worker's consumer, task loading, admission,
verification, the group record and its event in Postgres; `overhead_ratio` = direct
throughput / worker throughput (target ≤ 1.10). The direct side is the configured engine
(each prompt once, prefix cache on); beside it, group by group in rotating order, the same
engine with no prefix cache and the `generate` path (`unshared`: G prompt passes a group).
`prefix_speedup` = direct tokens/s / unshared tokens/s; the sides must sample the same
tokens (`prefix_same_tokens`), their log-probs `prefix_max_logprob_diff` apart.
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
from flywheel.mining.mine_batch import mine_batch
from flywheel.policy.base import Completion, Policy, SamplingParams
from flywheel.rollout.store import request_rollouts
from flywheel.tasks import TaskSpec
from flywheel.trajectory import parse_trajectory


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
                       seeds: list[int]) -> dict[str, dict[str, Any]]:
    from flywheel.policy.factory import make_policy
    from flywheel.policy.local import LocalPolicy
    from flywheel.policy.model_cache import resolve_model_dir

    cfg = settings.rollout
    model_dir = resolve_model_dir(cfg.model_dir)
    engines: dict[str, Policy] = {
        "direct": make_policy(settings),
        "no_cache": LocalPolicy(model_dir, prefix_cache_mb=0, chat_template=cfg.chat_template),
        "unshared": LocalPolicy(model_dir, share_prompts=False, prefix_cache_mb=0,
                                chat_template=cfg.chat_template)}
    sides: dict[str, dict[str, Any]] = {
        name: {"seconds": 0.0, "tokens": 0, "completions": [], "prompt_tokens": 0}
        for name in engines}
    try:
        for i, (task, seed) in enumerate(zip(tasks, seeds, strict=True)):
            # The rollout loop's request: the task's messages and tools, no prefill or stop.
            params = SamplingParams(n=cfg.group_size, max_tokens=cfg.max_tokens,
                                    temperature=cfg.temperature, seed=seed)
            messages, tools = task_messages(task), task_tools(task)
            names = list(engines)
            # Rotate who goes first: on a shared machine no side always gets the quiet slot.
            for name in names[i % len(names):] + names[:i % len(names)]:
                t0 = time.perf_counter()
                got = await engines[name].sample(messages, params, tools=tools)
                elapsed = time.perf_counter() - t0
                if i == 0:
                    continue  # warm-up, as on the worker side
                side = sides[name]
                side["seconds"] += elapsed
                side["tokens"] += sum(len(c.token_ids) for c in got)
                side["prompt_tokens"] += len(got[0].prompt_token_ids)
                side["completions"] += got
    finally:
        for engine in engines.values():
            await engine.close()
    return sides


def _max_diff(a: list[Completion], b: list[Completion]) -> float:
    return max((abs(x - y) for ca, cb in zip(a, b, strict=True)
                for x, y in zip(ca.logprobs, cb.logprobs, strict=False)), default=0.0)


def run_bench(groups: int, *, group_size: int = 8, max_tokens: int = 32,
              worker: bool = True) -> dict[str, Any]:
    rollout = RolloutSettings(group_size=group_size, max_tokens=max_tokens,
                              max_staleness=10_000, rollout_timeout_s=600)
    with temp_stack(rollout=rollout) as settings:
        assert settings.db.url
        tasks = asyncio.run(_tasks(settings.db.url, groups + 1))
        out: dict[str, Any] = {"groups": groups, "group_size": group_size,
                               "max_tokens": max_tokens}
        if worker:
            w = asyncio.run(_worker_side(settings, tasks, settings.home / "services.log"))
            # Same prompts, same seeds as the worker used: every side samples the same tokens.
            seeds = [w["seeds"][t.task_id] for t in tasks]
        else:
            seeds = [zlib.crc32(t.task_id.bytes) for t in tasks]
        sides = asyncio.run(_direct_side(settings, tasks, seeds))
    completions = groups * group_size
    direct, no_cache, unshared = sides["direct"], sides["no_cache"], sides["unshared"]
    d_cps = completions / direct["seconds"]
    if worker:
        w_cps = w["completions"] / w["seconds"]
        out |= {"worker_completions_per_s": round(w_cps, 2),
                "worker_tokens_per_s": round(w["tokens"] / w["seconds"], 1),
                "overhead_ratio": round(d_cps / w_cps, 3),
                "same_tokens": w["tokens"] == direct["tokens"]}
    tokens = [[c.token_ids for c in s["completions"]] for s in (direct, no_cache, unshared)]
    return out | {
        "direct_completions_per_s": round(d_cps, 2),
        "direct_tokens_per_s": round(direct["tokens"] / direct["seconds"], 1),
        "no_cache_tokens_per_s": round(no_cache["tokens"] / no_cache["seconds"], 1),
        "unshared_tokens_per_s": round(unshared["tokens"] / unshared["seconds"], 1),
        "prefix_speedup": round(unshared["seconds"] / direct["seconds"], 2),
        "prefix_speedup_no_cache": round(unshared["seconds"] / no_cache["seconds"], 2),
        "prompt_tokens_mean": round(direct["prompt_tokens"] / groups, 1),
        "prefix_same_tokens": tokens[0] == tokens[1] == tokens[2],
        "prefix_max_logprob_diff": float(
            f"{_max_diff(direct['completions'], unshared['completions']):.3g}"),
    }
