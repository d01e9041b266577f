"""`flywheel bench trainer`: K GRPO steps through Flywheel's pipeline vs TRL's GRPOTrainer.

Both sides train the same model (the local SmolLM2 safetensors directory) with the same LoRA
(r=16, alpha=32, q/k/v/o), group size G, completion limit, learning rate, clip range
(0.2 / 0.28, token-level loss, std-scaled group advantages, no KL) and reward (Flywheel's
tool_call verifier on the completion as the policy's chat format parses it) on the same
fixed tool_call tasks (each after three answered requests, so the untuned model calls
tools and its groups have reward variance), on CPU.

Flywheel side, in-process: a LocalPolicy (its own model, its own worker thread) samples and
scores groups with `run_group` while a LoRATrainer (a second model copy) steps on another
thread. Like a rollout worker, the sampler keeps up to `rollout.max_inflight_groups` groups
in flight (never more than the step still needs), so the engine decodes their rows in shared
forwards — as TRL generates a step's B·G rows in one `generate`. Step k trains on groups
sampled by adapter version k−1 or older (bounded staleness, default 1) while the sampler
already samples the batch for step k+1 with the newest version; every version is saved
(weights + optimizer state) and loaded into the sampler, as the services do across
processes. As the services do, a step waits for B *trainable* groups
(zero-variance groups are sampled, paid for, and dropped). Timed from the first sample
until version K is saved; model loading is excluded on every side. The same pipeline is
also timed without overlap (staleness 0, every phase on all cores), so the overlap's own
effect on this machine is visible rather than assumed.

TRL side: `GRPOTrainer.train()` with `max_steps=K` and its own transformers `generate`
(gradient checkpointing off, as in Flywheel's trainer, and the same 4 rows per backward,
accumulated into one optimizer step per generation of B·G rows). The
prompt is a plain-text prompt: the policy's chat format rendered with the task's tools and
the generation prompt, i.e. exactly the token sequence Flywheel samples from; the reward
function parses each completion with the same chat format before verifying. Both sides'
completions run to EOS or the token limit (mean lengths reported).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.bench.learning import fixed_tasks
from flywheel.config import RolloutSettings
from flywheel.environments import load_environment
from flywheel.environments.prompt import task_messages, task_tools
from flywheel.events import GroupScoredPayload
from flywheel.policy.base import AdapterRef
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import RolloutNotRun, TaskSpec

TRL_MISSING = "TRL is not installed: `pip install -e '.[bench]'` (or `pip install trl`)"


@dataclass
class _Shared:
    """What the trainer thread publishes to the sampler: the newest saved adapter."""

    latest: AdapterRef | None = None
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    @property
    def version(self) -> int:
        return 0 if self.latest is None else self.latest.version


async def _flywheel(steps: int, tasks: list[TaskSpec], batch: int, cfg: GroupConfig,
                    lr: float, staleness: int, sampler_threads: int,
                    trainer_threads: int, inflight: int) -> dict[str, Any]:
    import torch

    from flywheel.policy.local import LocalPolicy
    from flywheel.policy.model_cache import resolve_model_dir
    from flywheel.trainer.engine import LoRASpec, LoRATrainer
    from flywheel.trainer.grpo import GRPOConfig

    model_dir = resolve_model_dir(None)
    loaded = time.perf_counter()
    # torch fixes a thread's intra-op thread count at its first parallel op, from the global
    # setting of that moment: the policy's thread takes sampler_threads now, the trainer's
    # thread takes trainer_threads in its initializer.
    torch.set_num_threads(sampler_threads)
    policy = LocalPolicy(model_dir)
    await policy.logprobs([0], [0], 1.0)
    trainer = LoRATrainer(model_dir, lora=LoRASpec(), grpo=GRPOConfig(), lr=lr)
    compute = ThreadPoolExecutor(1, thread_name_prefix="bench-trainer",
                                 initializer=torch.set_num_threads, initargs=(trainer_threads,))
    loop = asyncio.get_running_loop()
    load_s = time.perf_counter() - loaded
    env = load_environment("tool_call")
    work = Path(tempfile.mkdtemp(prefix="flywheel-bench-trainer-"))
    shared = _Shared()
    batches: asyncio.Queue[tuple[list[GroupScoredPayload], int]] = asyncio.Queue()
    sampled = {"groups": 0, "dropped": 0, "tokens": 0, "waves": 0}
    trained: list[dict[str, float]] = []

    async def sampler() -> None:
        current: AdapterRef | None = None
        n = 0
        for b in range(steps):
            async with shared.changed:  # batch b may be sampled by version ≥ b − staleness
                while shared.version < b - staleness:
                    await shared.changed.wait()
                newest = shared.latest
            if newest is not None and newest is not current:
                await policy.ensure_adapter(newest)
                if current is not None:
                    await policy.retire_adapter(current)
                current = newest
            groups: list[GroupScoredPayload] = []
            attempts = 0
            while len(groups) < batch and attempts < 4 * batch:
                # As a rollout worker does: up to `inflight` groups at once (the engine batches
                # their rows into shared forwards), never more than this step still needs.
                wave = [(tasks[(n + i) % len(tasks)], n + i + 1)
                        for i in range(min(inflight, batch - len(groups), 4 * batch - attempts))]
                n += len(wave)
                attempts += len(wave)
                scored = await asyncio.gather(*(
                    run_group(policy, task, env, cfg, adapter=current, seed=seed,
                              group_key=f"b{b}-{seed}") for task, seed in wave))
                sampled["waves"] += 1
                for (task, _), g in zip(wave, scored, strict=True):
                    sampled["groups"] += 1
                    sampled["tokens"] += sum(len(t.token_ids) for r in g.rollouts
                                             for t in r.turns)
                    if not g.trainable:
                        sampled["dropped"] += 1
                        continue
                    groups.append(GroupScoredPayload(
                        group_id=uuid.uuid4(), task_id=task.task_id, env="tool_call",
                        adapter=current.name if current else None,
                        adapter_version=current.version if current else None,
                        temperature=cfg.temperature, rollouts=g.rollouts,
                        reward_mean=g.reward_mean, reward_std=g.reward_std, trainable=True,
                        worker="bench"))
            await batches.put((groups, 0 if current is None else current.version))

    async def train() -> None:
        for k in range(1, steps + 1):
            groups, version = await batches.get()
            metrics = await loop.run_in_executor(compute, trainer.step, groups)
            path = work / f"v{k}"
            await loop.run_in_executor(compute, trainer.save, path)
            trained.append({"step_s": metrics["step_s"], "tokens": metrics["tokens"],
                            "groups": len(groups), "staleness": k - 1 - version,
                            "reward_mean": metrics["reward_mean"]})
            async with shared.changed:
                shared.latest = AdapterRef("policy", k, path)
                shared.changed.notify_all()

    started = time.perf_counter()
    await asyncio.gather(sampler(), train())
    elapsed = time.perf_counter() - started
    await policy.close()
    compute.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    tokens = sum(s["tokens"] for s in trained)
    return {"seconds": elapsed, "load_s": load_s, "tokens_trained": int(tokens),
            "groups_trained": sum(int(s["groups"]) for s in trained),
            "groups_sampled": sampled["groups"], "groups_dropped": sampled["dropped"],
            "sampling_waves": sampled["waves"],
            "mean_completion_tokens": sampled["tokens"] / max(sampled["groups"] * cfg.group_size,
                                                              1),
            "train_step_s": [round(s["step_s"], 2) for s in trained],
            "staleness": [int(s["staleness"]) for s in trained],
            "reward_curve": [round(s["reward_mean"], 3) for s in trained]}


def _trl(steps: int, tasks: list[TaskSpec], batch: int, cfg: GroupConfig,
         lr: float) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same setup; {"error": why} when it cannot run here."""
    try:
        import datasets  # noqa: F401  (TRL's own dependency; missing = TRL not installed)
        import trl
    except ImportError as err:
        return {"error": f"{TRL_MISSING} ({err})"}
    try:
        return _trl_run(trl, steps, tasks, batch, cfg, lr)
    except Exception as err:  # reported, never replaced by a made-up figure
        return {"version": trl.__version__, "error": f"{type(err).__name__}: {err}"}


