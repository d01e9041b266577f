"""The agent loop: sample a group of G attempts at a task and score each with its verifier.

A task is put to the policy as its messages and tools, rendered by the policy's chat format,
with no prefill and no stop rule but the end-of-turn token — exactly what serving does — and
each reply is parsed by the same format into an OpenAI assistant message.

Single-step environments (tool_call, code) sample the whole group in one batched call; the
verifier gets the parsed message (tool_call) or the reply's text (code, judge).
Multi-step environments (workplace) run G episodes — the model's `tool_calls` are executed by
the environment and their results appended as `tool` messages (`tool_call_id`), the next turn
rendered by the same format; a reply without tool calls (a final answer, or one that could not
be parsed) ends the episode, as it ends an agent's turn in production — unless the
environment has a next user message for it (`anext_user`: an episode task's scripted user),
which is appended after the answer and the episode goes on; the user's words are prompt,
never sampled, so never trained on. Each turn records the
exact prompt ids it was sampled after. Each episode runs under its own deadline, so one
straggler cannot hold the group; in lockstep (below) the deadline counts the episode's own
time, not its queueing for the engine. On a toolset (`flywheel.environments.toolset`) a call may
end the episode (the replay rule `end`, a destructive call refused) and says where its
answer came from (replay, live, a stub; the replay rule that fired): kept on the turn as
`Turn.tools`. A toolset the infrastructure failed (its server died) leaves the attempt not
run; a bad call by the model is a tool error message and the episode goes on.

Every attempt the model made is scored (`score`): an empty reply is `empty`, an unreadable one
`invalid_format`, sampling past the deadline `timeout`, and a reply cut by `max_tokens`
(`finish_reason` "length", as both engines report it) that did not succeed is `truncated`
— all reward 0, so GRPO pushes them down like any other failure and the gate counts them.
A truncated reply the verifier fully accepts stays a success: what was served holds the
right calls. Only the infrastructure failing (the engine erroring, a hung verifier, a judge
or sandbox unavailable) leaves an attempt not run.

With an engine that batches several prompts (`sample_many`, the in-process CPU engine) the
live episodes advance in lockstep, one batched generate per turn, because separate calls
would only queue on the same model; environment steps still run per episode under their own
deadlines. Other engines (vLLM batches concurrent requests itself) run the episodes
independently.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

from flywheel.environments.base import Environment
from flywheel.environments.prompt import task_messages, task_tools
from flywheel.events import TOOL_OUTPUT_CHARS, ScoredRollout, ToolStep, Turn
from flywheel.policy.base import AdapterRef, Completion, Policy, PolicyError, SamplingParams
from flywheel.policy.chat_format import ChatFormat
from flywheel.tasks import (
    AttemptFailure,
    EpisodeSpec,
    RolloutNotRun,
    TaskSpec,
    ToolsetSpec,
    VerifierResult,
)


@dataclass(frozen=True)
class GroupConfig:
    group_size: int = 8
    max_tokens: int = 64
    episode_max_tokens: int | None = None
    """At least this many tokens per turn for a task on a toolset (`RolloutSettings`)."""
    temperature: float = 1.0
    max_steps: int = 8
    rollout_timeout_s: float = 120.0
    min_scored: int = 2


@dataclass(frozen=True)
class GroupOutcome:
    rollouts: list[ScoredRollout]
    reward_mean: float | None
    reward_std: float | None
    success_rate: float | None
    trainable: bool
    duration_ms: float

    @property
    def scored(self) -> list[ScoredRollout]:
        return [r for r in self.rollouts if r.reward is not None]


def _turn(c: Completion) -> Turn:
    return Turn(prompt_token_ids=c.prompt_token_ids, token_ids=c.token_ids,
                logprobs=c.logprobs, text=c.text, finish_reason=c.finish_reason)


def failed(mode: AttemptFailure, why: str) -> VerifierResult:
    """A scored failure the verifier never saw (a timeout): reward 0."""
    return VerifierResult(reward=0.0, reward_components={}, failure_mode=mode,
                          details={"error": why})


def score(result: VerifierResult, turns: list[Turn]) -> VerifierResult:
    """`result`, or `truncated` (reward 0) when a turn hit `max_tokens` and it did not
    succeed (nor ran out of time, nor called an unsafe tool — that stays the unsafe action
    it was, whatever was cut after it): the reply was cut, not answered."""
    return truncated(result, any(t.finish_reason == "length" for t in turns))


def truncated(result: VerifierResult, cut: bool) -> VerifierResult:
    """`score`'s rule, given whether a turn of the attempt was cut by `max_tokens`."""
    success = result.failure_mode is None and result.reward >= 1.0
    if success or result.failure_mode in ("timeout", "unsafe_action") or not cut:
        return result
    return VerifierResult(reward=0.0, reward_components=result.reward_components,
                          failure_mode="truncated",
                          details={**result.details, "cut_mode": result.failure_mode})


