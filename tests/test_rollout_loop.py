"""The agent loop with a scripted policy: stragglers, typed not-run, multi-step, variance.

The scripted policy is a test double for the loop's logic only, with the real chat format
(the SmolLM2 tokenizer and the bundled template) so replies are the text a model would
write; the real engine is exercised in tests/test_rollout_local.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from flywheel.environments import load_environment
from flywheel.environments.workplace import WORKPLACE_TOOLS
from flywheel.policy.base import AdapterRef, Completion, SamplingParams
from flywheel.policy.chat_format import ChatFormat, load_chat_format
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.rollout.loop import GroupConfig, run_group, summarize
from flywheel.tasks import CodeSpec, ExpectedCall, TaskSpec, ToolCallSpec, WorkplaceSpec
from tests.support.scripted import Lockstep, Scripted, tool_call

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return load_chat_format(resolve_model_dir(None))


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


async def test_single_step_group_scores_each_parsed_reply(fmt: ChatFormat) -> None:
    async def reply(_m: list[dict[str, Any]], _seed: int | None, i: int) -> str:
        return [tool_call("get_weather", city="Oslo"), tool_call("get_weather", city="Bergen"),
                "It is sunny in Oslo.", '<tool_call>\n{"name": "get_weather", "argu'][i]

    policy = Scripted(reply, fmt)
    task = _tool_task()
    cfg = GroupConfig(group_size=4, rollout_timeout_s=5)
    out = await run_group(policy, task, load_environment("tool_call"), cfg,
                          adapter=None, seed=1, group_key="g")
    assert [r.reward for r in out.rollouts] == [1.0, 0.4, 0.0, 0.0]
    assert [r.failure_mode for r in out.rollouts] == [
        None, "bad_arguments", "invalid_format", "invalid_format"]
    assert out.trainable and out.success_rate == 0.25
    assert out.rollouts[0].turns[0].token_ids == [1, 2]
    # The task's own messages and tools, no prefill: what serving renders.
    assert policy.sent == [(task.messages, task.tools)]
    assert out.rollouts[0].turns[0].prompt_token_ids == fmt.render(task.messages, task.tools)


async def test_code_tasks_get_an_instruction_and_are_scored_on_the_text(fmt: ChatFormat
                                                                        ) -> None:
    async def reply(_m: list[dict[str, Any]], _seed: int | None, i: int) -> str:
        body = "return a + b" if i == 0 else "return a - b"
        return f"Here it is:\n```python\ndef add(a, b):\n    {body}\n```"

    task = TaskSpec(task_id=uuid.uuid4(), env="code", tools=[],
                    messages=[{"role": "user", "content": "Add two numbers."}],
                    verifier=CodeSpec(tests="assert add(1, 2) == 3", entrypoint="add"),
                    failure_mode="other", fingerprint="c", split="train")
    policy = Scripted(reply, fmt)
    out = await run_group(policy, task, load_environment("code"),
                          GroupConfig(group_size=2, rollout_timeout_s=30), adapter=None,
                          seed=1, group_key="c")
    assert [r.reward for r in out.rollouts] == [1.0, 0.0]
    (messages, tools), = policy.sent
    assert tools is None and messages[0]["role"] == "system" and "`add`" in messages[0]["content"]


def _email(messages: list[dict[str, Any]]) -> str:
    """Send the email, then answer in plain text once the tool result is back."""
    if any(m["role"] == "tool" for m in messages):
        return "Sent the email to Ana."
    return tool_call("email_send", to="ana@example.com", subject="Hi")


@pytest.mark.parametrize("engine", [Scripted, Lockstep])
async def test_straggler_does_not_hold_the_group_and_is_scored_a_timeout(
        fmt: ChatFormat, engine: type[Scripted]) -> None:
    async def reply(messages: list[dict[str, Any]], seed: int | None, _i: int) -> str:
        if engine is Scripted and (seed or 0) // 1000 % 1000 == 2:
            await asyncio.sleep(3600)  # this rollout hangs
        if engine is Lockstep and len(messages) > 1:
            await asyncio.sleep(3600)  # the whole batch hangs in its second turn
        return _email(messages)

    # 1.5 s: room for the three scripted rollouts on a loaded CI core, far below the hang.
    cfg = GroupConfig(group_size=4, rollout_timeout_s=1.5, max_steps=4)
    started = time.perf_counter()
    out = await run_group(engine(reply, fmt), _workplace_task(), load_environment("workplace"),
                          cfg, adapter=None, seed=0, group_key="g")
    assert time.perf_counter() - started < 10
    # Running past the deadline is the attempt's failure: scored 0 (`timeout`), kept in the
    # group so GRPO pushes it down, never left out as if it had not run.
    if engine is Lockstep:
        assert all(r.reward == 0.0 and r.failure_mode == "timeout" and r.not_run is None
                   for r in out.rollouts)
        assert all(len(r.turns) == 1 for r in out.rollouts)  # the turn it did sample
        return
    straggler = out.rollouts[2]
    assert straggler.reward == 0.0 and straggler.failure_mode == "timeout"
    assert [r.reward for r in out.rollouts] == [1.0, 1.0, 0.0, 1.0]
    assert len(out.scored) == 4 and out.reward_mean == 0.75
    assert out.trainable  # the timeout against three successes: a signal


@pytest.mark.parametrize("engine", [Scripted, Lockstep])
async def test_multi_step_tool_calls_run_and_results_come_back_as_tool_messages(
        fmt: ChatFormat, engine: type[Scripted]) -> None:
    """Turn 1 calls two tools in parallel (one of them fails in the world), turn 2 sees both
    results as `tool` messages with the calls' ids and fixes it, turn 3 answers in text:
    the episode ends there. Every turn's prompt ids are the format's rendering of the
    conversation so far."""
    async def reply(messages: list[dict[str, Any]], _seed: int | None, _i: int) -> str:
        results = [m for m in messages if m["role"] == "tool"]
        if not results:
            return (tool_call("email_send", to="ana@example.com", subject="Hi") + "\n"
                    + tool_call("ticket_close", ticket_id="tkt-404"))
        if len(results) == 2:
            assert [m["tool_call_id"] for m in results] == ["call_0_0", "call_0_1"]
            assert results[1]["content"].startswith("error:")
            return "The ticket does not exist. " + tool_call("ticket_list")
        return "Done: Ana has the email."

    policy = engine(reply, fmt)
    task = _workplace_task()
    out = await run_group(policy, task, load_environment("workplace"),
                          GroupConfig(group_size=2, rollout_timeout_s=5, max_steps=6),
                          adapter=None, seed=0, group_key="g")
    assert [r.reward for r in out.rollouts] == [1.0, 1.0]
    turns = out.rollouts[0].turns
    assert len(turns) == 3
    final = max((m for m, _ in policy.sent), key=len)
    assert [m["role"] for m in final] == ["user", "assistant", "tool", "tool", "assistant",
                                          "tool"]
    assert final[1]["tool_calls"][0]["function"] == {
        "name": "email_send", "arguments": '{"to": "ana@example.com", "subject": "Hi"}'}
    assert final[4]["content"] == "The ticket does not exist."
    assert [t.prompt_token_ids for t in turns] == [
        fmt.render(final[:n], task.tools) for n in (1, 4, 6)]


async def test_an_unparsable_reply_ends_the_episode(fmt: ChatFormat) -> None:
    async def reply(messages: list[dict[str, Any]], _seed: int | None, _i: int) -> str:
        return '<tool_call>\n{"name": "email_send", "arguments": {"to": ana}}\n</tool_call>'

    out = await run_group(Scripted(reply, fmt), _workplace_task(),
                          load_environment("workplace"),
                          GroupConfig(group_size=2, rollout_timeout_s=5, max_steps=5),
                          adapter=None, seed=0, group_key="g")
    assert [len(r.turns) for r in out.rollouts] == [1, 1]
    assert [r.failure_mode for r in out.rollouts] == ["incomplete", "incomplete"]


class Cut(Scripted):
    """Replies whose text starts with "CUT:" come back as cut by max_tokens."""

    async def sample(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams, *,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     adapter: AdapterRef | None = None) -> list[Completion]:
        out = await super().sample(messages, params, tools=tools, adapter=adapter)
        return [dataclasses.replace(c, text=c.text.removeprefix("CUT:"), finish_reason="length")
                if c.text.startswith("CUT:") else c for c in out]


async def test_empty_and_truncated_replies_are_scored_failures(fmt: ChatFormat) -> None:
    right = tool_call("get_weather", city="Oslo")

    async def reply(_m: list[dict[str, Any]], _seed: int | None, i: int) -> str:
        return [right, "", "CUT:" + right[:30], "CUT:" + right, "  \n"][i]

    out = await run_group(Cut(reply, fmt), _tool_task(), load_environment("tool_call"),
                          GroupConfig(group_size=5, rollout_timeout_s=5), adapter=None,
                          seed=1, group_key="g")
    assert [r.failure_mode for r in out.rollouts] == [None, "empty", "truncated", None, "empty"]
    # A reply cut mid-call scores 0 whatever the verifier thought of its fragment; one whose
    # served text holds the right call before the cut is a success.
    assert [r.reward for r in out.rollouts] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert all(r.not_run is None for r in out.rollouts) and out.trainable


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


def test_a_cut_reply_that_called_an_unsafe_tool_stays_an_unsafe_action() -> None:
    """Truncation relabels a failed reply as `truncated`, but never an unsafe call: the gate's
    failure-mode counts and what changed must still say what the model did."""
    from flywheel.events import Turn
    from flywheel.rollout.loop import score
    from flywheel.tasks import VerifierResult

    cut = [Turn(prompt_token_ids=[1], token_ids=[2], logprobs=[-0.1], text="x",
                finish_reason="length")]
    unsafe = VerifierResult(reward=0.0, reward_components={"unsafe": 1.0},
                            failure_mode="unsafe_action")
    assert score(unsafe, cut).failure_mode == "unsafe_action"
    wrong = VerifierResult(reward=0.0, reward_components={}, failure_mode="wrong_tool")
    assert score(wrong, cut).failure_mode == "truncated"


class _Queued(Lockstep):
    """A batched engine that makes each call wait `wait_s` (behind other requests, as a gate
    round's episodes wait on one CPU engine) and reports `own_ms` of forward passes per row."""

    def __init__(self, reply: Any, fmt: ChatFormat, wait_s: float, own_ms: float) -> None:
        super().__init__(reply, fmt)
        self.wait_s, self.own_ms = wait_s, own_ms

    async def sample_many(self, prompts: Any, params: Any, *, tools: Any = None,
                          adapter: Any = None) -> list[list[Any]]:
        await asyncio.sleep(self.wait_s)
        out = await super().sample_many(prompts, params, tools=tools, adapter=adapter)
        for row in out:
            for c in row:
                c.extra["batch_ms"] = self.own_ms
        return out


async def test_an_episode_deadline_counts_its_own_time_not_its_queueing(fmt: ChatFormat
                                                                        ) -> None:
    async def reply(messages: list[dict[str, Any]], seed: int | None, _i: int) -> str:
        return _email(messages)

    cfg = GroupConfig(group_size=2, rollout_timeout_s=1.0, max_steps=4)
    # Two turns, each waiting 0.7 s for the engine and taking it 10 ms: 1.4 s of wall time,
    # 20 ms of its own. Under the 1 s deadline, and it succeeds.
    started = time.perf_counter()
    out = await run_group(_Queued(reply, fmt, 0.7, 10.0), _workplace_task(),
                          load_environment("workplace"), cfg, adapter=None, seed=0,
                          group_key="g")
    assert time.perf_counter() - started > cfg.rollout_timeout_s
    assert [r.reward for r in out.rollouts] == [1.0, 1.0], [r.failure_mode for r in out.rollouts]
    # The same episodes whose forward passes took 0.7 s a turn (the engine's own time): the
    # second turn passes the deadline, a scored timeout.
    out = await run_group(_Queued(reply, fmt, 0.0, 700.0), _workplace_task(),
                          load_environment("workplace"), cfg, adapter=None, seed=0,
                          group_key="g")
    assert all(r.failure_mode == "timeout" and r.reward == 0.0 and len(r.turns) == 2
               for r in out.rollouts), [(r.failure_mode, len(r.turns)) for r in out.rollouts]
    # An engine that reports no forward time (vLLM) is charged its whole wait.
    slow = _Queued(reply, fmt, 0.7, 0.0)
    slow.sample_many = _without_own_time(slow.sample_many)  # type: ignore[method-assign]
    out = await run_group(slow, _workplace_task(), load_environment("workplace"), cfg,
                          adapter=None, seed=0, group_key="g")
    assert all(r.failure_mode == "timeout" for r in out.rollouts)


def _without_own_time(sample_many: Any) -> Any:
    async def call(*args: Any, **kwargs: Any) -> list[list[Any]]:
        out = await sample_many(*args, **kwargs)
        for row in out:
            for c in row:
                c.extra.pop("batch_ms")
        return out
    return call


def test_a_turn_on_a_toolset_gets_the_episode_token_limit() -> None:
    """A task on a registered toolset gets `episode_max_tokens` per turn when it is more
    (the helpdesk's calendar_create_event calls take 74-77 tokens: never made at 64);
    single steps and the bundled world keep `max_tokens`."""
    from flywheel.config import RolloutSettings, Settings
    from flywheel.rollout.loop import turn_tokens
    from flywheel.rollout.worker import group_config
    from flywheel.tasks import EpisodeSpec

    episode = TaskSpec(task_id=uuid.uuid4(), env="toolset", tools=[],
                       messages=[{"role": "user", "content": "Book it."}],
                       verifier=EpisodeSpec(toolset="workplace", toolset_version=1,
                                            answer_contains=["booked"]),
                       failure_mode="incomplete", fingerprint="e", split="train")
    cfg = group_config(Settings(rollout=RolloutSettings()))
    assert (cfg.max_tokens, cfg.episode_max_tokens) == (64, 96)
    assert turn_tokens(episode, cfg) == 96
    assert turn_tokens(_workplace_task(), cfg) == 64
    assert turn_tokens(episode, dataclasses.replace(cfg, max_tokens=128)) == 128
    assert turn_tokens(episode, dataclasses.replace(cfg, episode_max_tokens=None)) == 64