def _trl_run(trl: Any, steps: int, tasks: list[TaskSpec], batch: int, cfg: GroupConfig,
             lr: float) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flywheel.policy.chat_format import load_chat_format
    from flywheel.policy.model_cache import resolve_model_dir
    from flywheel.trainer.engine import CPU_MICRO_BATCH, LoRASpec

    model_dir = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    fmt = load_chat_format(model_dir)
    rows = [{"prompt": fmt.render_text(task_messages(t), task_tools(t)), "task_index": i}
            for i, t in enumerate(tasks)]
    env = load_environment("tool_call")

    def tool_call_reward(completions: list[str], task_index: list[int],
                         **_: Any) -> list[float | None]:
        out: list[float | None] = []
        for text, i in zip(completions, task_index, strict=True):
            try:
                out.append(env.verify_task(tasks[i], fmt.parse(text)).reward)
            except RolloutNotRun:  # not run: excluded (NaN in TRL), never scored 0
                out.append(None)
        return out

    lora = LoRASpec()
    output_dir = tempfile.mkdtemp(prefix="flywheel-bench-trl-")
    # One generate of the step's B·G rows, trained in micro-batches of Flywheel's CPU trainer
    # accumulated into one optimizer step. (16 rows of ~860 tokens in one backward, no
    # checkpointing, were OOM-killed at 24 GB.)
    generated = batch * cfg.group_size
    micro = math.gcd(generated, CPU_MICRO_BATCH)
    args = trl.GRPOConfig(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=micro,
        gradient_accumulation_steps=generated // micro, num_generations=cfg.group_size,
        max_completion_length=cfg.max_tokens, temperature=cfg.temperature, top_p=1.0, top_k=0,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
        scale_rewards="group", use_cpu=True, bf16=False, fp16=False, report_to="none",
        # TRL's default recomputes activations in the backward to save memory; Flywheel's
        # trainer does not (its `gradient_checkpointing` setting is off), so neither does TRL.
        gradient_checkpointing=False,
        logging_steps=1, save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=0, dataloader_pin_memory=False, seed=0)
    loaded = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 local_files_only=True)
    grpo = trl.GRPOTrainer(
        model=model, reward_funcs=tool_call_reward, args=args,
        train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
        peft_config=LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                               target_modules=list(lora.target_modules),
                               task_type="CAUSAL_LM"))
    load_s = time.perf_counter() - loaded
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # its per-step log dicts: keep --json clean
        grpo.train()
    elapsed = time.perf_counter() - started
    logs = [e for e in grpo.state.log_history if "completions/mean_length" in e]
    lengths = [float(e["completions/mean_length"]) for e in logs]
    rewards = [round(float(e["reward"]), 3) for e in logs if "reward" in e]
    result = {"version": trl.__version__, "seconds": elapsed, "load_s": load_s,
              "steps": int(grpo.state.global_step),
              "mean_completion_tokens": statistics.fmean(lengths) if lengths else None,
              "reward_curve": rewards}
    del grpo, model
    gc.collect()
    shutil.rmtree(output_dir, ignore_errors=True)
    return result


