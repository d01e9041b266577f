"""Demonstrations from whole episodes (pure): every assistant turn of a right path on a
registered toolset, each put to the policy after exactly the conversation before it.

An episode's right path is shown by

* a success the agent logged: a multi-step trajectory whose toolset is registered
  (`mining.episodes.registered_toolset`): every assistant turn from the first user message
  on — its calls, or its final answer — is one demonstration;
* a failure corrected with the whole path: `outcome.human_intervention.corrected_items`
  giving the calls *with their tool results* (and, if it likes, the final answer) from the
  failed user turn on — an episode task was mined from it (`EpisodeSpec`), and its prompt
  is the conversation up to that turn. A correction that lists calls without results shows
  no more than its first turn (what the next turn would be sent after is unknown); one of
  an episode with a scripted user must hold the later user messages where they came, as
  the conversation had them (else it shows none).

Each demonstration's prompt is the messages before the turn — user messages of later turns
included, tool results as `tool` messages — with the toolset's tools; the reply is the
assistant message SFT trains on. A path through a tool the toolset does not offer, a
destructive tool, or arguments that are not a JSON object gives none. The fingerprint is
the episode's conversation key (`episode_key`: environment, prompt and tools), shared by the
episode's turns; the holdout filter (`mining.demos.HeldOut`) also refuses the episode's
source trajectories and (session, request).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flywheel.mining.build import to_messages
from flywheel.mining.classify import parse_arguments
from flywheel.mining.episodes import ENV, multi_step, registered_toolset, toolset_tools
from flywheel.mining.verify import assistant_message
from flywheel.tasks import EpisodeSpec, TaskSpec
from flywheel.tools.descriptors import Registration
from flywheel.trajectory import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    Trajectory,
)


@dataclass(frozen=True)
class TurnDemo:
    """One assistant turn of a right path: `mining.demos` makes it a `Demonstration`."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    reply: dict[str, Any]
    source_trajectory_id: uuid.UUID
    fingerprint: str