def _scored(index: int, result: VerifierResult | RolloutNotRun, turns: list[Turn],
            started: float) -> ScoredRollout:
    latency = (time.perf_counter() - started) * 1000
    if isinstance(result, VerifierResult):
        result = score(result, turns)
    if isinstance(result, RolloutNotRun):
        return ScoredRollout(index=index, reward=None, reward_components={}, failure_mode=None,
                             not_run=result.kind, turns=turns, latency_ms=latency)
    reason = result.details.get("reason")
    return ScoredRollout(index=index, reward=result.reward,
                         reward_components=result.reward_components,
                         failure_mode=result.failure_mode, not_run=None, turns=turns,
                         latency_ms=latency, reason=reason if isinstance(reason, str) else None)


async def _verify(env: Environment, task: TaskSpec, output: Any,
                  timeout: float) -> VerifierResult | RolloutNotRun:
    try:
        return await asyncio.wait_for(asyncio.to_thread(env.verify_task, task, output), timeout)
    except RolloutNotRun as err:
        return err
    except TimeoutError:
        return RolloutNotRun("verifier_timeout", f"verifier did not finish in {timeout:.0f}s")


@dataclass(frozen=True)
class _Prompt:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def _params(cfg: GroupConfig, n: int, seed: int) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=seed)


def _read(env: Environment, fmt: ChatFormat, c: Completion) -> Any:
    return fmt.parse(c.text) if env.reads == "message" else c.text


async def _single_step(policy: Policy, task: TaskSpec, env: Environment, prompt: _Prompt,
                       cfg: GroupConfig, adapter: AdapterRef | None, seed: int
                       ) -> list[ScoredRollout]:
    started = time.perf_counter()
    try:
        completions = await asyncio.wait_for(
            policy.sample(prompt.messages, _params(cfg, cfg.group_size, seed),
                          tools=prompt.tools, adapter=adapter), cfg.rollout_timeout_s)
    except TimeoutError:
        late = failed("timeout", f"sampling exceeded {cfg.rollout_timeout_s:.0f}s")
        return [_scored(i, late, [], started) for i in range(cfg.group_size)]
    except PolicyError as err:
        crash = RolloutNotRun("crash", str(err))
        return [_scored(i, crash, [], started) for i in range(cfg.group_size)]
    fmt = policy.chat_format
    results = await asyncio.gather(*(
        _verify(env, task, _read(env, fmt, c), cfg.rollout_timeout_s) for c in completions))
    return [_scored(i, r, [_turn(c)], started)
            for i, (c, r) in enumerate(zip(completions, results, strict=True))]


def _arguments(call: dict[str, Any]) -> dict[str, Any]:
    """A parsed call's arguments (the format guarantees a JSON object string)."""
    args = json.loads(call["function"]["arguments"])
    assert isinstance(args, dict)
    return args


@dataclass
class _Acted:
    messages: list[dict[str, Any]]
    steps: list[ToolStep]
    ended: bool


