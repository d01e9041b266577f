"""`flywheel bench episodes`: what a whole episode costs against the single step it replaced.

The same failures mined two ways: the simulated helpdesk agent's failed conversations
(`flywheel simulate --agents 4`, `flywheel.demo.simulate_episodes`) become episode tasks on
the `workplace` toolset (a Python toolset in-process), and — with no toolset registered, as
before episodes — single-step `tool_call` tasks at the failing decision. Only failures that
give both are used, in pairs. The same in-process engine (the base model), the rollout's group
config (`rollout.group_size`, `max_tokens`, `temperature`, `max_steps`) and seeds for both
kinds; the pairs alternate which kind runs first. Per kind: seconds per group, model turns and
generated tokens per attempt, the share of attempts that succeeded, tokens/s; and one gate
round (`gate.round_samples` attempts per task at the gate's temperature, as the gate samples
a round) over the same tasks. `episode_cost_ratio` = seconds per episode group / seconds per
single-step group; `round_cost_ratio` the same for the gate round.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import zlib
from pathlib import Path
from typing import Any

from flywheel.config import Settings
from flywheel.demo import simulate_episodes as desk
from flywheel.demo.simulate import simulate
from flywheel.environments import load_environment
from flywheel.environments.base import Environment
from flywheel.environments.toolset import ToolsetEnvironment
from flywheel.mining.build import Unverifiable
from flywheel.mining.classify import classify_failure
from flywheel.mining.expected import expected_calls, same_episode
from flywheel.mining.mine_batch import MineStats, _build
from flywheel.policy.base import AdapterRef, Policy
from flywheel.rollout.loop import GroupConfig, GroupOutcome, run_group
from flywheel.tasks import EpisodeSpec, TaskSpec
from flywheel.tools.descriptors import Registration
from flywheel.tools.registry import read_toolset
from flywheel.tools.runtime import Catalog
from flywheel.toolsets import PythonClass
from flywheel.trajectory import Trajectory, parse_trajectory

TARGET = "flywheel.environments.workplace_tools:WorkplaceTools"


def mine_failure(t: Trajectory, logs: list[Trajectory], registrations: list[Registration],
                 stats: MineStats) -> TaskSpec | Unverifiable:
    """Failure `t` mined as `mining.mine_batch` mines it, with its session's logs in memory
    instead of Postgres: a successful retry in the session, the expected calls, the
    classification, then the episode task (else the single-step one)."""
    retry = next((s for s in logs if s.session_id == t.session_id and s.is_success
                  and not same_episode(t, s)), None)
    found = expected_calls(t, retry)
    c = classify_failure(t, found[0] if found else None)
    return _build(t, c, retry, registrations, stats, 0.0, True)


def paired_tasks(reg: Registration, n: int, seed: int) -> list[tuple[TaskSpec, TaskSpec]]:
    """(episode task, single-step task) of the first `n` simulated helpdesk failures that
    give both."""
    logs = [parse_trajectory(r) for r in simulate(40 * n + 400, agents=4, failure_rate=0.5,
                                                 seed=seed) if r["agent"] == desk.AGENT]
    pairs = []
    for t in (t for t in logs if not t.is_success):
        episode = mine_failure(t, logs, [reg], MineStats())
        single = mine_failure(t, logs, [], MineStats())
        if (isinstance(episode, TaskSpec) and isinstance(episode.verifier, EpisodeSpec)
                and isinstance(single, TaskSpec) and single.env == "tool_call"):
            pairs.append((episode, single))
            if len(pairs) == n:
                break
    return pairs


def run_episodes_bench(*, tasks: int = 4, seed: int = 5,
                       adapter: Path | None = None) -> dict[str, Any]:
    """`adapter`: a saved LoRA adapter directory (e.g. an SFT checkpoint of `bench
    episode-learning`) sampled instead of the base model, so the cost is that of a policy
    that works several turns; both kinds of task use it."""
    return asyncio.run(_run(tasks, seed, adapter))


def _side(outcomes: list[tuple[float, GroupOutcome]]) -> dict[str, Any]:
    attempts = [r for _, o in outcomes for r in o.rollouts]
    seconds = [s for s, _ in outcomes]
    tokens = sum(len(turn.token_ids) for r in attempts for turn in r.turns)
    scored = [r for r in attempts if r.reward is not None]
    return {"groups": len(outcomes), "seconds_per_group": round(statistics.mean(seconds), 2),
            "seconds_per_group_median": round(statistics.median(seconds), 2),
            "turns_per_attempt": round(sum(len(r.turns) for r in attempts) / len(attempts), 2),
            "tokens_per_attempt": round(tokens / len(attempts), 1),
            "tokens_per_s": round(tokens / sum(seconds), 1),
            "success_rate": round(sum(1 for r in scored if r.reward == 1.0) / len(scored), 3)
            if scored else None,
            "not_run": len(attempts) - len(scored)}


async def _timed(policy: Policy, task: TaskSpec, env: Environment, cfg: GroupConfig,
                 key: str, adapter: AdapterRef | None) -> tuple[float, GroupOutcome]:
    started = time.perf_counter()
    outcome = await run_group(policy, task, env, cfg, adapter=adapter,
                              seed=zlib.crc32(key.encode()), group_key=key)
    return time.perf_counter() - started, outcome


async def _run(n: int, seed: int, adapter_dir: Path | None) -> dict[str, Any]:
    from flywheel.policy.local import LocalPolicy
    from flywheel.policy.model_cache import resolve_model_dir

    s = Settings()
    r, g = s.rollout, s.gate
    reg = (await read_toolset(desk.TOOLSET, PythonClass(target=TARGET))).model_copy(
        update={"version": 1})
    pairs = paired_tasks(reg, n, seed)
    if len(pairs) < n:
        raise RuntimeError(f"only {len(pairs)} simulated failures gave both kinds of task")
    catalog = Catalog.of([reg])
    envs: dict[str, Environment] = {"episode": ToolsetEnvironment(catalog),
                                    "single": load_environment("tool_call")}
    policy = LocalPolicy(resolve_model_dir(None), max_batch=max(8, r.group_size))
    adapter = None if adapter_dir is None else AdapterRef("policy", 1, adapter_dir)
    if adapter is not None:
        await policy.ensure_adapter(adapter)
    load = os.getloadavg()[0]
    out: dict[str, Any] = {"tasks": n, "seed": seed, "group_size": r.group_size,
                           "adapter": None if adapter_dir is None else str(adapter_dir),
                           "max_tokens": r.max_tokens,
                           "episode_max_tokens": r.episode_max_tokens, "max_steps": r.max_steps,
                           "round_samples": g.round_samples}
    try:
        for stage, cfg in (
                ("group", GroupConfig(group_size=r.group_size, max_tokens=r.max_tokens,
                                      episode_max_tokens=r.episode_max_tokens,
                                      temperature=r.temperature, max_steps=r.max_steps,
                                      rollout_timeout_s=r.rollout_timeout_s)),
                ("gate_round", GroupConfig(group_size=g.round_samples, max_tokens=r.max_tokens,
                                           episode_max_tokens=r.episode_max_tokens,
                                           temperature=g.temperature, max_steps=r.max_steps,
                                           rollout_timeout_s=r.rollout_timeout_s,
                                           min_scored=1))):
            done: dict[str, list[tuple[float, GroupOutcome]]] = {"episode": [], "single": []}
            for k, (episode, single) in enumerate(pairs):
                order = [("episode", episode), ("single", single)]
                for kind, task in order if k % 2 == 0 else order[::-1]:
                    done[kind].append(await _timed(policy, task, envs[kind], cfg,
                                                   f"{stage}-{kind}-{k}", adapter))
            sides = {kind: _side(v) for kind, v in done.items()}
            if stage == "group":
                out["episode"], out["single_step"] = sides["episode"], sides["single"]
                out["episode_cost_ratio"] = round(sides["episode"]["seconds_per_group"]
                                                  / sides["single"]["seconds_per_group"], 2)
            else:
                rounds = {kind: round(sum(t for t, _ in v), 2) for kind, v in done.items()}
                out["gate_round_s"] = {"episode": rounds["episode"],
                                       "single_step": rounds["single"]}
                out["round_cost_ratio"] = round(rounds["episode"] / rounds["single"], 2)
    finally:
        await policy.close()
        await catalog.aclose()
    out["load_average"] = {"before": round(load, 2), "after": round(os.getloadavg()[0], 2)}
    return out