def assistant_reply(calls: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """An assistant message making `calls`, arguments as JSON strings (as `mining.demos`)."""
    return assistant_message([(name, json.dumps(args, ensure_ascii=False))
                              for name, args in calls])


def conversation_key(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> str:
    """What a prompt shows the policy, whatever session logged it: roles, texts, the calls
    made (names and parsed arguments) and the tool names — not the call ids, which every
    session draws anew. Two prompts with the same key are the same question to the policy
    (the holdout guard of episode demonstrations, `mining.demos.HeldOut`)."""
    def call(c: dict[str, Any]) -> list[Any]:
        fn = c.get("function") or {}
        raw = fn.get("arguments")
        args = parse_arguments(raw) if isinstance(raw, str) else raw
        return [fn.get("name"), raw if args is None else args]

    body = [[m.get("role"), " ".join(str(m.get("content") or "").split()),
             [call(c) for c in m.get("tool_calls") or []]] for m in messages]
    canon = {"messages": body, "tools": sorted(str(t.get("name")) for t in tools)}
    return hashlib.sha256(json.dumps(canon, sort_keys=True, default=str).encode()).hexdigest()


def episode_key(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> str:
    """The identity of an episode's opening: environment, prompt messages and tool names."""
    body = {"env": ENV, "messages": list(messages),
            "tools": sorted(str(t.get("name")) for t in tools)}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _safe(tools: Sequence[dict[str, Any]]) -> set[str]:
    return {str(t["name"]) for t in tools if not t.get("x-unsafe")}


def path_demonstrations(prompt: list[dict[str, Any]], path: Sequence[Any],
                        tools: list[dict[str, Any]], source: uuid.UUID
                        ) -> list[TurnDemo]:
    """One demonstration per assistant turn of `path` (trajectory items after `prompt`);
    none when the path calls an unsafe or unknown tool."""
    safe = _safe(tools)
    outputs = {i.call_id: i for i in path if isinstance(i, FunctionCallOutputItem)}
    fp = episode_key(prompt, tools)
    messages = [dict(m) for m in prompt]
    out: list[TurnDemo] = []
    pending: list[FunctionCallItem] = []

    def flush() -> bool:
        """The pending call turn as a demonstration; False when the path cannot go on."""
        calls = []
        for item in pending:
            args = parse_arguments(item.arguments)
            if args is None or item.name not in safe:
                raise _Refused
            calls.append((item.name, args))
        reply = assistant_reply(calls)
        out.append(TurnDemo(list(messages), tools, reply, source, fp))
        answered = [outputs.get(item.call_id) for item in pending]
        messages.append(reply)
        messages.extend({"role": "tool", "tool_call_id": call["id"], "content": res.output}
                        for call, res in zip(reply["tool_calls"], answered, strict=True)
                        if res is not None)
        pending.clear()
        return all(res is not None for res in answered)

    try:
        for item in path:
            if isinstance(item, FunctionCallItem):
                pending.append(item)
                continue
            if pending and not flush():
                return out
            if isinstance(item, MessageItem) and isinstance(item.content, str):
                if item.role == "assistant" and item.content.strip():
                    reply = {"role": "assistant", "content": item.content}
                    out.append(TurnDemo(list(messages), tools, reply, source, fp))
                    messages.append(reply)
                elif item.role == "user":
                    messages.append({"role": "user", "content": item.content})
        if pending:
            flush()
    except _Refused:
        return []
    return out


class _Refused(Exception):
    """The path calls a tool no demonstration may teach."""


def success_episode_demonstrations(t: Trajectory, registrations: Sequence[Registration]
                                   ) -> list[TurnDemo] | None:
    """A logged multi-step success on a registered toolset, turn by turn (an empty list when
    its path may not be taught); None when it is no such episode."""
    if not t.is_success or not multi_step(t):
        return None
    reg = registered_toolset(t, registrations)
    if not isinstance(reg, Registration):
        return None
    first = next((n for n, i in enumerate(t.items)
                  if isinstance(i, MessageItem) and i.role == "user"), None)
    if first is None:
        return []
    return path_demonstrations(to_messages(t.items[:first + 1]), t.items[first + 1:],
                               toolset_tools(reg), t.trajectory_id)


def corrected_episode_demonstrations(task: TaskSpec, t: Trajectory) -> list[TurnDemo]:
    """The whole right path a person gave for episode task `task` (mined from `t`)."""
    if not isinstance(task.verifier, EpisodeSpec) or t.outcome is None:
        return []
    hi = t.outcome.human_intervention
    if hi is None or not any(isinstance(i, FunctionCallItem) for i in hi.corrected_items):
        return []
    users = [i for i in hi.corrected_items if isinstance(i, MessageItem) and i.role == "user"]
    if [u.content for u in users] != task.verifier.user_turns:
        return []  # the path would not be the conversation the episode puts to the policy
    return path_demonstrations([dict(m) for m in task.messages],
                               _after_setup(hi.corrected_items, task.verifier),
                               [dict(x) for x in task.tools], t.trajectory_id)


def _after_setup(items: Sequence[Any], spec: EpisodeSpec) -> list[Any]:
    """A correction of the whole conversation without the earlier turns' calls (already in
    the prompt); a correction from the failed turn on as it is."""
    calls = [i for i in items if isinstance(i, FunctionCallItem)][:len(spec.setup)]
    same = len(calls) == len(spec.setup) and all(
        c.name == s.name and parse_arguments(c.arguments) == s.arguments
        for c, s in zip(calls, spec.setup, strict=True))
    if not spec.setup or not same:
        return list(items)
    ids = {c.call_id for c in calls}
    return [i for i in items if not (isinstance(i, FunctionCallItem | FunctionCallOutputItem)
                                     and i.call_id in ids)]