async def _run_calls(env: Environment, session: str, reply: dict[str, Any],
                     timeout: float) -> _Acted:
    """Execute the reply's calls in order; their results as `tool` messages. A call the
    environment ends the episode at stops there (the calls after it are not run)."""
    acted = _Acted([], [], False)
    for call in reply["tool_calls"]:
        step = await asyncio.wait_for(
            env.astep(session, call["function"]["name"], _arguments(call)),
            max(timeout, 0.001))
        if step.record is not None:
            acted.steps.append(step.record.model_copy(
                update={"output": step.observation[:TOOL_OUTPUT_CHARS]}))
        if step.end:
            acted.ended = True
            break
        acted.messages.append({"role": "tool", "tool_call_id": call["id"],
                               "content": step.observation})
    return acted


def _with_steps(turns: list[Turn], steps: list[ToolStep]) -> None:
    """Keep on the last turn where its calls' answers came from (toolset episodes)."""
    if steps:
        turns[-1] = turns[-1].model_copy(update={"tools": steps})


def _reply(fmt: ChatFormat, c: Completion, step: int) -> dict[str, Any] | None:
    """The parsed reply when it calls tools (the episode goes on), else None (it ends)."""
    reply = fmt.parse(c.text, id_prefix=f"call_{step}_")
    return reply if reply["tool_calls"] else None


async def _next_user(env: Environment, session: str, fmt: ChatFormat, c: Completion
                     ) -> list[dict[str, Any]] | None:
    """A reply without calls is the agent's answer: the environment's next user message
    after it (an episode task's scripted user) as the messages to go on with, or None when
    the episode is over. A reply cut by `max_tokens` is no answer to go on from."""
    if c.finish_reason == "length":
        return None
    answer = fmt.parse(c.text).get("content") or ""
    user = await env.anext_user(session, answer)
    if user is None:
        return None
    return [{"role": "assistant", "content": answer}, {"role": "user", "content": user}]


async def _output(env: Environment, task: TaskSpec, session: str,
                  timeout: float) -> VerifierResult | RolloutNotRun:
    try:
        output = await asyncio.wait_for(env.asession_output(session), max(timeout, 1.0))
    except RolloutNotRun as err:
        return err
    except TimeoutError:
        return RolloutNotRun("verifier_timeout", "the session's output (its end state) "
                             f"was not read within {timeout:.0f}s")
    return await _verify(env, task, output, max(timeout, 1.0))


async def _episode(policy: Policy, task: TaskSpec, env: Environment, prompt: _Prompt,
                   cfg: GroupConfig, adapter: AdapterRef | None, seed: int, index: int,
                   session_id: str, turns: list[Turn]) -> VerifierResult | RolloutNotRun:
    (opened,) = await env.aopen([session_id], task.verifier)
    if opened is not None:
        return opened
    try:
        messages = list(prompt.messages)
        for step in range(cfg.max_steps):
            try:
                (c,) = await policy.sample(messages, _params(cfg, 1, seed + 1000 * index + step),
                                           tools=prompt.tools, adapter=adapter)
            except PolicyError as err:
                return RolloutNotRun("crash", str(err))
            turns.append(_turn(c))
            reply = _reply(policy.chat_format, c, step)
            if reply is None:
                more = await _next_user(env, session_id, policy.chat_format, c)
                if more is None:
                    break
                messages += more
                continue
            try:
                acted = await _run_calls(env, session_id, reply, cfg.rollout_timeout_s)
            except RolloutNotRun as err:
                return err
            _with_steps(turns, acted.steps)
            messages += [reply, *acted.messages]
            if acted.ended:
                break
        return await _output(env, task, session_id, cfg.rollout_timeout_s)
    finally:
        await env.aclose(session_id)


class _Episode:
    def __init__(self, index: int, session: str, messages: list[dict[str, Any]]) -> None:
        self.index, self.session, self.messages = index, session, messages
        self.turns: list[Turn] = []
        self.result: VerifierResult | RolloutNotRun | None = None
        self.finished = False
        self.started = time.perf_counter()


