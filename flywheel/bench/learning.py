"""`flywheel bench learning`: does GRPO on the local engine raise reward on fixed tasks?

A small fixed set of tool_call tasks; mean reward (and exact-success rate) of the base
policy measured with fixed seeds; optionally an SFT warm start on demonstrations of *other*
tool_call requests (the stages the trainer runs, `--sft-steps`), measured the same way;
then K GRPO steps, each on B freshly sampled groups from the current adapter; then the same
measurement with the trained adapter. `gain_mean_reward` is GRPO's gain over its starting
point (the SFT adapter, or the base). Single process, the same engine and trainer classes as
the services.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from flywheel.config import TrainerSettings
from flywheel.demo.samples import TOOLS, _request
from flywheel.environments import load_environment
from flywheel.events import GroupScoredPayload
from flywheel.policy.base import AdapterRef
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec


def fixed_tasks(n: int, seed: int = 0) -> list[TaskSpec]:
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        prompt, tool, args = _request(rng)
        tasks.append(TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                              messages=[{"role": "user", "content": prompt}],
                              verifier=ToolCallSpec(expected=[ExpectedCall(name=tool,
                                                                           arguments=args)]),
                              failure_mode="bad_arguments", fingerprint=f"learn-{i}",
                              split="train"))
    return tasks


async def _evaluate(policy: Any, tasks: list[TaskSpec], adapter: AdapterRef | None,
                    cfg: GroupConfig) -> dict[str, float]:
    env = load_environment("tool_call")
    rewards, exact, right_tool = [], 0, 0
    for i, task in enumerate(tasks):
        g = await run_group(policy, task, env, cfg, adapter=adapter, seed=10_000 + i,
                            group_key=f"eval{i}")
        for r in g.scored:
            rewards.append(r.reward or 0.0)
            exact += int(r.failure_mode is None and (r.reward or 0) >= 1.0)
            right_tool += int(r.reward_components.get("right_tool", 0) >= 1.0)
    n = max(len(rewards), 1)
    return {"mean_reward": statistics.fmean(rewards) if rewards else 0.0,
            "exact_success": exact / n, "right_tool": right_tool / n}


async def _run(steps: int, tasks_n: int, batch: int, group_size: int, max_tokens: int,
               lr: float, sft_steps: int = 0) -> dict[str, Any]:
    from flywheel.mining.demos import demonstration_from_task
    from flywheel.policy.local import LocalPolicy
    from flywheel.policy.model_cache import resolve_model_dir
    from flywheel.trainer.engine import LoRASpec, LoRATrainer
    from flywheel.trainer.grpo import GRPOConfig
    from flywheel.trainer.sft import sft_batches

    model_dir = resolve_model_dir(None)
    policy = LocalPolicy(model_dir)
    trainer = LoRATrainer(model_dir, lora=LoRASpec(), grpo=GRPOConfig(), lr=lr)
    tasks = fixed_tasks(tasks_n)
    cfg = GroupConfig(group_size=group_size, max_tokens=max_tokens, temperature=1.0)
    env = load_environment("tool_call")
    work = Path(tempfile.mkdtemp(prefix="flywheel-learn-"))
    started = time.perf_counter()
    base = await _evaluate(policy, tasks, None, cfg)
    adapter: AdapterRef | None = None
    sft: dict[str, Any] | None = None
    if sft_steps:
        # Demonstrations of other requests than the evaluated ones (a different draw).
        seen = {json.dumps(t.messages) for t in tasks}
        demos = [d for t in fixed_tasks(8 * 8, seed=1) if json.dumps(t.messages) not in seen
                 for d in [demonstration_from_task(t, uuid.uuid4())] if d is not None]
        t = TrainerSettings()  # the trainer's warm-start batch and learning rate
        for chunk in sft_batches(demos, sft_steps, t.sft_batch):
            await asyncio.to_thread(trainer.sft_step, chunk, lr=t.sft_lr)
        trainer.reset_optimizer()  # GRPO starts with fresh moments, as in the trainer
        await asyncio.to_thread(trainer.save, work / "sft")
        adapter = AdapterRef("policy", 0, work / "sft")
        await policy.ensure_adapter(adapter)
        sft = {"steps": sft_steps, "demonstrations": len(demos),
               **await _evaluate(policy, tasks, adapter, cfg)}
    start = sft or base
    curve, trained_groups = [], 0
    for step in range(steps):
        groups = []
        for j in range(batch):
            task = tasks[(step * batch + j) % len(tasks)]
            g = await run_group(policy, task, env, cfg, adapter=adapter,
                                seed=step * 100 + j, group_key=f"s{step}-{j}")
            if g.trainable:
                groups.append(GroupScoredPayload(
                    group_id=uuid.uuid4(), task_id=task.task_id, env="tool_call",
                    adapter=adapter.name if adapter else None,
                    adapter_version=adapter.version if adapter else None, temperature=1.0,
                    rollouts=g.rollouts, reward_mean=g.reward_mean, reward_std=g.reward_std,
                    trainable=True, worker="bench"))
        if not groups:
            continue
        metrics = await asyncio.to_thread(trainer.step, groups)
        trained_groups += len(groups)
        curve.append(round(metrics["reward_mean"], 3))
        path = work / f"v{step + 1}"
        await asyncio.to_thread(trainer.save, path)
        new = AdapterRef("policy", step + 1, path)
        await policy.ensure_adapter(new)
        if adapter is not None:
            await policy.retire_adapter(adapter)
        adapter = new
    final = await _evaluate(policy, tasks, adapter, cfg)
    await policy.close()
    return {"steps": steps, "optimizer_steps": trainer.steps, "groups_trained": trained_groups,
            "tasks": tasks_n, "group_size": group_size, "lr": lr,
            "max_tokens": max_tokens, "batch": batch,
            "base": base, "sft": sft, "trained": final, "train_reward_curve": curve,
            "gain_mean_reward": round(final["mean_reward"] - start["mean_reward"], 3),
            "seconds": round(time.perf_counter() - started, 1)}


def run_learning(steps: int = 30, *, tasks: int = 6, batch: int = 2, group_size: int = 8,
                 max_tokens: int = 64, lr: float = 2e-4, sft_steps: int = 0) -> dict[str, Any]:
    return asyncio.run(_run(steps, tasks, batch, group_size, max_tokens, lr, sft_steps))
