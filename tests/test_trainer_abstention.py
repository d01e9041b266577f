"""GRPO pushes an abstention down: an empty reply is a scored failure in its group.

On the real SmolLM2-135M: a group of four replies to one tool_call task, three the right
call and one empty (the end-of-turn token straight away), each with the model's own
sampling log-probs, scored by the real agent loop. The empty reply scores 0 (`empty`), gets
a negative advantage, and after one GRPO step the model puts less probability on it (and
more on the right call). Before, it was "not run": left out of its group, never pushed down
— abstention was a reward hack the loop could learn.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from flywheel.environments import load_environment
from flywheel.events import GroupScoredPayload
from flywheel.policy.base import AdapterRef, Completion, SamplingParams
from flywheel.policy.chat_format import ChatFormat, load_chat_format
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.slow]  # the real model: a few seconds idle, minutes on a busy CPU

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TASK = TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=[WEATHER],
                messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
                verifier=ToolCallSpec(expected=ExpectedCall(name="get_weather",
                                                            arguments={"city": "Oslo"})),
                failure_mode="bad_arguments", fingerprint="abstain", split="train")
RIGHT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
         "</tool_call>")


class Replay:
    """Returns fixed replies, with the log-probs the model gives them (on-policy)."""

    def __init__(self, fmt: ChatFormat, replies: list[tuple[str, list[int], list[float]]]
                 ) -> None:
        self.chat_format, self.replies = fmt, replies

    async def sample(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams, *,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     adapter: AdapterRef | None = None) -> list[Completion]:
        prompt = self.chat_format.render(messages, tools)
        return [Completion(text=t, token_ids=ids, logprobs=lps, prompt_token_ids=prompt,
                           finish_reason="stop", adapter=None, latency_ms=1.0)
                for t, ids, lps in self.replies[:params.n]]

    async def ensure_adapter(self, adapter: AdapterRef) -> None: ...

    async def retire_adapter(self, adapter: AdapterRef) -> None: ...

    async def close(self) -> None: ...


def _logp(trainer: Any, prompt: list[int], ids: list[int]) -> list[float]:
    from flywheel.trainer.engine import Sample, _batch

    b = _batch([Sample(prompt, ids, [0.0] * len(ids), 0.0, 1.0)], trainer.pad_id)
    with torch.no_grad():
        return [float(x) for x in trainer._logps(b, 1.0)[0, -len(ids):]]


async def test_an_empty_reply_gets_a_negative_advantage_and_its_probability_falls() -> None:
    from flywheel.trainer.engine import LoRASpec, LoRATrainer, samples_from_groups
    from flywheel.trainer.grpo import GRPOConfig

    torch.manual_seed(0)
    trainer = LoRATrainer(resolve_model_dir(None), lora=LoRASpec(r=4), grpo=GRPOConfig(),
                          lr=1e-3)
    fmt = load_chat_format(resolve_model_dir(None))
    prompt = fmt.render(TASK.messages, TASK.tools)
    right, empty = fmt.encode(RIGHT + fmt.end_of_turn), fmt.encode(fmt.end_of_turn)
    lp_right, lp_empty = _logp(trainer, prompt, right), _logp(trainer, prompt, empty)
    replies = [(RIGHT, right, lp_right)] * 3 + [("", empty, lp_empty)]

    out = await run_group(Replay(fmt, replies), TASK, load_environment("tool_call"),
                          GroupConfig(group_size=4, rollout_timeout_s=30), adapter=None,
                          seed=0, group_key="abstain")
    assert [r.failure_mode for r in out.rollouts] == [None, None, None, "empty"]
    assert [r.reward for r in out.rollouts] == [1.0, 1.0, 1.0, 0.0] and out.trainable
    group = GroupScoredPayload(group_id=uuid.uuid4(), task_id=TASK.task_id, env="tool_call",
                               adapter=None, adapter_version=None, temperature=1.0,
                               rollouts=out.rollouts, reward_mean=out.reward_mean,
                               reward_std=out.reward_std, trainable=True, worker="test")
    samples = samples_from_groups([group], trainer.grpo)
    assert len(samples) == 4  # the empty reply is trained on, not left out
    (abstain,) = [s for s in samples if s.completion_ids == empty]
    assert abstain.advantage < 0 < samples[0].advantage

    trainer.step([group])
    after_empty, after_right = sum(_logp(trainer, prompt, empty)), sum(_logp(trainer, prompt,
                                                                             right))
    report = (f"log P(empty) {sum(lp_empty):.4f} → {after_empty:.4f}; log P(right) "
              f"{sum(lp_right):.4f} → {after_right:.4f}")
    print(report)
    assert after_empty < sum(lp_empty) - 1e-3, report
    assert after_right > sum(lp_right), report
    assert json.loads(group.model_dump_json())["rollouts"][3]["not_run"] is None
