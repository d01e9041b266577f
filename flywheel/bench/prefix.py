"""`flywheel bench prefix`: one GRPO step and one SFT step with each prompt (and the prefix
all prompts share) run once, against running every prompt + completion in full.

Both paths compute the same loss and gradient (tests/test_trainer_prefix.py checks that);
this measures what running each prompt once saves. Real tool_call prompts (the chat
template with the tools: instructions, tool list, examples, request) of B fixed tasks, G
completions each of `tokens` tokens (drawn at random: the cost does not depend on what they
say), LoRA r=16 on q/k/v/o, the trainer's micro-batch. Each side is timed `repeats` times
after a warm-up; the best run counts. CPU, single process.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (allocator, kernels)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def run_prefix_bench(*, batch: int = 4, group_size: int = 8, tokens: int = 32,
                     repeats: int = 1) -> dict[str, Any]:
    from flywheel.bench.learning import fixed_tasks
    from flywheel.config import TrainerSettings
    from flywheel.environments.prompt import task_messages, task_tools
    from flywheel.mining.demos import demonstration_from_task
    from flywheel.policy.chat_format import load_chat_format
    from flywheel.policy.model_cache import resolve_model_dir
    from flywheel.trainer.engine import LoRASpec, LoRATrainer, Sample
    from flywheel.trainer.grpo import GRPOConfig
    from flywheel.trainer.sft import encode_demonstration, sft_backward

    model_dir = resolve_model_dir(None)
    fmt = load_chat_format(model_dir)
    t = TrainerSettings()
    trainer = LoRATrainer(model_dir, lora=LoRASpec(r=t.lora_r, alpha=t.lora_alpha),
                          grpo=GRPOConfig(), lr=t.lr, micro_batch=t.micro_batch)
    rng = random.Random(0)
    tasks = fixed_tasks(batch)
    samples = []
    for task in tasks:
        ids = fmt.render(task_messages(task), task_tools(task))
        for g in range(group_size):
            completion = [rng.randrange(100, 40000) for _ in range(tokens)]
            samples.append(Sample(ids, completion, [-2.0] * tokens, 1.0 if g % 2 else -1.0,
                                  1.0))

    def grpo(shared: bool) -> Callable[[], Any]:
        def run() -> None:
            trainer.backward(samples, share_prompts=shared)
            trainer.optimizer.zero_grad(set_to_none=True)
        return run

    demos = [d for task in fixed_tasks(batch * 2, seed=1)
             if (d := demonstration_from_task(task, task.task_id)) is not None]
    examples = [encode_demonstration(fmt, d) for d in demos]

    longest = max(len(e.input_ids) for e in examples)
    target = max(e.target_len for e in examples)
    rows = trainer.micro_rows(longest - target, target)  # the same for both paths

    def sft(shared: bool) -> Callable[[], Any]:
        def run() -> None:
            sft_backward(trainer.model, examples, pad_id=trainer.pad_id,
                         micro_batch=rows, share_prefix=shared)
            trainer.optimizer.zero_grad(set_to_none=True)
        return run

    trainer.model.train()
    grpo_full, grpo_shared = _best(grpo(False), repeats), _best(grpo(True), repeats)
    sft_full, sft_shared = _best(sft(False), repeats), _best(sft(True), repeats)
    return {"batch": batch, "group_size": group_size, "completion_tokens": tokens,
            "prompt_tokens": len(samples[0].prompt_ids), "sft_examples": len(examples),
            "grpo_full_s": round(grpo_full, 2), "grpo_shared_s": round(grpo_shared, 2),
            "grpo_speedup": round(grpo_full / grpo_shared, 2),
            "sft_full_s": round(sft_full, 2), "sft_shared_s": round(sft_shared, 2),
            "sft_speedup": round(sft_full / sft_shared, 2)}
