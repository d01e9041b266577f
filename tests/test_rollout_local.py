"""Groups on the real model (SmolLM2-135M, local engine): tool_call, multi-step workplace, and
the workplace world as a toolset over MCP.

The sampling log-probs recorded in each turn must match a fresh forward pass of the same
model over the same tokens: the trainer relies on them for importance ratios.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator

import pytest

from flywheel.demo.samples import TOOLS
from flywheel.environments import load_environment
from flywheel.environments.toolset import ToolsetEnvironment
from flywheel.environments.workplace import WORKPLACE_TOOLS, canonical_state
from flywheel.events import ScoredRollout
from flywheel.policy.local import LocalPolicy
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec, ToolsetSpec, WorkplaceSpec
from flywheel.tools.registry import read_toolset
from flywheel.tools.runtime import Catalog
from flywheel.toolsets import McpStdio

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


def _weather_task() -> TaskSpec:
    return TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                    messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
                    verifier=ToolCallSpec(expected=ExpectedCall(
                        name="get_weather", arguments={"city": "Oslo", "unit": "c"})),
                    failure_mode="bad_arguments", fingerprint="x", split="train")


async def test_tool_call_group_on_the_real_model(policy: LocalPolicy) -> None:
    task = _weather_task()
    cfg = GroupConfig(group_size=4, max_tokens=32, temperature=1.0, rollout_timeout_s=900)
    out = await run_group(policy, task, load_environment("tool_call"), cfg, adapter=None,
                          seed=7, group_key="g1")
    assert len(out.rollouts) == 4 and len(out.scored) == 4  # every attempt ran and was scored
    assert all(r.reward is not None and 0.0 <= r.reward <= 1.0 for r in out.rollouts)
    assert await _check_logprobs(policy, out.rollouts, cfg.temperature) == 4


async def test_one_renderer_for_rollouts_sft_and_serving(policy: LocalPolicy) -> None:
    """The ids a rollout sampled after are `render(task.messages, task.tools)`, and an SFT
    demonstration of the same task trains its reply after exactly those ids."""
    from flywheel.mining.demos import demonstration_from_task
    from flywheel.trainer.sft import IGNORE, encode_demonstration

    task = _weather_task()
    fmt = policy.chat_format
    cfg = GroupConfig(group_size=2, max_tokens=8, temperature=1.0, rollout_timeout_s=900)
    out = await run_group(policy, task, load_environment("tool_call"), cfg, adapter=None,
                          seed=3, group_key="g3")
    rendered = fmt.render(task.messages, task.tools)
    assert [t.prompt_token_ids for r in out.rollouts for t in r.turns] == [rendered] * 2
    demo = demonstration_from_task(task, task.task_id)
    assert demo is not None
    example = encode_demonstration(fmt, demo)
    prompt_len = next(i for i, label in enumerate(example.labels) if label != IGNORE)
    assert example.input_ids[:prompt_len] == rendered
    assert fmt.parse(fmt.tokenizer.decode(example.input_ids[prompt_len:]))["tool_calls"] == [
        {"id": "call_0", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]


async def test_multi_step_workplace_group_on_the_real_model(policy: LocalPolicy) -> None:
    """A short workplace episode through the chat format on the real engine. The context
    shows one earlier call and its result (what mined workplace tasks carry), so the untuned
    model sometimes calls a tool; whatever it does, each turn's prompt is the format's
    rendering of the conversation so far, and results come back as tool responses."""
    initial = {"calendar": {"events": []}, "email": {"inbox": [], "outbox": []},
               "tickets": {"items": [{"id": "tkt-1", "title": "Printer jammed", "priority": 3,
                                      "status": "open", "assignee": None}]}, "next_id": 2}
    expected = {**initial, "tickets": {"items": [{**initial["tickets"]["items"][0],
                                                   "status": "closed"}]}}
    history = [
        {"role": "user", "content": "Which tickets are open?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "ticket_list",
                                                          "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c0", "content": '[{"id": "tkt-1", "status": "open"}]'},
        {"role": "assistant", "content": "Ticket tkt-1 is open."},
        {"role": "user", "content": "Close ticket tkt-1, it is fixed."}]
    task = TaskSpec(task_id=uuid.uuid4(), env="workplace", tools=WORKPLACE_TOOLS,
                    messages=history,
                    verifier=WorkplaceSpec(initial_state=initial, expected_state=expected,
                                           max_steps=3),
                    failure_mode="wrong_tool", fingerprint="y", split="train")
    cfg = GroupConfig(group_size=4, max_tokens=40, temperature=0.7, max_steps=3,
                      rollout_timeout_s=1800)
    out = await run_group(policy, task, load_environment("workplace"), cfg, adapter=None,
                          seed=3, group_key="g2")
    assert len(out.scored) == 4
    assert all(1 <= len(r.turns) <= 3 for r in out.rollouts)
    fmt = policy.chat_format
    for r in out.rollouts:
        assert r.turns[0].prompt_token_ids == fmt.render(task.messages, task.tools)
        for before, after in zip(r.turns, r.turns[1:], strict=False):
            # The reply (as the template renders its parsed calls) and the tool results
            # were appended; nothing before them changed.
            assert after.prompt_token_ids[:len(before.prompt_token_ids)] == \
                before.prompt_token_ids
            assert "<tool_response>" in fmt.tokenizer.decode(
                after.prompt_token_ids[len(before.prompt_token_ids):])
        last = fmt.parse(r.turns[-1].text)
        assert len(r.turns) == cfg.max_steps or not last["tool_calls"]
    assert await _check_logprobs(policy, out.rollouts, cfg.temperature) >= 4


async def test_multi_step_toolset_group_over_mcp_on_the_real_model(policy: LocalPolicy) -> None:
    """The same workplace episode on the workplace world served as a toolset over MCP
    (stdio, one shared server): the real engine's batched episodes call it through the
    session layer, every attempt is scored (the server is up: nothing is not run), and each
    turn with calls says where every call's answer came from."""
    target = "flywheel.environments.workplace_tools:WorkplaceTools"
    reg = (await read_toolset("workplace", McpStdio(
        command=sys.executable, args=["-m", "flywheel.tools.mcp_serve", target],
        sessions="shared"))).model_copy(update={"version": 1})
    initial = {"tickets": {"items": [{"id": "tkt-1", "title": "Printer jammed",
                                      "priority": 3, "status": "open", "assignee": None}]}}
    expected = {"tickets": {"items": [{**initial["tickets"]["items"][0], "status": "closed"}]}}
    task = TaskSpec(task_id=uuid.uuid4(), env="toolset", tools=WORKPLACE_TOOLS,
                    messages=[{"role": "user", "content": "Close ticket tkt-1, it is fixed."}],
                    verifier=ToolsetSpec(toolset="workplace", initial_state=initial,
                                         expected_state=canonical_state(expected), max_steps=3),
                    failure_mode="wrong_tool", fingerprint="z", split="train")
    cfg = GroupConfig(group_size=2, max_tokens=40, temperature=0.7, max_steps=2,
                      rollout_timeout_s=1800)
    catalog = Catalog.of([reg])
    try:
        out = await run_group(policy, task, ToolsetEnvironment(catalog), cfg, adapter=None,
                              seed=3, group_key="g-toolset")
    finally:
        await catalog.aclose()
    assert len(out.scored) == 2
    fmt = policy.chat_format
    for r in out.rollouts:
        for turn in r.turns:
            calls = fmt.parse(turn.text)["tool_calls"]
            if calls:
                assert turn.tools is not None and 1 <= len(turn.tools) <= len(calls)
                assert all(s.source in ("live", "invalid", "refused") for s in turn.tools)
            else:
                assert turn.tools is None
    assert await _check_logprobs(policy, out.rollouts, cfg.temperature) >= 2
