"""`flywheel bench gate` and `flywheel bench rollout --in-flight N`: the engine kept busy.

Gate: rounds of the gate (`flywheel.gate.evaluate`, the gate's own sampling settings and
per-task seeds) on the same holdout, today's path (one task after another,
`gate.max_inflight` 1) against every task in flight at once (`--inflight`), in one run, on
two holdouts: the demo's tool_call requests with the demo's three tools, and the same
requests offered every tool the simulator knows (support, workplace, the unsafe one: ~13
schemas, prompts several times longer). Reports samples/s of each side, the ratio, and how
many attempts came out the same (each task keeps its seed, so all of them bar float rounding
at a tie). Rollout: groups of G through the rollout loop (`run_group`), one at a time against
N at once, groups/s and the ratio. Each side starts with the prefix cache cleared, so
neither reuses prompts the other computed. The load average of the machine is reported with
every figure: other work on the same cores slows both sides, not their order.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from flywheel.bench.learning import fixed_tasks
from flywheel.config import Settings
from flywheel.gate.decision import EvalRun
from flywheel.gate.evaluate import Holdout, evaluate
from flywheel.policy.base import Policy
from flywheel.tasks import TaskSpec


def schema_heavy(tasks: list[TaskSpec]) -> list[TaskSpec]:
    """The same requests offered every simulator tool (their expected calls unchanged)."""
    from flywheel.demo.simulate import SUPPORT
    from flywheel.environments.workplace import WORKPLACE_TOOLS

    tools = [*SUPPORT, *WORKPLACE_TOOLS]
    return [t.model_copy(update={"tools": tools}) for t in tasks]


async def _clear_cache(policy: Policy) -> None:
    cache = getattr(policy, "prefix_cache", None)
    if cache is not None:  # the local engine: its worker thread owns the cache
        await policy._run(cache.clear)  # type: ignore[attr-defined]


def _load() -> float:
    return round(os.getloadavg()[0], 2)


async def _gate_side(policy: Policy, holdout: Holdout, settings: Settings, inflight: int,
                     rounds: int) -> tuple[dict[str, Any], list[EvalRun]]:
    s = settings.model_copy(update={"gate": settings.gate.model_copy(
        update={"max_inflight": inflight})})
    await _clear_cache(policy)
    load, started = _load(), time.perf_counter()
    runs = [await evaluate(policy, holdout, None, s, r) for r in range(rounds)]
    seconds = time.perf_counter() - started
    samples = sum(len(r.attempts) + r.not_run for r in runs)
    return {"inflight": inflight, "seconds": round(seconds, 2), "samples": samples,
            "not_run": sum(r.not_run for r in runs),
            "samples_per_s": round(samples / seconds, 3), "load_before": load,
            "load_after": _load()}, runs


def _same(a: list[EvalRun], b: list[EvalRun]) -> int:
    def key(runs: list[EvalRun]) -> dict[tuple[str, int], tuple[bool, float, int]]:
        return {(x.task, x.index): (x.success, x.reward, x.tokens) for r in runs
                for x in r.attempts}
    ka, kb = key(a), key(b)
    return sum(1 for k, v in ka.items() if kb.get(k) == v)


async def _gate(settings: Settings, tasks: int, inflight: int, rounds: int) -> dict[str, Any]:
    from flywheel.environments.prompt import task_messages, task_tools
    from flywheel.policy.factory import make_policy

    policy = make_policy(settings)
    out: dict[str, Any] = {"engine": settings.rollout.engine, "tasks": tasks,
                           "rounds": rounds, "round_samples": settings.gate.round_samples,
                           "temperature": settings.gate.temperature,
                           "max_tokens": settings.rollout.max_tokens,
                           "cpus": os.cpu_count(), "sets": {}}
    try:
        demo = fixed_tasks(tasks, seed=11)
        for name, chosen in (("demo", demo), ("schemas", schema_heavy(demo))):
            holdout = Holdout(0, chosen)
            prompt = policy.chat_format.render(task_messages(chosen[0]), task_tools(chosen[0]))
            seq, seq_runs = await _gate_side(policy, holdout, settings, 1, rounds)
            new, new_runs = await _gate_side(policy, holdout, settings, inflight, rounds)
            out["sets"][name] = {
                "prompt_tokens": len(prompt), "sequential": seq, "in_flight": new,
                "speedup": round(new["samples_per_s"] / seq["samples_per_s"], 2),
                "same_attempts": f"{_same(seq_runs, new_runs)}/{seq['samples']}"}
    finally:
        await policy.close()
    return out


def run_gate_bench(*, tasks: int = 24, inflight: int = 64, rounds: int = 1,
                   settings: Settings | None = None) -> dict[str, Any]:
    return asyncio.run(_gate(settings or Settings(), tasks, inflight, rounds))


async def _groups(policy: Policy, tasks: list[TaskSpec], settings: Settings,
                  inflight: int) -> dict[str, Any]:
    from flywheel.environments import load_environment
    from flywheel.rollout.loop import run_group
    from flywheel.rollout.worker import group_config

    cfg, env = group_config(settings), load_environment("tool_call")
    slots = asyncio.Semaphore(inflight)

    async def one(i: int, task: TaskSpec) -> int:
        async with slots:
            group = await run_group(policy, task, env, cfg, adapter=None, seed=1000 + i,
                                    group_key=f"bench{i}")
        return sum(r.not_run is not None for r in group.rollouts)

    await _clear_cache(policy)
    load, started = _load(), time.perf_counter()
    failed = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    seconds = time.perf_counter() - started
    return {"inflight": inflight, "groups": len(tasks), "seconds": round(seconds, 2),
            "not_run": sum(failed), "groups_per_s": round(len(tasks) / seconds, 3),
            "load_before": load, "load_after": _load()}


async def _rollout(settings: Settings, groups: int, inflight: int) -> dict[str, Any]:
    from flywheel.policy.factory import make_policy

    policy = make_policy(settings)
    try:
        tasks = fixed_tasks(groups, seed=5)
        one = await _groups(policy, tasks, settings, 1)
        many = await _groups(policy, tasks, settings, inflight)
    finally:
        await policy.close()
    return {"engine": settings.rollout.engine, "group_size": settings.rollout.group_size,
            "max_tokens": settings.rollout.max_tokens, "cpus": os.cpu_count(),
            "one_at_a_time": one, "in_flight": many,
            "speedup": round(many["groups_per_s"] / one["groups_per_s"], 2)}


def run_inflight_rollout_bench(*, groups: int = 8, inflight: int = 4, group_size: int = 8,
                               max_tokens: int = 32, settings: Settings | None = None
                               ) -> dict[str, Any]:
    s = settings or Settings()
    s = s.model_copy(update={"rollout": s.rollout.model_copy(update={
        "group_size": group_size, "max_tokens": max_tokens})})
    return asyncio.run(_rollout(s, groups, inflight))
