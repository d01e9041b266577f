"""Holdout evaluation of one policy version, round by round, with fixed seeds.

A round samples every frozen holdout task `round_samples` times; round r of a task uses
the sample indices r·s … r·s + s − 1 and a seed derived from the task and r. Both sides of a
comparison are sampled by this one function with the same prompts, seeds and sampling
settings, so their attempts pair up by (task, index). Each round of a side is cached in
`eval_runs` under a key of everything that determines it (policy, version, eval-set version,
gate sampling settings, engine, chat format) plus the round, so production is sampled once
per index however many candidates it meets, and an evaluation that goes deeper extends its
cache. The tasks of a round are sampled together (`gate.max_inflight` at once) so the engine
batches them; each keeps its seed, so the round's outcomes are those of one task at a time.

Every attempt the model made is an `Attempt` (an empty, truncated or timed-out reply is a
failure with reward 0: `flywheel.gate.accounting`). A task whose attempts the infrastructure
failed to run is sampled again, up to `gate.infra_retries` times with exponential backoff;
what is still missing is counted by kind in `not_run`, and the decision will not look past it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.adapters.lifecycle import version_label
from flywheel.adapters.registry import newest_eval_set
from flywheel.config import Settings
from flywheel.environments import load_environment
from flywheel.environments.base import Environment
from flywheel.errors import TransientError
from flywheel.events import EpisodeCall, EpisodeTurn, ScoredRollout
from flywheel.gate.accounting import REPLY_CHARS, Attempt, EvalRun
from flywheel.policy.base import AdapterRef, Policy
from flywheel.policy.chat_format import ChatFormat
from flywheel.rollout.loop import GroupConfig, GroupOutcome, run_group, turn_tokens
from flywheel.tasks import EpisodeSpec, TaskSpec, ToolCallSpec, ToolsetSpec

log = logging.getLogger("flywheel.gate")
ACCOUNTING = 2
"""Version of what an attempt counts as, in every run key: runs cached when empty and
timed-out replies were left out (1) are never reused."""


class NoEvalSet(TransientError, RuntimeError):
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


async def load_train_tasks(conn: AsyncConnection, version: int, max_tasks: int,
                           envs: list[str] | None = None) -> list[TaskSpec]:
    """A deterministic sample of the training tasks `version` (or a version before it) was
    trained on: tasks of groups the trainer consumed as `trained`."""
    rows = (await conn.execute(text("""
        SELECT t.spec FROM tasks t WHERE t.split = 'train'
          AND (cardinality(CAST(:envs AS text[])) = 0 OR t.env = ANY(CAST(:envs AS text[])))
          AND EXISTS (SELECT 1 FROM rollout_groups g WHERE g.task_id = t.task_id
                      AND g.consumed_as = 'trained' AND g.trained_version <= :v)
        ORDER BY md5(CAST(t.task_id AS text)) LIMIT :n"""),
        {"v": version, "n": max_tasks, "envs": envs or []})).scalars()
    return [TaskSpec.model_validate(r) for r in rows]


def task_groups(task: TaskSpec) -> list[str]:
    """The groups a task is judged in: its environment, its failure mode, its expected tools
    (one group per distinct tool a tool_call task expects), and `kind:episode` for an
    episode task (whole episodes on a toolset, judged apart from single steps)."""
    groups = [f"env:{task.env}", f"mode:{task.failure_mode}"]
    if isinstance(task.verifier, ToolCallSpec):
        groups += [f"tool:{name}" for name in sorted({c.name for c in task.verifier.expected})]
    if isinstance(task.verifier, EpisodeSpec):
        groups.append("kind:episode")
    return groups


def _attempt(task: TaskSpec, r: ScoredRollout, offset: int = 0,
             fmt: ChatFormat | None = None) -> Attempt:
    reward = r.reward or 0.0
    text = "\n".join(t.text for t in r.turns)
    called = _called(fmt, r)
    return Attempt(task=str(task.task_id), index=offset + r.index,
                   success=r.failure_mode is None and reward >= 1.0, reward=reward,
                   invalid=r.failure_mode == "invalid_format",
                   unsafe=r.failure_mode == "unsafe_action"
                   or r.reward_components.get("unsafe", 0.0) > 0,
                   latency_ms=r.latency_ms, tokens=sum(len(t.token_ids) for t in r.turns),
                   failure_mode=r.failure_mode, reply=text[:REPLY_CHARS],
                   reply_chars=len(text),
                   finish_reason=r.turns[-1].finish_reason if r.turns else "",
                   turns=len(r.turns), calls=[n for turn in called for n in turn],
                   calling_turns=sum(1 for turn in called if turn),
                   components=dict(r.reward_components), reason=r.reason,
                   episode=_episode(task, r, fmt))


def _episode(task: TaskSpec, r: ScoredRollout, fmt: ChatFormat | None
             ) -> list[dict[str, Any]] | None:
    """An episode attempt turn by turn, as "what changed" shows it (`EpisodeTurn`): the
    calls as the chat format parses them, each with the tool result the turn kept, the
    answer's text, and the scripted user's message after each answer but the last."""
    spec = task.verifier
    if not isinstance(spec, EpisodeSpec) or fmt is None:
        return None
    users = iter(spec.user_turns)
    out: list[EpisodeTurn] = []
    for k, t in enumerate(r.turns):
        parsed = fmt.parse(t.text)
        steps = t.tools or []
        calls = [EpisodeCall(name=c["function"]["name"],
                             arguments=c["function"]["arguments"][:REPLY_CHARS],
                             result=steps[i].output if i < len(steps) else "",
                             source=steps[i].source if i < len(steps) else "")
                 for i, c in enumerate(parsed["tool_calls"])]
        answered = not calls and k < len(r.turns) - 1
        out.append(EpisodeTurn(calls=calls, text=(parsed.get("content") or "")[:REPLY_CHARS],
                               user=next(users, None) if answered else None))
    return [t.model_dump() for t in out]


def _called(fmt: ChatFormat | None, r: ScoredRollout) -> list[list[str]]:
    """The tools each turn of the attempt called, as the policy's chat format parses them."""
    if fmt is None:
        return []
    return [[c["function"]["name"] for c in fmt.parse(t.text)["tool_calls"]] for t in r.turns]


