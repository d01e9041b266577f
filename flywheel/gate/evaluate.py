"""Holdout evaluation of one policy version: k attempts per frozen holdout task, fixed seeds.

Both sides of a comparison are sampled by this one function with the same prompts, the same
per-task seeds and the same sampling settings, so their attempts pair up by (task, index).
A run is cached in `eval_runs` under a key of everything that determines it (policy,
version, eval-set version, gate sampling settings, engine, chat format), so production is
sampled once, not once per candidate.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.adapters.registry import newest_eval_set
from flywheel.config import Settings
from flywheel.environments import load_environment
from flywheel.events import ScoredRollout
from flywheel.gate.decision import Attempt, EvalRun
from flywheel.policy.base import AdapterRef, Policy
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import TaskSpec, ToolCallSpec


class NoEvalSet(RuntimeError):
    """There is no frozen eval set to evaluate on."""


@dataclass(frozen=True)
class Holdout:
    eval_set_version: int
    tasks: list[TaskSpec]


async def load_holdout(conn: AsyncConnection, max_tasks: int | None = None,
                       envs: list[str] | None = None) -> Holdout:
    """The tasks of the newest frozen eval set in the policy's environments (`envs`; empty =
    all), a deterministic subset if capped."""
    version = await newest_eval_set(conn)
    if version is None:
        raise NoEvalSet("no eval set is frozen yet: run `flywheel evalset freeze` once the "
                        "miner has produced holdout tasks")
    rows = (await conn.execute(text("""
        SELECT t.spec FROM eval_set_tasks e JOIN tasks t USING (task_id)
        WHERE e.version = :v
          AND (cardinality(CAST(:envs AS text[])) = 0 OR t.env = ANY(CAST(:envs AS text[])))
        ORDER BY t.task_id LIMIT :n"""),
        {"v": version, "n": max_tasks, "envs": envs or []})).scalars()
    return Holdout(int(version), [TaskSpec.model_validate(r) for r in rows])


def task_groups(task: TaskSpec) -> list[str]:
    """The groups a task is judged in: its environment, its failure mode, its expected tools
    (one group per distinct tool a tool_call task expects)."""
    groups = [f"env:{task.env}", f"mode:{task.failure_mode}"]
    if isinstance(task.verifier, ToolCallSpec):
        groups += [f"tool:{name}" for name in sorted({c.name for c in task.verifier.expected})]
    return groups


def _attempt(task: TaskSpec, r: ScoredRollout) -> Attempt:
    reward = r.reward or 0.0
    return Attempt(task=str(task.task_id), index=r.index,
                   success=r.failure_mode is None and reward >= 1.0, reward=reward,
                   invalid=r.failure_mode == "invalid_format",
                   unsafe=r.failure_mode == "unsafe_action"
                   or r.reward_components.get("unsafe", 0.0) > 0,
                   latency_ms=r.latency_ms, tokens=sum(len(t.token_ids) for t in r.turns))


def run_key(settings: Settings, version: int | None, holdout: Holdout, chat_format: str
            ) -> str:
    """The cache key of a run; `chat_format` is the policy's `ChatFormat.version`, so runs
    under another prompt (an older template, or the pre-chat-template prompt) never count."""
    g, r = settings.gate, settings.rollout
    parts = {"policy": settings.policy, "version": version, "eval_set": holdout.eval_set_version,
             "chat_format": chat_format,
             "envs": sorted(r.envs),
             "tasks": [str(t.task_id) for t in holdout.tasks], "k": g.samples_per_task,
             "temperature": g.temperature, "seed": g.seed, "max_tokens": r.max_tokens,
             "max_steps": r.max_steps, "engine": r.engine, "model": str(r.model_dir)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


async def evaluate(policy: Policy, holdout: Holdout, adapter: AdapterRef | None,
                   settings: Settings) -> EvalRun:
    g, r = settings.gate, settings.rollout
    cfg = GroupConfig(group_size=g.samples_per_task, max_tokens=r.max_tokens,
                      temperature=g.temperature, max_steps=r.max_steps,
                      rollout_timeout_s=r.rollout_timeout_s, min_scored=1)
    attempts: list[Attempt] = []
    not_run = 0
    for task in holdout.tasks:
        seed = g.seed ^ zlib.crc32(task.task_id.bytes)
        outcome = await run_group(policy, task, load_environment(task.env), cfg,
                                  adapter=adapter, seed=seed, group_key=f"eval-{task.task_id}")
        for rollout in outcome.rollouts:
            if rollout.reward is None:
                not_run += 1
            else:
                attempts.append(_attempt(task, rollout))
    return EvalRun(version=adapter.version if adapter else None,
                   task_groups={str(t.task_id): task_groups(t) for t in holdout.tasks},
                   attempts=attempts, not_run=not_run)


async def cached_run(conn: AsyncConnection, key: str) -> EvalRun | None:
    data = (await conn.execute(text("SELECT result FROM eval_runs WHERE key = :k"),
                               {"k": key})).scalar()
    return EvalRun.from_json(data) if data is not None else None


async def store_run(conn: AsyncConnection, key: str, policy: str, holdout: Holdout,
                    run: EvalRun) -> None:
    await conn.execute(text("""INSERT INTO eval_runs (key, policy, version, eval_set_version,
        result) VALUES (:k, :p, :v, :e, CAST(:r AS jsonb)) ON CONFLICT (key) DO NOTHING"""),
        {"k": key, "p": policy, "v": run.version, "e": holdout.eval_set_version,
         "r": json.dumps(run.to_json())})