async def _answered(env: Environment, ep: _Episode, fmt: ChatFormat, c: Completion,
                    timeout: float) -> None:
    """The episode's answer: it goes on with the next user message, or it is over."""
    try:
        more = await asyncio.wait_for(_next_user(env, ep.session, fmt, c), max(timeout, 0.001))
    except TimeoutError:
        ep.result = failed("timeout", "the episode ran past the rollout deadline")
        return
    if more is None:
        ep.finished = True
    else:
        ep.messages += more


async def _act(env: Environment, ep: _Episode, reply: dict[str, Any], timeout: float) -> None:
    """Run the episode's tool calls; a step that overruns the deadline ends the episode, one
    the infrastructure failed leaves it not run."""
    try:
        acted = await _run_calls(env, ep.session, reply, timeout)
    except TimeoutError:
        ep.result = failed("timeout", "the episode ran past the rollout deadline")
        return
    except RolloutNotRun as err:
        ep.result = err
        return
    _with_steps(ep.turns, acted.steps)
    ep.messages += [reply, *acted.messages]
    ep.finished = acted.ended


def own_seconds(c: Completion, waited_s: float) -> float:
    """The time a completion took the engine itself: the forward passes its row was in
    (`extra["batch_ms"]`, the local engine's), not its wait behind other requests; an
    engine that does not say (vLLM schedules its own queue) is charged the whole wait."""
    ms = c.extra.get("batch_ms")
    return float(ms) / 1000 if isinstance(ms, int | float) else waited_s


async def _charged(spent: dict[int, float], index: int, step: Any) -> None:
    """Run `step` (an episode's tool calls, its next user turn) and charge its time."""
    started = time.perf_counter()
    try:
        await step
    finally:
        spent[index] += time.perf_counter() - started


async def _lockstep(policy: Any, task: TaskSpec, env: Environment, prompt: _Prompt,
                    cfg: GroupConfig, adapter: AdapterRef | None, seed: int, group_key: str
                    ) -> list[ScoredRollout]:
    """The group's episodes, one batched generate per turn. Each attempt's deadline counts
    its own time: the engine's forward passes its rows were in, its tool calls and its
    environment's turns — not the time it waited for the engine behind other requests (a
    gate round puts every task's episodes on one CPU engine, and on 2 cores half of a
    candidate's episodes ran past a wall-clock deadline that counted that wait; how much of
    it was waiting was not measured). Any one wait (a batched sample, a step) is still
    bounded by `rollout_timeout_s`, so a hung engine or toolset ends the attempts."""
    budget = cfg.rollout_timeout_s
    eps = [_Episode(i, f"{group_key}/{i}", list(prompt.messages))
           for i in range(cfg.group_size)]
    opened = await env.aopen([e.session for e in eps], task.verifier)
    for ep, err in zip(eps, opened, strict=True):
        ep.result = err
    # Waiting for a toolset's session slots is the infrastructure's time, not the model's.
    spent = {e.index: 0.0 for e in eps}
    try:
        for step in range(cfg.max_steps):
            live = [e for e in eps if e.result is None and not e.finished]
            if not live:
                break
            started = time.perf_counter()
            try:
                batches = await asyncio.wait_for(
                    policy.sample_many([e.messages for e in live], _params(cfg, 1, seed + step),
                                       tools=prompt.tools, adapter=adapter), budget)
            except TimeoutError:
                for e in live:
                    e.result = failed("timeout", "sampling exceeded the rollout deadline")
                break
            except PolicyError as err:
                for e in live:
                    e.result = RolloutNotRun("crash", str(err))
                break
            waited = time.perf_counter() - started
            acting = []
            for e, (c,) in zip(live, batches, strict=True):
                e.turns.append(_turn(c))
                spent[e.index] += own_seconds(c, waited)
                left = budget - spent[e.index]
                if left <= 0:
                    e.result = failed("timeout", f"the episode's own time (generation and "
                                      f"tool calls) passed the {budget:.0f}s deadline")
                    continue
                reply = _reply(policy.chat_format, c, step)
                if reply is None:
                    acting.append(_charged(spent, e.index, _answered(
                        env, e, policy.chat_format, c, left)))
                else:
                    acting.append(_charged(spent, e.index, _act(env, e, reply, left)))
            await asyncio.gather(*acting)
        for e in eps:
            if e.result is None:
                # Reading the end state is the infrastructure's time: the whole bound.
                e.result = await _output(env, task, e.session, budget)
    finally:
        for e in eps:
            if opened[e.index] is None:
                await env.aclose(e.session)
    return [_scored(e.index, e.result, e.turns, e.started)  # type: ignore[arg-type]
            for e in eps]


