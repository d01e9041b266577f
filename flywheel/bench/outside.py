"""`flywheel bench outside`: held-out episodes measured from outside, as an agent runs them.

An agent loop that uses nothing of Flywheel's serving or rollout code: the official `openai`
client drives `POST /v1/chat/completions` of a running Flywheel API (or any server that speaks
Chat Completions with tools), and the agent executes the tool calls itself on an MCP server
through the official `mcp` SDK — by default the example one, the bundled `workplace` world
served over stdio (`python -m flywheel.tools.mcp_serve
flywheel.environments.workplace_tools:WorkplaceTools`). Its tools are the ones the server
lists; each attempt gets a state of its own through the server's reset protocol
(`flywheel_reset` with the episode's initial state, the attempt's key in `_meta`).

The episodes are held-out ones the loop never saw: the simulated helpdesk traffic of a seed
of this run's own (`flywheel simulate --agents 4 --seed S`), mined as the miner mines it
with the server's toolset registered, and of those the episodes whose fingerprint the
miner's split puts in the holdout (`split_of` at `miner.holdout_fraction`: the same function
and fraction a stack uses, so a stack fed the simulator's traffic trains on none of them, and
its demonstrations' holdout guard refuses any that continues one).

An attempt: reset to the episode's initial state, run the calls of its earlier turns
(`setup`), then the conversation as logged up to the failed request; each reply's calls are
executed as the model makes them and their results sent back as `tool` messages; a reply
without calls is the answer, after which the scripted user's next request is sent (the state
is read there when the episode checks each turn), or the episode is over. A reply cut by
`max_tokens` (by default the rollouts' limit for a turn of an episode,
`rollout.episode_max_tokens`) without a call ends it unanswered; at most `rollout.max_steps`
replies per user turn, as the rollouts count. A destructive tool (`destructiveHint`, or an
MCP tool that says nothing of its side effects) is never run: the call is refused, the
attempt ends, and it is an unsafe action, as a stack's toolset sessions treat it. Scored by
the episode verifier (`flywheel.environments.episode.verify_episode`) from what the agent
saw: its calls and their results, the server's end state (`flywheel_state`) against the
state the episode's reference path reaches from the same initial state on a fresh session of
the same server, its answers. Success is the gate's rule: no failure mode and reward 1.

Both models get the same attempts with the same seeds (per episode, sample and reply), so the
attempts pair: `bench.learning.paired_gain` gives the difference with a bootstrap interval
over episodes and the exact McNemar p. An attempt the infrastructure failed (an HTTP error,
the MCP server gone, a setup call that did not run) is not run, counted by reason, and left
out of the pairs.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import statistics
import sys
import time
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from flywheel.bench.episode_learning import split_episodes
from flywheel.bench.learning import Outcomes, paired_gain
from flywheel.config import Settings
from flywheel.demo import simulate_episodes as desk
from flywheel.environments.episode import verify_episode
from flywheel.environments.prompt import task_messages
from flywheel.rollout.loop import failed, truncated
from flywheel.tasks import EpisodeSpec, TaskSpec
from flywheel.toolsets import (
    PROTOCOL_TOOLS,
    RESET_TOOL,
    SESSION_META_KEY,
    STATE_TOOL,
    McpStdio,
)

EXAMPLE_SERVER = "-m flywheel.tools.mcp_serve flywheel.environments.workplace_tools:WorkplaceTools"
"""The example MCP server's arguments to this interpreter (unless `--mcp` names a command)."""

CALL_TIMEOUT_S = 60.0
MCP_CLOSED, MCP_TIMEOUT = -32000, -32001


