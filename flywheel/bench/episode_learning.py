"""`flywheel bench episode-learning`: does the warm start teach whole episodes on held-out ones?

The simulated helpdesk agent's traffic (`flywheel simulate --agents 4`) mined as the miner
mines it, with the `workplace` toolset registered: failed conversations become episode tasks,
split train/holdout by fingerprint at the miner's fraction (`split_of`). Demonstrations, turn
by turn, come from the train episodes' whole-path corrections and from the agent's logged
successes — never from a session that holds a holdout episode. The holdout episodes are
rolled out on the toolset (the rollout loop, the scripted user, the episode verifier) with
fixed seeds: by the base model (`base=True`) and after each SFT checkpoint, attempts paired
by (task, sample, seed); the gain with a bootstrap interval over tasks and the exact McNemar
p-value (`bench.learning.paired_gain`). The same engine and trainer classes as the services,
in one process (so engine and trainer memory add up here: `peak_rss_mb`).

With `grpo_steps`, GRPO continues from the last SFT checkpoint as the trainer runs it on
episodes: each step samples `grpo_batch` groups of `rollout.group_size` attempts on train
episodes (in turn) from the current adapter, one reward per episode, every assistant turn
trained with the episode's group-relative advantage; then the holdout again, paired with
the SFT checkpoint's and the base model's attempts. Costs on 2 cores: an SFT step of 8
episode demonstrations (prompts of ~1,400-1,700 tokens: the toolset's 9 tools and the
conversation so far) takes 30-60 s; every figure is in the result (`seconds`).
"""

from __future__ import annotations

import asyncio
import os
import resource
import statistics
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from flywheel.bench.episodes import TARGET, mine_failure
from flywheel.bench.learning import Outcomes, paired_gain
from flywheel.config import Settings
from flywheel.demo import simulate_episodes as desk
from flywheel.demo.simulate import simulate
from flywheel.environments.toolset import ToolsetEnvironment
from flywheel.events import GroupScoredPayload
from flywheel.mining.build import split_of
from flywheel.mining.demos import (
    Candidate,
    Demonstration,
    HeldOut,
    from_turn,
    holdout_episode_prompt,
)
from flywheel.mining.episode_demos import (
    corrected_episode_demonstrations,
    success_episode_demonstrations,
)
from flywheel.mining.mine_batch import MineStats
from flywheel.policy.base import AdapterRef, Policy
from flywheel.policy.cores import ComputeThread
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import EpisodeSpec, TaskSpec
from flywheel.tools.descriptors import Registration
from flywheel.tools.registry import read_toolset
from flywheel.tools.runtime import Catalog
from flywheel.toolsets import PythonClass
from flywheel.trajectory import Trajectory, parse_trajectory


def split_episodes(reg: Registration, records: int, seed: int, holdout_fraction: float
                   ) -> tuple[list[TaskSpec], list[TaskSpec], list[Demonstration], dict[str, Any]]:
    """(train episodes, holdout episodes, demonstrations, counts) of the simulated traffic."""
    logs = [parse_trajectory(r) for r in simulate(records, agents=4, failure_rate=0.4,
                                                 seed=seed) if r["agent"] == desk.AGENT]
    train: list[tuple[TaskSpec, Trajectory]] = []
    holdout: list[tuple[TaskSpec, Trajectory]] = []
    stats = MineStats()
    for t in (t for t in logs if not t.is_success):
        task = mine_failure(t, logs, [reg], stats)
        if isinstance(task, TaskSpec) and isinstance(task.verifier, EpisodeSpec):
            side = holdout if split_of(task.fingerprint, holdout_fraction) == "holdout" else train
            side.append((task, t))
    held_sessions = {t.session_id for _, t in holdout}
    corrections = [from_turn(x) for task, t in train if t.session_id not in held_sessions
                   for x in corrected_episode_demonstrations(task, t)]
    successes = [from_turn(x) for t in logs if t.is_success and t.session_id not in held_sessions
                 for x in success_episode_demonstrations(t, [reg]) or []]
    # The trainer's holdout guard: no demonstration continuing a holdout episode's prompt.
    held = HeldOut(episode_prompts=frozenset(p for x, _ in holdout
                                             if (p := holdout_episode_prompt(x)) is not None))
    demos = [d for d in [*corrections, *successes]
             if held.admits(Candidate(d, (d.source_trajectory_id,), ()))]
    refused = len(corrections) + len(successes) - len(demos)
    corrected = len({id(d) for d in corrections} & {id(d) for d in demos})
    counts = {"logs": len(logs), "failed": sum(1 for t in logs if not t.is_success),
              "episodes_train": len(train), "episodes_holdout": len(holdout),
              "holdout_modes": dict(Counter(x.failure_mode for x, _ in holdout)),
              "unverifiable": dict(stats.episode_unverifiable),
              "demonstrations": {"from_corrections": corrected,
                                 "from_successes": len(demos) - corrected,
                                 "refused_continuing_a_holdout_prompt": refused}}
    return [x for x, _ in train], [x for x, _ in holdout], demos, counts


