"""The agent loop with a scripted policy: stragglers, typed not-run, multi-step, variance.

The scripted policy is a test double for the loop's logic only; the real engine is exercised
in tests/test_rollout_local.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from flywheel.environments import load_environment
from flywheel.environments.workplace import WORKPLACE_TOOLS
from flywheel.policy.base import AdapterRef, Completion, SamplingParams
from flywheel.rollout.loop import GroupConfig, run_group, summarize
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec, WorkplaceSpec

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class Scripted:
    """Answers from a script: reply(messages, index) → text after the prefill, or a hang."""

    def __init__(self, reply: Any) -> None:
        self.reply = reply
        self.calls = 0

    async def sample(self, messages: Sequence[dict[str, Any]], params: SamplingParams, *,
                     adapter: AdapterRef | None = None) -> list[Completion]:
        out = []
        for i in range(params.n):
            self.calls += 1
            text = await self.reply(list(messages), params.seed, i)
            out.append(Completion(text=text, token_ids=[1, 2], logprobs=[-0.1, -0.2],
                                  prompt_token_ids=[0], finish_reason="stop",
                                  adapter=adapter.name if adapter else None, latency_ms=1.0))
        return out

    async def ensure_adapter(self, adapter: AdapterRef) -> None: ...

    async def retire_adapter(self, adapter: AdapterRef) -> None: ...

    async def close(self) -> None: ...


def _tool_task() -> TaskSpec:
    return TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=[WEATHER],
                    messages=[{"role": "user", "content": "Weather in Oslo?"}],
                    verifier=ToolCallSpec(expected=ExpectedCall(name="get_weather",
                                                                arguments={"city": "Oslo"})),
                    failure_mode="bad_arguments", fingerprint="f", split="train")


def _workplace_task() -> TaskSpec:
    initial = {"calendar": {"events": []}, "email": {"inbox": [], "outbox": []},
               "tickets": {"items": []}, "next_id": 1}
    expected = {**initial, "email": {"inbox": [], "outbox": [
        {"to": "ana@example.com", "subject": "Hi", "body": ""}]}}
    return TaskSpec(task_id=uuid.uuid4(), env="workplace", tools=WORKPLACE_TOOLS,
                    messages=[{"role": "user", "content": "Email ana 'Hi'."}],
                    verifier=WorkplaceSpec(initial_state=initial, expected_state=expected),
                    failure_mode="wrong_tool", fingerprint="w", split="train")


async def test_single_step_group_scores_each_completion() -> None:
    async def reply(_m: list[dict[str, Any]], _seed: int | None, i: int) -> str:
        city = "Oslo" if i % 2 == 0 else "Bergen"
        return f'get_weather", "arguments": {{"city": "{city}"}}}}'  # after the prefill

    cfg = GroupConfig(group_size=4, rollout_timeout_s=5)
    out = await run_group(Scripted(reply), _tool_task(), load_environment("tool_call"), cfg,
                          adapter=None, seed=1, group_key="g")
    assert [r.reward == 1.0 for r in out.rollouts] == [True, False, True, False]
    assert out.trainable and out.success_rate == 0.5
    assert out.rollouts[0].turns[0].token_ids == [1, 2]


async def test_straggler_does_not_hold_the_group_and_is_not_scored_zero() -> None:
    async def reply(messages: list[dict[str, Any]], seed: int | None, _i: int) -> str:
        episode = (seed or 0) // 1000 % 1000
        if episode == 2:
            await asyncio.sleep(3600)  # this rollout hangs
        if any(m["role"] == "user" and m["content"].startswith("Result:") for m in messages):
            return 'final": "sent"}'
        return ('tool": "email_send", "arguments": {"to": "ana@example.com", '
                '"subject": "Hi"}}')

    cfg = GroupConfig(group_size=4, rollout_timeout_s=0.5, max_steps=4)
    started = time.perf_counter()
    out = await run_group(Scripted(reply), _workplace_task(), load_environment("workplace"),
                          cfg, adapter=None, seed=0, group_key="g")
    assert time.perf_counter() - started < 3
    straggler = out.rollouts[2]
    assert straggler.reward is None and straggler.not_run == "timeout"
    assert [r.reward for r in out.rollouts if r.index != 2] == [1.0, 1.0, 1.0]
    assert len(out.scored) == 3 and out.reward_mean == 1.0
    assert not out.trainable  # all scored attempts succeeded: zero variance


async def test_multi_step_invalid_output_gets_feedback_and_can_recover() -> None:
    async def reply(messages: list[dict[str, Any]], _seed: int | None, _i: int) -> str:
        results = [m["content"] for m in messages if m["content"].startswith("Result:")]
        if not results:
            return "oops not json"
        if results[-1].startswith("Result: error:"):
            return 'tool": "email_send", "arguments": {"to": "ana@example.com", "subject": "Hi"}}'
        return 'final": "done"}'

    cfg = GroupConfig(group_size=2, rollout_timeout_s=5, max_steps=5)
    out = await run_group(Scripted(reply), _workplace_task(), load_environment("workplace"),
                          cfg, adapter=None, seed=0, group_key="g")
    assert [r.reward for r in out.rollouts] == [1.0, 1.0]
    assert len(out.rollouts[0].turns) == 3


def test_summary_excludes_not_run_from_statistics() -> None:
    from flywheel.events import ScoredRollout

    def r(i: int, reward: float | None) -> ScoredRollout:
        return ScoredRollout(index=i, reward=reward, reward_components={},
                             failure_mode=None if reward == 1.0 else "other",
                             not_run=None if reward is not None else "crash", turns=[],
                             latency_ms=1)

    out = summarize([r(0, 1.0), r(1, 0.0), r(2, None)], min_scored=2, duration_ms=1)
    assert out.reward_mean == 0.5 and out.trainable and out.success_rate == 0.5
    assert not summarize([r(0, 1.0), r(1, None)], 2, 1).trainable
    assert summarize([r(0, None)], 2, 1).reward_mean is None
    assert json.loads(out.rollouts[2].model_dump_json())["reward"] is None