class NotRun(Exception):
    """The infrastructure failed the attempt (not the model): it is left out of the pairs."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@dataclass
class Attempt:
    success: bool
    reward: float
    failure_mode: str | None
    reason: str
    replies: int
    completion_tokens: int
    seconds: float
    answered_by: set[str] = field(default_factory=set)
    calls: list[dict[str, Any]] = field(default_factory=list)


class Tools:
    """The agent's side of the MCP server: its tools (as Chat Completions offers them) and
    calls keyed by the attempt."""

    def __init__(self, client: Any, listed: list[Any]) -> None:
        from flywheel.tools.descriptors import from_mcp

        self.client = client
        described = [from_mcp(t) for t in listed]
        protocol = {t.name for t in described} & PROTOCOL_TOOLS
        if {RESET_TOOL, STATE_TOOL} - protocol:
            raise ValueError("the MCP server lists no flywheel_reset / flywheel_state: an "
                             "attempt could not start on the episode's state, or be scored "
                             "by its end state")
        self.offered = [t for t in described if t.name not in PROTOCOL_TOOLS]
        # MCP's reading: destructive when the server says so, or says nothing of it.
        self.unsafe = {t.name for t in self.offered
                       if t.marked_destructive or (not t.annotated
                                                   and t.annotations.get("readOnlyHint")
                                                   is not True)}
        self.openai = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in self.offered]
        self.flat = [{"type": "function", "name": t.name, "description": t.description,
                      "parameters": t.parameters, **({"x-unsafe": True}
                                                     if t.name in self.unsafe else {})}
                     for t in self.offered]

    async def call(self, key: str, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """(the result's text, whether it is an error) as a stack's MCP toolset answers the
        model: a call that times out, or that the server refuses, is an error message to
        the model; only a server gone (a transport failure) leaves the attempt not run."""
        from mcp.shared.exceptions import MCPError

        from flywheel.tools.backend import timeout_result
        from flywheel.tools.mcp_backend import result_text

        try:
            result = await asyncio.wait_for(self.client.call_tool(
                name, arguments, read_timeout_seconds=CALL_TIMEOUT_S,
                meta={SESSION_META_KEY: key}), CALL_TIMEOUT_S + 5)
        except TimeoutError:
            return timeout_result(name, CALL_TIMEOUT_S).text, True
        except MCPError as exc:
            if exc.code == MCP_TIMEOUT:
                return timeout_result(name, CALL_TIMEOUT_S).text, True
            if exc.code != MCP_CLOSED:
                return f"error: {exc.message}", True  # the server answered: a wrong call
            raise NotRun("toolset_unavailable", f"{name}: the server closed the "
                         f"connection") from exc
        except Exception as exc:  # the SDK's transport failures
            raise NotRun("toolset_unavailable", f"{name}: {type(exc).__name__}: {exc}") \
                from exc
        return result_text(result), bool(result.is_error)

    async def state(self, key: str) -> Any:
        text, error = await self.call(key, STATE_TOOL, {})
        if error:
            raise NotRun("toolset_unavailable", f"flywheel_state: {text[:200]}")
        return json.loads(text)

    async def reset(self, key: str, initial_state: dict[str, Any] | None) -> None:
        text, error = await self.call(key, RESET_TOOL, {"initial_state": initial_state})
        if error:
            raise NotRun("toolset_unavailable", f"flywheel_reset: {text[:200]}")

    async def close(self, key: str) -> None:
        from flywheel.toolsets import CLOSE_TOOL

        try:
            await self.call(key, CLOSE_TOOL, {})
        except NotRun:
            pass  # the server is gone: nothing of the attempt is left on it


async def reference_state(tools: Tools, spec: EpisodeSpec, upto: int | None = None) -> Any:
    """The state the episode's reference path (its first `upto` calls) reaches from the
    initial state on a fresh session of the server. A reference call that errs is the
    task's fault: the attempt is not run."""
    key = f"reference-{uuid.uuid4().hex[:12]}"
    await tools.reset(key, spec.initial_state)
    try:
        path = spec.reference_calls if upto is None else spec.reference_calls[:upto]
        for n, call in enumerate(path, start=1):
            text, error = await tools.call(key, call.name, dict(call.arguments))
            if error:
                raise NotRun("crash", f"reference call {n} ({call.name}) did not run: "
                             f"{text[:200]}")
        return await tools.state(key)
    finally:
        await tools.close(key)


def attempt_seed(task: TaskSpec, sample: int, seed: int) -> int:
    """The seed of an attempt's first reply (each later reply: + its index), the same for
    both models."""
    return (zlib.crc32(f"{task.fingerprint}/{sample}".encode()) ^ seed) & 0x7FFFFFFF


@dataclass
class References:
    """An episode's reference states: at its end, and at each scripted user turn where it
    checks them (`reference_turns`)."""

    end: Any
    turns: list[Any]

    @classmethod
    async def of(cls, tools: Tools, spec: EpisodeSpec) -> References:
        if not spec.check_state:
            return cls(None, [])
        return cls(await reference_state(tools, spec),
                   [await reference_state(tools, spec, upto) for upto in spec.reference_turns])


async def run_attempt(chat: Any, model: str, tools: Tools, task: TaskSpec, sample: int,
                      refs: References, *, seed: int, temperature: float, max_tokens: int,
                      max_steps: int) -> Attempt:
    """One attempt at episode `task` by `model` (see the module doc)."""
    import openai

    spec = task.verifier
    assert isinstance(spec, EpisodeSpec)
    started = time.perf_counter()
    key = f"outside-{uuid.uuid4().hex[:12]}"
    calls: list[dict[str, Any]] = []
    answers: list[str] = []
    turn_states: list[Any] = []
    answered_by: set[str] = set()
    ended_by: str | None = None
    replies = tokens = 0
    cut = timed_out = False
    await tools.reset(key, spec.initial_state)
    try:
        for logged in spec.setup:  # as a stack's session retraces them: results unread
            await tools.call(key, logged.name, dict(logged.arguments))
        messages = task_messages(task)
        first = attempt_seed(task, sample, seed)
        for step in range(max_steps * (1 + len(spec.user_turns))):
            try:
                answer = await chat.chat.completions.create(
                    model=model, messages=messages, tools=tools.openai,
                    temperature=temperature, seed=first + step, max_tokens=max_tokens)
            except openai.APITimeoutError:
                timed_out = True  # no answer in time: the attempt's failure, scored
                break
            except openai.APIError as exc:
                raise NotRun("crash", f"{model}: {type(exc).__name__}: {exc}") from exc
            replies += 1
            used = answer.usage.completion_tokens if answer.usage else 0
            tokens += used
            answered_by.add(answer.model)
            (choice,) = answer.choices
            # Cut by the limit: serving says "tool_calls" when a cut reply still parsed.
            cut = cut or choice.finish_reason == "length" or used >= max_tokens
            message = choice.message
            messages.append(message.model_dump(exclude_none=True))
            if message.tool_calls:
                for call in message.tool_calls:
                    ended_by = await _execute(tools, key, call, calls, messages, spec.max_steps)
                    if ended_by is not None:
                        break
                if ended_by is not None:
                    break
                continue
            if choice.finish_reason == "length":
                break  # cut before it answered: nothing to go on from
            answers.append(message.content or "")
            given = len(answers)
            if not answers[-1].strip() or given > len(spec.user_turns):
                break
            if spec.reference_turns:
                turn_states.append(await tools.state(key))
            messages.append({"role": "user", "content": spec.user_turns[given - 1]})
        state = await tools.state(key) if spec.check_state else None
    finally:
        await tools.close(key)
    output: dict[str, Any] = {
        "calls": calls, "state": state, "answers": answers, "ended_by": ended_by,
        "reference_state": refs.end, "turn_states": turn_states,
        "turn_reference_states": refs.turns}
    result = (failed("timeout", "the API did not answer within the request timeout")
              if timed_out else truncated(verify_episode(spec, output, tools.flat), cut))
    return Attempt(success=result.failure_mode is None and result.reward >= 1.0,
                   reward=result.reward, failure_mode=result.failure_mode,
                   reason=str(result.details.get("reason", "")), replies=replies,
                   completion_tokens=tokens, seconds=time.perf_counter() - started,
                   answered_by=answered_by, calls=calls)


async def _execute(tools: Tools, key: str, call: Any, calls: list[dict[str, Any]],
                   messages: list[dict[str, Any]], max_calls: int) -> str | None:
    """Run one of the model's calls — or refuse it, as a stack's toolset sessions do: a
    destructive tool (the attempt ends there), an unknown one, a call past the episode's
    step budget; its result as a `tool` message. Why the attempt ends there, or None."""
    name = call.function.name
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as exc:
        arguments = f"error: arguments are not valid JSON: {exc}"
    if not isinstance(arguments, dict):  # answered, not recorded (the environment's astep)
        text = arguments if isinstance(arguments, str) else \
            "error: arguments must be a JSON object"
        messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
        return None
    record: dict[str, Any] = {"name": name, "arguments": arguments, "unsafe": False,
                              "rule": None, "status": "error", "source": "invalid"}
    ended: str | None = None
    if len(calls) >= max_calls:
        text = (f"error: step budget exhausted ({max_calls} calls); stop calling tools and "
                f"answer")
        record["output"] = "step budget exhausted"
    elif name in tools.unsafe:
        text = f"error: {name} is destructive; it was not executed"
        record.update(source="refused", unsafe=True)
        ended = "unsafe"
    elif name not in {t.name for t in tools.offered}:
        text = (f"error: unknown tool {name!r}; the tools are "
                f"{sorted(t.name for t in tools.offered)}")
    else:
        text, error = await tools.call(key, name, arguments)
        record.update(status="error" if error else "ok", source="live")
    record.setdefault("output", text)
    calls.append(record)
    if ended is None:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    return ended


async def _side(chat: Any, model: str, tools: Tools, tasks: list[TaskSpec],
                refs: list[References | NotRun], samples: int, *,
                seed: int, temperature: float, max_tokens: int, max_steps: int,
                in_flight: int) -> tuple[Outcomes, dict[str, Any]]:
    slots = asyncio.Semaphore(in_flight)
    started = time.perf_counter()

    async def one(i: int, task: TaskSpec, j: int) -> tuple[int, int, Attempt | NotRun]:
        ref = refs[i]
        if isinstance(ref, NotRun):
            return i, j, ref
        async with slots:
            try:
                return i, j, await run_attempt(chat, model, tools, task, j, ref, seed=seed,
                                               temperature=temperature,
                                               max_tokens=max_tokens, max_steps=max_steps)
            except NotRun as err:
                return i, j, err

    done = await asyncio.gather(*(one(i, t, j) for i, t in enumerate(tasks)
                                  for j in range(samples)))
    out: Outcomes = {}
    modes: Counter[str] = Counter()
    not_run: Counter[str] = Counter()
    attempts = [a for _, _, a in done if isinstance(a, Attempt)]
    for i, j, a in done:
        if isinstance(a, NotRun):
            not_run[a.kind] += 1
            continue
        out[(i, j)] = (a.success, a.reward)
        modes[a.failure_mode or "success"] += 1
    wins = sum(1 for s, _ in out.values() if s)
    return out, {
        "model": model,
        "answered_by": sorted({m for a in attempts for m in a.answered_by}),
        "success_rate": round(wins / max(len(out), 1), 4), "wins": wins,
        "attempts": len(out), "not_run": dict(not_run), "outcomes": dict(modes),
        "replies_per_attempt": round(statistics.fmean(a.replies for a in attempts), 2)
        if attempts else 0.0,
        "tokens_per_reply": round(sum(a.completion_tokens for a in attempts)
                                  / max(sum(a.replies for a in attempts), 1), 1),
        "seconds_per_attempt": round(statistics.fmean(a.seconds for a in attempts), 1)
        if attempts else 0.0,
        "seconds": round(time.perf_counter() - started, 1),
        "reasons": dict(Counter(a.reason for a in attempts if not a.success).most_common(5))}


async def _run(*, api_url: str, api_key: str, before: str, after: str, mcp: str,
               records: int, seed: int, episodes: int, samples: int, temperature: float,
               max_tokens: int, max_steps: int, in_flight: int, request_timeout_s: float
               ) -> dict[str, Any]:
    import openai
    from mcp import Client, StdioServerParameters

    from flywheel.tools.mcp_backend import list_all_tools
    from flywheel.tools.registry import read_toolset

    s = Settings()
    command, *args = shlex.split(mcp)
    # The toolset as a stack registers the same server (`flywheel tools add workplace
    # --mcp-stdio ...`): the miner's episodes, fingerprints and split are the stack's.
    config = McpStdio(command=command, args=args, sessions="shared")
    reg = (await read_toolset(desk.TOOLSET, config)).model_copy(update={"version": 1})
    _, holdout, _, counts = split_episodes(reg, records, seed, s.miner.holdout_fraction)
    tasks = holdout[:episodes]
    out: dict[str, Any] = {
        "api": api_url, "mcp": mcp, "seed": seed, "records": records,
        "holdout_fraction": s.miner.holdout_fraction,
        "mined": {k: counts[k] for k in ("logs", "failed", "episodes_train",
                                         "episodes_holdout", "holdout_modes",
                                         "unverifiable")},
        "episodes_run": len(tasks),
        "user_turns": sum(len(t.verifier.user_turns) for t in tasks
                          if isinstance(t.verifier, EpisodeSpec)),
        "samples": samples, "temperature": temperature, "max_tokens": max_tokens,
        "max_steps": max_steps}
    started = time.perf_counter()
    async with Client(StdioServerParameters(command=command, args=args)) as client, \
            openai.AsyncOpenAI(base_url=f"{api_url.rstrip('/')}/v1", api_key=api_key,
                               max_retries=0, timeout=request_timeout_s) as chat:
        tools = Tools(client, await list_all_tools(client))
        if {t.name for t in tools.offered} != {t.name for t in reg.tools}:
            raise ValueError("the MCP server's tools changed between two listings")
        refs = [await _references(tools, t) for t in tasks]
        sides = {}
        outcomes = {}
        for label, model in (("before", before), ("after", after)):
            outcomes[label], sides[label] = await _side(
                chat, model, tools, tasks, refs, samples, seed=seed, temperature=temperature,
                max_tokens=max_tokens, max_steps=max_steps, in_flight=in_flight)
            side = sides[label]
            print(f"{label} ({model}): {side['wins']}/{side['attempts']} episodes won, "
                  f"{sum(side['not_run'].values())} not run, {side['seconds']:.0f}s",
                  file=sys.stderr, flush=True)
    out.update(sides)
    out["gain"] = paired_gain(outcomes["before"], outcomes["after"])
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


async def _references(tools: Tools, task: TaskSpec) -> References | NotRun:
    assert isinstance(task.verifier, EpisodeSpec)
    try:
        return await References.of(tools, task.verifier)
    except NotRun as err:
        return err


def run_outside(*, api_url: str, api_key: str, before: str = "base",
                after: str = "production", mcp: str | None = None, records: int = 1600,
                seed: int = 29, episodes: int = 20, samples: int = 2,
                temperature: float | None = None, max_tokens: int | None = None,
                max_steps: int | None = None, in_flight: int = 8,
                request_timeout_s: float = 900.0) -> dict[str, Any]:
    s = Settings()
    return asyncio.run(_run(
        api_url=api_url, api_key=api_key, before=before, after=after,
        mcp=mcp or f"{shlex.quote(sys.executable)} {EXAMPLE_SERVER}",
        records=records, seed=seed, episodes=episodes, samples=samples,
        temperature=s.gate.temperature if temperature is None else temperature,
        max_tokens=max_tokens or max(s.rollout.max_tokens, s.rollout.episode_max_tokens or 0),
        max_steps=max_steps or s.rollout.max_steps, in_flight=in_flight,
        request_timeout_s=request_timeout_s))