async def _evaluate(policy: Policy, tasks: list[TaskSpec], env: ToolsetEnvironment,
                    cfg: GroupConfig, adapter: AdapterRef | None, in_flight: int
                    ) -> tuple[Outcomes, dict[str, Any]]:
    started = time.perf_counter()
    out: Outcomes = {}
    turns: list[int] = []
    modes: Counter[str] = Counter()
    for lo in range(0, len(tasks), in_flight):
        groups = await asyncio.gather(*[
            run_group(policy, task, env, cfg, adapter=adapter, seed=1000 + i,
                      group_key=f"holdout{i}")
            for i, task in list(enumerate(tasks))[lo:lo + in_flight]])
        for i, g in enumerate(groups, start=lo):
            for r in g.rollouts:
                out[(i, r.index)] = (r.reward == 1.0, r.reward or 0.0)
                turns.append(len(r.turns))
                modes[r.failure_mode or "success"] += 1
    wins = sum(1 for s, _ in out.values() if s)
    return out, {"success_rate": round(wins / max(len(out), 1), 4), "attempts": len(out),
                 "turns_per_attempt": round(statistics.fmean(turns), 2) if turns else 0.0,
                 "outcomes": dict(modes), "seconds": round(time.perf_counter() - started, 1)}


async def _run(*, records: int, seed: int, holdout_tasks: int, samples: int,
               sft_steps: list[int], base: bool, in_flight: int, micro_batch: int,
               rows: int, grpo_steps: int, grpo_batch: int) -> dict[str, Any]:
    from flywheel.policy.local import LocalPolicy
    from flywheel.policy.model_cache import resolve_model_dir
    from flywheel.trainer.engine import LoRASpec, LoRATrainer
    from flywheel.trainer.grpo import GRPOConfig
    from flywheel.trainer.sft import sft_batches, sft_stratum

    s = Settings()
    reg = (await read_toolset(desk.TOOLSET, PythonClass(target=TARGET))).model_copy(
        update={"version": 1})
    train, holdout, demos, counts = split_episodes(reg, records, seed,
                                                    s.miner.holdout_fraction)
    held = holdout[:holdout_tasks]
    catalog = Catalog.of([reg])
    env = ToolsetEnvironment(catalog)
    model_dir = resolve_model_dir(None)
    policy = LocalPolicy(model_dir, max_batch=rows)
    compute = ComputeThread("flywheel-bench-trainer")  # one malloc arena for the steps
    trainer = LoRATrainer(model_dir, lora=LoRASpec(), grpo=GRPOConfig(), lr=s.trainer.lr,
                          micro_batch=micro_batch)
    cfg = GroupConfig(group_size=samples, max_tokens=s.rollout.max_tokens,
                      episode_max_tokens=s.rollout.episode_max_tokens, temperature=1.0,
                      max_steps=s.rollout.max_steps,
                      rollout_timeout_s=s.rollout.rollout_timeout_s)
    out: dict[str, Any] = {**counts, "holdout_tasks_run": len(held), "samples": samples,
                           "max_tokens": cfg.max_tokens,
                           "episode_max_tokens": cfg.episode_max_tokens,
                           "max_steps": cfg.max_steps,
                           "sft_batch": s.trainer.sft_batch, "sft_lr": s.trainer.sft_lr,
                           "micro_batch": micro_batch,
                           "seed": seed, "checkpoints": []}
    out["grpo"] = None
    work = Path(tempfile.mkdtemp(prefix="flywheel-episode-learning-"))
    started = time.perf_counter()
    try:
        before: Outcomes | None = None
        sft_outcomes: Outcomes = {}
        if base:
            before, out["base"] = await _evaluate(policy, held, env, cfg, None, in_flight)
        adapter: AdapterRef | None = None
        sft_s = 0.0
        for step, chunk in enumerate(sft_batches(demos, max(sft_steps, default=0),
                                                 s.trainer.sft_batch,
                                                 stratum=sft_stratum(s.trainer)), start=1):
            t0 = time.perf_counter()
            metrics = await compute.run(trainer.sft_step, chunk, lr=s.trainer.sft_lr)
            sft_s += time.perf_counter() - t0
            if step not in sft_steps:
                continue
            path = work / f"sft{step}"
            await compute.run(trainer.save, path)
            new = AdapterRef("policy", step, path)
            await policy.ensure_adapter(new)
            if adapter is not None:
                await policy.retire_adapter(adapter)
            adapter = new
            after, figures = await _evaluate(policy, held, env, cfg, adapter, in_flight)
            point = {"sft_steps": step, "sft_seconds": round(sft_s, 1),
                     "last_loss": round(metrics["loss"], 4), **figures}
            if before is not None:
                point["gain_vs_base"] = paired_gain(before, after)
            out["checkpoints"].append(point)
            sft_outcomes = after
        if grpo_steps and adapter is not None:
            trainer.reset_optimizer()  # GRPO starts with fresh moments, as in the trainer
            out["grpo"] = await _grpo(policy, trainer, compute, env, train, adapter, work, s,
                                      grpo_steps, grpo_batch, in_flight)
            adapter = out["grpo"].pop("adapter")
            after, figures = await _evaluate(policy, held, env, cfg, adapter, in_flight)
            out["grpo"].update(figures)
            out["grpo"]["gain_vs_sft"] = paired_gain(sft_outcomes, after)
            if before is not None:
                out["grpo"]["gain_vs_base"] = paired_gain(before, after)
    finally:
        await policy.close()
        await catalog.aclose()
        compute.close()
    out["seconds"] = round(time.perf_counter() - started, 1)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    out["load_average_after"] = round(os.getloadavg()[0], 2)
    return out