async def _multi_step(policy: Policy, task: TaskSpec, env: Environment, prompt: _Prompt,
                      cfg: GroupConfig, adapter: AdapterRef | None, seed: int, group_key: str
                      ) -> list[ScoredRollout]:
    if callable(getattr(policy, "sample_many", None)):
        return await _lockstep(policy, task, env, prompt, cfg, adapter, seed, group_key)

    async def guarded(i: int) -> ScoredRollout:
        started = time.perf_counter()
        turns: list[Turn] = []
        try:
            result = await asyncio.wait_for(
                _episode(policy, task, env, prompt, cfg, adapter, seed, i, f"{group_key}/{i}",
                         turns), cfg.rollout_timeout_s)
        except TimeoutError:
            result = failed("timeout", f"episode exceeded {cfg.rollout_timeout_s:.0f}s")
        return _scored(i, result, turns, started)

    return list(await asyncio.gather(*(guarded(i) for i in range(cfg.group_size))))


def turn_tokens(task: TaskSpec, cfg: GroupConfig) -> int:
    """The token limit of a turn of `task`: `episode_max_tokens` on a registered toolset
    when it is more than `max_tokens`."""
    if isinstance(task.verifier, EpisodeSpec | ToolsetSpec) and cfg.episode_max_tokens:
        return max(cfg.max_tokens, cfg.episode_max_tokens)
    return cfg.max_tokens


async def run_group(policy: Policy, task: TaskSpec, env: Environment, cfg: GroupConfig, *,
                    adapter: AdapterRef | None, seed: int, group_key: str) -> GroupOutcome:
    started = time.perf_counter()
    prompt = _Prompt(task_messages(task), task_tools(task))
    cfg = replace(cfg, max_tokens=turn_tokens(task, cfg))
    if isinstance(task.verifier, EpisodeSpec) and task.verifier.user_turns:
        # `max_steps` model turns for each user turn: the scripted user's included.
        cfg = replace(cfg, max_steps=cfg.max_steps * (1 + len(task.verifier.user_turns)))
    if env.multi_step:
        rollouts = await _multi_step(policy, task, env, prompt, cfg, adapter, seed, group_key)
    else:
        rollouts = await _single_step(policy, task, env, prompt, cfg, adapter, seed)
    return summarize(rollouts, cfg.min_scored, (time.perf_counter() - started) * 1000)


def summarize(rollouts: list[ScoredRollout], min_scored: int, duration_ms: float
              ) -> GroupOutcome:
    """Group statistics; zero-variance or too-small groups carry no GRPO signal."""
    rewards = [r.reward for r in rollouts if r.reward is not None]
    if not rewards:
        return GroupOutcome(rollouts, None, None, None, False, duration_ms)
    std = statistics.pstdev(rewards) if len(rewards) > 1 else 0.0
    success = sum(1 for r in rollouts if r.reward is not None and r.failure_mode is None
                  and r.reward >= 1.0) / len(rewards)
    return GroupOutcome(rollouts, statistics.fmean(rewards), std, success,
                        len(rewards) >= min_scored and std > 0, duration_ms)
