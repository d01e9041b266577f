"""Groups on the real model (SmolLM2-135M, local engine): tool_call and multi-step workplace.

The sampling log-probs recorded in each turn must match a fresh forward pass of the same
model over the same tokens: the trainer relies on them for importance ratios.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from flywheel.demo.samples import TOOLS
from flywheel.environments import load_environment
from flywheel.environments.workplace import WORKPLACE_TOOLS
from flywheel.events import ScoredRollout
from flywheel.policy.local import LocalPolicy
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec, WorkplaceSpec

pytestmark = [pytest.mark.slow]
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
async def policy() -> AsyncIterator[LocalPolicy]:
    p = LocalPolicy(resolve_model_dir(None))
    yield p
    await p.close()


async def _check_logprobs(policy: LocalPolicy, rollouts: list[ScoredRollout],
                          temperature: float) -> int:
    checked = 0
    for r in rollouts:
        for turn in r.turns:
            assert len(turn.token_ids) == len(turn.logprobs) > 0
            fresh = await policy.logprobs(turn.prompt_token_ids, turn.token_ids, temperature)
            assert max(abs(a - b) for a, b in zip(fresh, turn.logprobs, strict=True)) \
                < TOLERANCE
            checked += 1
    return checked


async def test_tool_call_group_on_the_real_model(policy: LocalPolicy) -> None:
    task = TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                    messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
                    verifier=ToolCallSpec(expected=ExpectedCall(
                        name="get_weather", arguments={"city": "Oslo", "unit": "c"})),
                    failure_mode="bad_arguments", fingerprint="x", split="train")
    cfg = GroupConfig(group_size=4, max_tokens=32, temperature=1.0, rollout_timeout_s=120)
    out = await run_group(policy, task, load_environment("tool_call"), cfg, adapter=None,
                          seed=7, group_key="g1")
    assert len(out.rollouts) == 4 and len(out.scored) == 4  # every attempt ran and was scored
    assert all(r.reward is not None and 0.0 <= r.reward <= 1.0 for r in out.rollouts)
    assert await _check_logprobs(policy, out.rollouts, cfg.temperature) == 4


async def test_multi_step_workplace_group_on_the_real_model(policy: LocalPolicy) -> None:
    initial = {"calendar": {"events": []}, "email": {"inbox": [], "outbox": []},
               "tickets": {"items": [{"id": "tkt-1", "title": "Printer jammed", "priority": 3,
                                      "status": "open", "assignee": None}]}, "next_id": 2}
    expected = {**initial, "tickets": {"items": [{**initial["tickets"]["items"][0],
                                                   "status": "closed"}]}}
    task = TaskSpec(task_id=uuid.uuid4(), env="workplace", tools=WORKPLACE_TOOLS,
                    messages=[{"role": "user", "content": "Close ticket tkt-1, it is fixed."}],
                    verifier=WorkplaceSpec(initial_state=initial, expected_state=expected,
                                           max_steps=3),
                    failure_mode="wrong_tool", fingerprint="y", split="train")
    cfg = GroupConfig(group_size=2, max_tokens=40, temperature=0.9, max_steps=3,
                      rollout_timeout_s=240)
    out = await run_group(policy, task, load_environment("workplace"), cfg, adapter=None,
                          seed=3, group_key="g2")
    assert len(out.scored) == 2
    assert all(1 <= len(r.turns) <= 3 for r in out.rollouts)
    assert await _check_logprobs(policy, out.rollouts, cfg.temperature) >= 2