async def _grpo(policy: Policy, trainer: Any, compute: ComputeThread, env: ToolsetEnvironment,
                tasks: list[TaskSpec], adapter: AdapterRef, work: Path, s: Settings,
                steps: int, batch: int, in_flight: int) -> dict[str, Any]:
    """`steps` GRPO steps on `tasks` from `adapter`; the curve and the last adapter."""
    r = s.rollout
    cfg = GroupConfig(group_size=r.group_size, max_tokens=r.max_tokens,
                      episode_max_tokens=r.episode_max_tokens, temperature=r.temperature,
                      max_steps=r.max_steps,
                      rollout_timeout_s=r.rollout_timeout_s)
    started = time.perf_counter()
    curve: list[dict[str, Any]] = []
    trained = sampled = 0
    for step in range(steps):
        picked = [tasks[(step * batch + j) % len(tasks)] for j in range(batch)]
        groups = []
        for lo in range(0, len(picked), in_flight):
            groups += await asyncio.gather(*[
                run_group(policy, task, env, cfg, adapter=adapter, seed=50_000 + step * 100 + j,
                          group_key=f"grpo{step}-{j}")
                for j, task in list(enumerate(picked))[lo:lo + in_flight]])
        sampled += len(groups)
        payloads = [GroupScoredPayload(
            group_id=uuid.uuid4(), task_id=task.task_id, env=task.env, adapter=adapter.name,
            adapter_version=adapter.version, temperature=cfg.temperature, rollouts=g.rollouts,
            reward_mean=g.reward_mean, reward_std=g.reward_std, trainable=True,
            worker="bench") for task, g in zip(picked, groups, strict=True) if g.trainable]
        rewards = [r.reward for g in groups for r in g.rollouts if r.reward is not None]
        point: dict[str, Any] = {"step": step + 1, "trainable_groups": len(payloads),
                                 "reward_mean": round(statistics.fmean(rewards), 3)
                                 if rewards else None}
        if payloads:
            metrics = await compute.run(trainer.step, payloads)
            trained += len(payloads)
            point["loss"] = round(metrics.get("loss", 0.0), 4)
            path = work / f"grpo{step + 1}"
            await compute.run(trainer.save, path)
            new = AdapterRef("policy", 1000 + step, path)
            await policy.ensure_adapter(new)
            await policy.retire_adapter(adapter)
            adapter = new
        curve.append(point)
    return {"steps": steps, "batch": batch, "group_size": cfg.group_size,
            "groups_sampled": sampled, "groups_trained": trained, "curve": curve,
            "train_seconds": round(time.perf_counter() - started, 1), "adapter": adapter}


def run_episode_learning(*, records: int = 1600, seed: int = 11, holdout_tasks: int = 20,
                         samples: int = 4, sft_steps: tuple[int, ...] = (12, 24),
                         base: bool = True, in_flight: int = 4, micro_batch: int = 2,
                         rows: int = 16, grpo_steps: int = 0,
                         grpo_batch: int = 2) -> dict[str, Any]:
    return asyncio.run(_run(records=records, seed=seed, holdout_tasks=holdout_tasks,
                            samples=samples, sft_steps=sorted(set(sft_steps)), base=base,
                            in_flight=in_flight, micro_batch=micro_batch, rows=rows,
                            grpo_steps=grpo_steps, grpo_batch=grpo_batch))
