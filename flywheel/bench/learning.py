"""`flywheel bench learning`: does GRPO on the local engine raise reward on fixed tasks?

A small fixed set of tool_call tasks; mean reward (and exact-success rate) of the base
policy measured with fixed seeds; optionally an SFT warm start on demonstrations of *other*
tool_call requests (the stages the trainer runs, `--sft-steps`), measured the same way;
then K GRPO steps, each on B freshly sampled groups from the current adapter; then the same
measurement with the trained adapter. `gain_mean_reward` is GRPO's gain over its starting
point (the SFT adapter, or the base) on the tasks it trained on.

`heldout` is the figure to trust: GRPO's gain over its start on requests it never trained
on (nor saw as demonstrations), `--heldout-tasks` × `--heldout-samples` (≥ 200) samples per
side paired by (task, sample index, seed), with 95% intervals from a paired bootstrap over
tasks (the tasks are a sample of the requests the policy will meet) and the exact McNemar
p-value of the (task, sample) pairs. Single process, the same engine and trainer classes as
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
from flywheel.policy.cores import ComputeThread
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec


def answered(rng: random.Random, shots: int) -> list[dict[str, Any]]:
    """`shots` earlier requests, each answered with its right call, the call's result and a
    line of text: context that makes the untuned model write `<tool_call>` blocks itself
    (without it, it answers in prose and every reward is 0)."""
    out: list[dict[str, Any]] = []
    for n in range(shots):
        prompt, tool, args = _request(rng)
        out += [{"role": "user", "content": prompt},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"shot{n}", "type": "function",
                     "function": {"name": tool, "arguments": json.dumps(args)}}]},
                {"role": "tool", "tool_call_id": f"shot{n}", "content": '{"ok": true}'},
                {"role": "assistant", "content": "Done."}]
    return out


def fixed_tasks(n: int, seed: int = 0, exclude: set[str] | None = None, *,
                shots: int = 0) -> list[TaskSpec]:
    """`n` tool_call tasks of the demo's requests drawn with `seed`; with `exclude`, distinct
    requests none of which is in it. `shots` > 0 puts that many answered requests before
    each (see `answered`)."""
    rng = random.Random(seed)
    tasks: list[TaskSpec] = []
    seen = set(exclude or ())
    for i in range(n * 200):
        if len(tasks) == n:
            break
        prompt, tool, args = _request(rng)
        if exclude is not None:
            if prompt in seen:
                continue
            seen.add(prompt)
        tasks.append(TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                              messages=[*answered(rng, shots),
                                        {"role": "user", "content": prompt}],
                              verifier=ToolCallSpec(expected=[ExpectedCall(name=tool,
                                                                           arguments=args)]),
                              failure_mode="bad_arguments", fingerprint=f"learn-{i}",
                              split="train"))
    return tasks


Outcomes = dict[tuple[int, int], tuple[bool, float]]
"""(task number, sample index) → (exact success, reward)."""


async def _outcomes(policy: Any, tasks: list[TaskSpec], adapter: AdapterRef | None,
                    cfg: GroupConfig, seed: int) -> Outcomes:
    env = load_environment("tool_call")
    out: Outcomes = {}
    for i, task in enumerate(tasks):
        g = await run_group(policy, task, env, cfg, adapter=adapter, seed=seed + i,
                            group_key=f"heldout{i}")
        for r in g.scored:
            out[(i, r.index)] = (r.failure_mode is None and (r.reward or 0) >= 1.0,
                                 r.reward or 0.0)
    return out


def paired_gain(before: Outcomes, after: Outcomes, *, resamples: int = 4000,
                seed: int = 0) -> dict[str, Any]:
    """`after` − `before` on the pairs both have: exact-success and mean-reward gains, each
    with a 95% percentile interval from a paired bootstrap over tasks; the pairs gained and
    lost and the two-sided exact McNemar p-value of those."""
    from flywheel.gate.decision import exact_mcnemar

    keys = sorted(set(before) & set(after))
    tasks = sorted({t for t, _ in keys})
    by_task: dict[int, list[tuple[float, float]]] = {t: [] for t in tasks}
    gained = lost = 0
    for k in keys:
        (s0, r0), (s1, r1) = before[k], after[k]
        by_task[k[0]].append((float(s1) - float(s0), r1 - r0))
        gained += s1 and not s0
        lost += s0 and not s1
    if not keys:
        return {"pairs": 0, "tasks": 0}

    def mean(rows: list[list[tuple[float, float]]], j: int) -> float:
        flat = [x[j] for row in rows for x in row]
        return statistics.fmean(flat)

    rows = [by_task[t] for t in tasks]
    rng = random.Random(seed)
    draws = [[rows[rng.randrange(len(rows))] for _ in rows] for _ in range(resamples)]
    out: dict[str, Any] = {"pairs": len(keys), "tasks": len(tasks), "pairs_gained": gained,
                           "pairs_lost": lost,
                           # With shared seeds: what the gate's MDE uses (flywheel.gate.power).
                           "discordance": round((gained + lost) / len(keys), 4),
                           "mcnemar_p_two_sided": min(1.0, 2 * min(
                               exact_mcnemar(gained, lost), exact_mcnemar(lost, gained)))}
    for j, name in ((0, "exact_success"), (1, "mean_reward")):
        boot = sorted(mean(d, j) for d in draws)
        out[f"gain_{name}"] = round(mean(rows, j), 4)
        out[f"gain_{name}_ci95"] = [round(boot[int(0.025 * resamples)], 4),
                                    round(boot[int(0.975 * resamples) - 1], 4)]
    return out


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
               lr: float, sft_steps: int = 0, heldout_tasks: int = 25,
               heldout_samples: int = 8) -> dict[str, Any]:
    from flywheel.mining.demos import demonstration_from_task
    from flywheel.policy.local import LocalPolicy
    from flywheel.policy.model_cache import resolve_model_dir
    from flywheel.trainer.engine import LoRASpec, LoRATrainer
    from flywheel.trainer.grpo import GRPOConfig
    from flywheel.trainer.sft import sft_batches, sft_stratum

    model_dir = resolve_model_dir(None)
    policy = LocalPolicy(model_dir)
    compute = ComputeThread("flywheel-bench-trainer")  # one malloc arena for the steps
    trainer = LoRATrainer(model_dir, lora=LoRASpec(), grpo=GRPOConfig(), lr=lr)
    tasks = fixed_tasks(tasks_n)
    # Held out: requests GRPO never trains on and SFT never sees as demonstrations.
    heldout = fixed_tasks(heldout_tasks, seed=2,
                          exclude={t.messages[-1]["content"] for t in tasks})
    cfg = GroupConfig(group_size=group_size, max_tokens=max_tokens, temperature=1.0)
    held_cfg = GroupConfig(group_size=heldout_samples, max_tokens=max_tokens, temperature=1.0)
    env = load_environment("tool_call")
    work = Path(tempfile.mkdtemp(prefix="flywheel-learn-"))
    started = time.perf_counter()
    base = await _evaluate(policy, tasks, None, cfg)
    adapter: AdapterRef | None = None
    sft: dict[str, Any] | None = None
    if sft_steps:
        # Demonstrations of other requests than the evaluated ones (a different draw).
        seen = {json.dumps(t.messages) for t in [*tasks, *heldout]}
        demos = [d for t in fixed_tasks(8 * 8, seed=1) if json.dumps(t.messages) not in seen
                 for d in [demonstration_from_task(t, uuid.uuid4())] if d is not None]
        t = TrainerSettings()  # the trainer's warm-start batch and learning rate
        for chunk in sft_batches(demos, sft_steps, t.sft_batch, stratum=sft_stratum(t)):
            await compute.run(trainer.sft_step, chunk, lr=t.sft_lr)
        trainer.reset_optimizer()  # GRPO starts with fresh moments, as in the trainer
        await compute.run(trainer.save, work / "sft")
        adapter = AdapterRef("policy", 0, work / "sft")
        await policy.ensure_adapter(adapter)
        sft = {"steps": sft_steps, "demonstrations": len(demos),
               **await _evaluate(policy, tasks, adapter, cfg)}
    start = sft or base
    held_start = await _outcomes(policy, heldout, adapter, held_cfg, seed=20_000)
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
        metrics = await compute.run(trainer.step, groups)
        trained_groups += len(groups)
        curve.append(round(metrics["reward_mean"], 3))
        path = work / f"v{step + 1}"
        await compute.run(trainer.save, path)
        new = AdapterRef("policy", step + 1, path)
        await policy.ensure_adapter(new)
        if adapter is not None:
            await policy.retire_adapter(adapter)
        adapter = new
    final = await _evaluate(policy, tasks, adapter, cfg)
    held_final = await _outcomes(policy, heldout, adapter, held_cfg, seed=20_000)
    await policy.close()
    compute.close()
    held = {"start": "sft" if sft else "base",
            "start_exact_success": _share(held_start), "final_exact_success": _share(held_final),
            **paired_gain(held_start, held_final)}
    return {"steps": steps, "optimizer_steps": trainer.steps, "groups_trained": trained_groups,
            "tasks": tasks_n, "group_size": group_size, "lr": lr,
            "max_tokens": max_tokens, "batch": batch,
            "base": base, "sft": sft, "trained": final, "train_reward_curve": curve,
            "gain_mean_reward": round(final["mean_reward"] - start["mean_reward"], 3),
            "heldout": held, "seconds": round(time.perf_counter() - started, 1)}


def _share(outcomes: Outcomes) -> float:
    return round(statistics.fmean(s for s, _ in outcomes.values()), 4) if outcomes else 0.0


def run_learning(steps: int = 30, *, tasks: int = 6, batch: int = 2, group_size: int = 8,
                 max_tokens: int = 64, lr: float = 2e-4, sft_steps: int = 0,
                 heldout_tasks: int = 25, heldout_samples: int = 8) -> dict[str, Any]:
    if heldout_tasks * heldout_samples < 200:
        raise ValueError(f"{heldout_tasks} held-out tasks × {heldout_samples} samples = "
                         f"{heldout_tasks * heldout_samples}: use at least 200 held-out "
                         "samples (--heldout-tasks, --heldout-samples)")
    return asyncio.run(_run(steps, tasks, batch, group_size, max_tokens, lr, sft_steps,
                            heldout_tasks, heldout_samples))