def run_key(settings: Settings, version: int | None, holdout: Holdout, chat_format: str
            ) -> str:
    """The cache key of a run; `chat_format` is the policy's `ChatFormat.version`, so runs
    under another prompt (an older template, or the pre-chat-template prompt) never count."""
    g, r = settings.gate, settings.rollout
    parts = {"policy": settings.policy, "version": version, "eval_set": holdout.eval_set_version,
             "chat_format": chat_format, "accounting": ACCOUNTING,
             "envs": sorted(r.envs),
             "tasks": [str(t.task_id) for t in holdout.tasks], "round_samples": g.round_samples,
             "temperature": g.temperature, "seed": g.seed, "max_tokens": r.max_tokens,
             "max_steps": r.max_steps, "engine": r.engine, "model": str(r.model_dir)}
    toolset = next((t for t in holdout.tasks
                    if isinstance(t.verifier, EpisodeSpec | ToolsetSpec)), None)
    limit = turn_tokens(toolset, _config(settings)) if toolset else r.max_tokens
    if limit != r.max_tokens:  # only a holdout it changes: cached single-step runs stay
        parts["toolset_turn_tokens"] = limit
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def round_key(key: str, round_: int) -> str:
    """The cache key of one round of the run `key`."""
    return f"{key}/r{round_}"


def round_seed(settings: Settings, task: TaskSpec, round_: int) -> int:
    """The seed of round `round_` of `task`: the same on every side and every evaluation."""
    return (settings.gate.seed ^ zlib.crc32(task.task_id.bytes)) + 1_000_003 * round_


def _config(settings: Settings) -> GroupConfig:
    g, r = settings.gate, settings.rollout
    return GroupConfig(group_size=g.round_samples, max_tokens=r.max_tokens,
                       episode_max_tokens=r.episode_max_tokens,
                       temperature=g.temperature, max_steps=r.max_steps,
                       rollout_timeout_s=r.rollout_timeout_s, min_scored=1)


async def scored_group(policy: Policy, task: TaskSpec, env: Environment, cfg: GroupConfig,
                       settings: Settings, *, adapter: AdapterRef | None, seed: int,
                       group_key: str) -> GroupOutcome:
    """The task's group, sampled again (same seed) while the infrastructure failed to run
    any of its attempts, up to `gate.infra_retries` times with exponential backoff; the last
    outcome (its not-run attempts are counted by the caller)."""
    g = settings.gate
    for attempt in range(g.infra_retries + 1):
        outcome = await run_group(policy, task, env, cfg, adapter=adapter, seed=seed,
                                  group_key=group_key)
        missing = [r.not_run for r in outcome.rollouts if r.reward is None]
        if not missing or attempt == g.infra_retries:
            return outcome
        log.warning("%s: %d attempts not run (%s); retry %d of %d", group_key, len(missing),
                    ", ".join(sorted({str(m) for m in missing})), attempt + 1, g.infra_retries)
        await asyncio.sleep(g.retry_backoff_s * 2 ** attempt)
    raise AssertionError("unreachable")


