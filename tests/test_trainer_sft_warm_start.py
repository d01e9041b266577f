"""The warm start on the real SmolLM2-135M: a few SFT steps on successes' demonstrations make
the untuned model emit the chat format's `<tool_call>` blocks on requests it never saw.

Train and held-out requests are disjoint (other cities, people and ticket numbers); both are
sampled through `LocalPolicy` and the rollout loop with fixed seeds, at the GRPO sampling
temperature, with the chat template and no prefill (what serving renders). Measured on 2
CPU cores (156 s: evaluations 66 + 46, SFT 43): a parsed call ("valid_json") 0.00 → 0.67
and right tool 0.00 → 0.58 after 5 steps of 8 at lr 1e-3 (under the earlier prefilled JSON
prompt the same test gave 0.08 → 0.92 and 0.00 → 0.58; docs/BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest

from flywheel.environments import load_environment
from flywheel.mining.demos import success_demonstration, success_task
from flywheel.policy.base import AdapterRef
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import TaskSpec
from flywheel.trajectory import Trajectory
from tests.test_trainer_sft import record

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

STEPS, BATCH, LR = 5, 8, 1e-3
TRAIN = (["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Cairo", "Delhi", "Hanoi", "Rome", "Seoul",
          "Dakar", "Porto"], ["ana", "bo", "eli", "fay", "gus", "hal"], list(range(1000, 1012)))
HELD = (["Pune", "Quito"], ["chen", "dee"], [7001, 7002])
EVAL = GroupConfig(group_size=2, max_tokens=64, temperature=1.0, rollout_timeout_s=900)
"""The untuned model rambles to the token limit; on a loaded machine a group can take
minutes, and a timed-out attempt is not scored (it would drop out of `before`)."""


def _requests(cities: list[str], people: list[str], tickets: list[int]) -> list[Trajectory]:
    """Successful support-bot trajectories, one per request."""
    out = [record(f"What's the weather in {c}?", [("get_weather", {"city": c, "unit": "c"},
                                                   "ok")], session=f"s-{c}") for c in cities]
    out += [record(f"Email {p}@example.com that the release moved to Friday.",
                   [("send_email", {"to": f"{p}@example.com", "subject": "Release moved",
                                    "body": "It is Friday now."}, "ok")], session=f"s-{p}")
            for p in people]
    out += [record(f"Printer {n} on floor 3 is jammed again, please open a ticket.",
                   [("create_ticket", {"title": f"Printer {n} jammed", "priority": 2}, "ok")],
                   session=f"s-{n}") for n in tickets]
    return out


async def _rates(policy: Any, tasks: list[TaskSpec], adapter: AdapterRef | None
                 ) -> dict[str, float]:
    env = load_environment("tool_call")
    valid = right = n = 0
    # All groups at once: the engine batches them into shared forwards, and each group's
    # seed makes it draw what it would alone.
    groups = await asyncio.gather(*(
        run_group(policy, task, env, EVAL, adapter=adapter, seed=10_000 + i,
                  group_key=f"held{i}") for i, task in enumerate(tasks)))
    for g in groups:
        for r in g.scored:
            n += 1
            valid += r.reward_components.get("valid_json", 0.0) >= 1.0
            right += r.reward_components.get("right_tool", 0.0) >= 1.0
    return {"valid_json": valid / n, "right_tool": right / n, "samples": n}


async def test_sft_teaches_the_tool_call_format_on_unseen_requests(tmp_path: Path) -> None:
    from flywheel.policy.local import LocalPolicy
    from flywheel.policy.model_cache import resolve_model_dir
    from flywheel.trainer.engine import LoRASpec, LoRATrainer
    from flywheel.trainer.grpo import GRPOConfig

    started = time.perf_counter()
    train = [d for t in _requests(*TRAIN) if (d := success_demonstration(t)) is not None]
    held = [task for t in _requests(*HELD) if (task := success_task(t)) is not None]
    assert len(train) == 30 and len(held) == 6
    assert not {d.messages[-1]["content"] for d in train} & {t.messages[-1]["content"]
                                                             for t in held}
    model_dir = resolve_model_dir(None)
    torch.manual_seed(0)  # LoRA A is initialized from the global generator
    trainer = LoRATrainer(model_dir, lora=LoRASpec(), grpo=GRPOConfig(), lr=LR)
    policy = LocalPolicy(model_dir)
    try:
        t0 = time.perf_counter()
        before = await _rates(policy, held, None)
        t1 = time.perf_counter()
        order = random.Random(0).sample(train, len(train))
        losses = []
        for step in range(STEPS):
            batch = [order[(step * BATCH + j) % len(order)] for j in range(BATCH)]
            losses.append((await asyncio.to_thread(trainer.sft_step, batch))["loss"])
        path = tmp_path / "v1"
        trainer.save(path)
        adapter = AdapterRef("policy", 1, path)
        await policy.ensure_adapter(adapter)
        t2 = time.perf_counter()
        after = await _rates(policy, held, adapter)
        t3 = time.perf_counter()
    finally:
        await policy.close()
    seconds = time.perf_counter() - started
    report = (f"before {before} after {after} losses {[round(x, 3) for x in losses]} "
              f"steps {STEPS}×{BATCH} lr {LR} {seconds:.0f}s (setup {t0 - started:.0f}, "
              f"eval {t1 - t0:.0f} + {t3 - t2:.0f}, sft {t2 - t1:.0f})")
    print(report)
    assert trainer.steps == STEPS and losses[-1] < losses[0] / 2, report
    assert after["valid_json"] >= 0.8 or after["valid_json"] - before["valid_json"] >= 0.3, report
    assert after["right_tool"] > before["right_tool"], report