def _timed_flywheel(steps: int, tasks: list[TaskSpec], batch: int, cfg: GroupConfig,
                    lr: float, staleness: int, sampler_threads: int,
                    trainer_threads: int, inflight: int) -> dict[str, Any]:
    import torch

    cores = torch.get_num_threads()
    try:
        return asyncio.run(_flywheel(steps, tasks, batch, cfg, lr, staleness, sampler_threads,
                                     trainer_threads, inflight))
    finally:
        torch.set_num_threads(cores)
        gc.collect()  # its two models, before the next side loads its own


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in d.items()}


def run_trainer_bench(steps: int = 3, *, batch: int = 2, group_size: int = 8,
                      max_tokens: int = 64, lr: float = 2e-4, tasks: int = 6,
                      staleness: int = 1, sequential: bool = True,
                      trl: bool = True, inflight: int | None = None) -> dict[str, Any]:
    """`inflight` None: the rollout worker's default (`rollout.max_inflight_groups`)."""
    inflight = RolloutSettings().max_inflight_groups if inflight is None else inflight
    if min(steps, batch, staleness, inflight) < 1:
        raise ValueError("steps, batch, staleness and inflight must be ≥ 1")
    import torch

    # Three answered requests before each: GRPO from the base model needs reward variance,
    # which the untuned model only shows once the context holds calls (see `answered`).
    fixed = fixed_tasks(tasks, shots=3)
    cfg = GroupConfig(group_size=group_size, max_tokens=max_tokens, temperature=1.0)
    cores = torch.get_num_threads()
    # Overlapped, the trainer (compute-bound, scales with cores; the bottleneck on CPU) keeps
    # every core and the sampler (latency-bound, scales poorly) gets what is left, at least
    # one. Measured on 2 cores: 69 s for this split vs 78 s for 1 + 1 and far worse for 2 + 2.
    sampler_threads = max(cores // 2, 1) if cores > 2 else 1
    load = [os.getloadavg()[0]]

    def note(msg: str) -> None:
        load.append(os.getloadavg()[0])
        print(msg, file=sys.stderr, flush=True)

    fw = _timed_flywheel(steps, fixed, batch, cfg, lr, staleness, sampler_threads, cores,
                         inflight)
    note(f"flywheel, overlapped: {fw['seconds']:.1f}s for {steps} steps")
    seq: dict[str, Any] = {}
    if sequential:  # the same pipeline without overlap, every phase on all cores
        seq = _timed_flywheel(steps, fixed, batch, cfg, lr, 0, cores, cores, inflight)
        note(f"flywheel, sequential: {seq['seconds']:.1f}s")
    other: dict[str, Any] = (_trl(steps, fixed, batch, cfg, lr) if trl
                             else {"error": "skipped (--no-trl)"})
    if trl:
        note(f"TRL: {other.get('seconds', float('nan')):.1f}s")
    trl_s = other.get("seconds")
    return {
        "steps": steps, "group_size": group_size, "batch_groups": batch,
        "max_tokens": max_tokens, "inflight_groups": inflight,
        "mode": ("in-process overlap: LocalPolicy sampling (own model, own thread) concurrent "
                 f"with LoRATrainer steps (second thread), ≤ {inflight} groups in flight, "
                 f"staleness ≤ {staleness}, every "
                 "adapter version saved and loaded into the sampler"),
        "torch_threads": {"overlapped": {"sampler": sampler_threads, "trainer": cores},
                          "sequential": cores, "trl": cores},
        # Other work on the machine skews every side; 1-minute load averages let a reader judge.
        "load_avg": [round(x, 2) for x in load],
        "flywheel_s": round(fw["seconds"], 2),
        "step_tokens_per_s": round(fw["tokens_trained"] / fw["seconds"], 1),
        "flywheel": _rounded({k: v for k, v in fw.items() if k != "seconds"}),
        "flywheel_sequential_s": round(seq["seconds"], 2) if seq else None,
        "overlap_gain": round(seq["seconds"] / fw["seconds"], 2) if seq else None,
        "trl_version": other.get("version"),
        "trl_s": round(trl_s, 2) if trl_s else None,
        "speedup_vs_trl": round(trl_s / fw["seconds"], 2) if trl_s else None,
        "speedup_sequential_vs_trl": (round(trl_s / seq["seconds"], 2)
                                      if trl_s and seq else None),
        "trl": _rounded({k: v for k, v in other.items() if k not in ("seconds", "version")}),
    }