async def evaluate(policy: Policy, holdout: Holdout, adapter: AdapterRef | None,
                   settings: Settings, round_: int = 0,
                   on_task: Callable[[int], None] | None = None) -> EvalRun:
    """Round `round_` of `adapter` (None = the base model) on every holdout task, up to
    `gate.max_inflight` tasks at once (each with its own seed: the outcome is the same at any
    concurrency); `on_task(samples)` as each task's group is done."""
    s = settings.gate.round_samples
    cfg = _config(settings)
    slots = asyncio.Semaphore(settings.gate.max_inflight)

    async def group(task: TaskSpec) -> GroupOutcome:
        async with slots:
            outcome = await scored_group(policy, task, load_environment(task.env), cfg,
                                         settings, adapter=adapter,
                                         seed=round_seed(settings, task, round_),
                                         group_key=f"eval-{task.task_id}-r{round_}")
        if on_task is not None:
            on_task(len(outcome.rollouts))
        return outcome

    async with asyncio.TaskGroup() as tg:  # a failure cancels the rest of the round
        groups = [tg.create_task(group(task)) for task in holdout.tasks]
    attempts: list[Attempt] = []
    kinds: dict[str, int] = {}
    for task, done in zip(holdout.tasks, groups, strict=True):
        outcome = done.result()
        for rollout in outcome.rollouts:
            if rollout.reward is None:
                kind = rollout.not_run or "crash"
                kinds[kind] = kinds.get(kind, 0) + 1
            else:
                attempts.append(_attempt(task, rollout, round_ * s, policy.chat_format))
    return EvalRun(version=adapter.version if adapter else None,
                   task_groups={str(t.task_id): task_groups(t) for t in holdout.tasks},
                   attempts=attempts, not_run=sum(kinds.values()), not_run_kinds=kinds)


async def probe_latency(policy: Policy, task: TaskSpec, candidate: AdapterRef | None,
                        production: AdapterRef | None, settings: Settings, round_: int
                        ) -> tuple[list[float], list[float]]:
    """Latencies (ms) of one attempt at `task` on each side, back to back with the same
    seed, the side that goes first alternating by round: whatever else loads the machine
    then slows both alike. (candidate attempts, production attempts)."""
    cfg = replace(_config(settings), group_size=1)
    seed = round_seed(settings, task, round_)
    env = load_environment(task.env)
    sides = [(candidate, 0), (production, 1)]
    found: list[list[float]] = [[], []]
    for adapter, side in sides if round_ % 2 == 0 else sides[::-1]:
        outcome = await run_group(policy, task, env, cfg, adapter=adapter, seed=seed,
                                  group_key=f"probe-{task.task_id}-r{round_}-{side}")
        found[side] = [r.latency_ms for r in outcome.rollouts if r.reward is not None]
    return found[0], found[1]


async def cached_run(conn: AsyncConnection, key: str) -> EvalRun | None:
    data = (await conn.execute(text("SELECT result FROM eval_runs WHERE key = :k"),
                               {"k": key})).scalar()
    return EvalRun.from_json(data) if data is not None else None


async def cached_rounds(conn: AsyncConnection, key: str, rounds: int) -> dict[int, EvalRun]:
    """The cached rounds among the first `rounds` of the run `key`, by round."""
    keys = {round_key(key, r): r for r in range(rounds)}
    rows = (await conn.execute(text("SELECT key, result FROM eval_runs WHERE key = ANY(:k)"),
                               {"k": list(keys)})).all()
    return {keys[k]: EvalRun.from_json(data) for k, data in rows}


async def production_samples(conn: AsyncConnection, policy: str, version: int | None,
                             eval_set_version: int | None = None
                             ) -> tuple[dict[str, list[bool]], str] | None:
    """Success of every cached attempt of `version` per task — on `eval_set_version`, or
    (None) on the newest eval set it has any on — and where they came from, in words; the
    run with the most cached rounds if several configurations were evaluated."""
    rows = (await conn.execute(text("""SELECT key, eval_set_version, result FROM eval_runs
        WHERE policy = :p AND version IS NOT DISTINCT FROM CAST(:v AS int)
          AND (CAST(:e AS int) IS NULL OR eval_set_version = :e)
        ORDER BY eval_set_version DESC"""),
        {"p": policy, "v": version, "e": eval_set_version})).all()
    if not rows:
        return None
    newest = rows[0].eval_set_version
    runs: dict[str, list[EvalRun]] = {}
    for row in rows:
        if row.eval_set_version == newest:
            runs.setdefault(row.key.rsplit("/r", 1)[0], []).append(
                EvalRun.from_json(row.result))
    chosen = max(runs.values(), key=len)
    by_task: dict[str, list[bool]] = {}
    for run in chosen:
        for a in run.attempts:
            by_task.setdefault(a.task, []).append(a.success)
    samples = sum(len(v) for v in by_task.values())
    return by_task, (f"{version_label(version)}'s own between-sample disagreement on its "
                     f"{samples} cached samples of eval set v{newest}")


async def store_run(conn: AsyncConnection, key: str, policy: str, holdout: Holdout,
                    run: EvalRun) -> None:
    await conn.execute(text("""INSERT INTO eval_runs (key, policy, version, eval_set_version,
        result) VALUES (:k, :p, :v, :e, CAST(:r AS jsonb)) ON CONFLICT (key) DO NOTHING"""),
        {"k": key, "p": policy, "v": run.version, "e": holdout.eval_set_version,
         "r": json.dumps(run.to_json())})
