"""Task builder (pure): a classified failure → a verifiable task, or a reason it is not.

The expected action comes from a human correction, structured feedback or a later
successful retry (`mining.expected`). A failure with no way to verify is `Unverifiable` —
never guessed. A `tool_call` task is one turn: the failed decision is the trajectory's turn
(consecutive calls) holding the failing call, and the task expects the evidence's calls for
that turn — all of them, compared as a multiset. Evidence with known turns (a retry, a
correction listing tool results) gives its turn of the same index; a plain list of calls
(feedback, a calls-only correction) gives what is left after the calls the trajectory made
in its earlier turns. A task whose own expected calls would not score 1.0 (a correction
that breaks its tool's schema, names a tool not offered or an unsafe one) is unverifiable.

A conversation of several user requests (and no blamed call with known turn boundaries) is
placed by the whole path instead: the failed request is the one whose calls differ from
the path while every other request's calls are the path's (those before it its start, those
after it its end), so what lies between is that request's; where several requests fit, the
one left the fewest path calls (a request that answered "done" without its call, with the
path's calls of the other requests all made, is that request, not the next). Within it,
the decision is the first turn off that part (or its answer, when it stopped early), and
the task expects the rest of the part (with known boundaries, its turn). When no request
fits, or two fit equally, the failure is unverifiable: a path without turn boundaries does
not say which request the missing calls belonged to, and the calls of later requests are
never expected of an earlier one. A conversation that made every expected call in order
failed in no call: unverifiable as a tool_call task.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from flywheel.environments.calls import Call
from flywheel.environments.scoring import verify_calls
from flywheel.mining.classify import Classification, decision_start, parse_arguments
from flywheel.mining.expected import Expected, call_turns, expected_actions, expected_calls
from flywheel.tasks import (
    CodeSpec,
    ExpectedCall,
    FailureMode,
    Split,
    TaskSpec,
    ToolCallSpec,
    VerifierSpec,
    WorkplaceSpec,
)
from flywheel.trajectory import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    Trajectory,
)

__all__ = ["Unverifiable", "build_task", "expected_calls", "fingerprint", "new_task",
           "request_key", "split_of", "to_messages", "tool_specs"]
TASK_ID_NAMESPACE = uuid.UUID("9a3c5e1f-2b4d-4f6a-8c7e-1d2f3a4b5c6d")
_WS = re.compile(r"\s+")


@dataclass(frozen=True)
class Unverifiable:
    reason: str


def _norm(text: str) -> str:
    return _WS.sub(" ", text).strip().lower()


def request_key(t: Trajectory) -> str | None:
    """The normalized first user request: a retry of the same request has the same key."""
    for item in t.items:
        if isinstance(item, MessageItem) and item.role == "user" and isinstance(item.content, str):
            return hashlib.sha256(_norm(item.content).encode()).hexdigest()[:32]
    return None


def to_messages(items: list[Any]) -> list[dict[str, Any]]:
    """v1 items → Chat Completions messages (consecutive calls share one assistant turn)."""
    msgs: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            msgs.append({"role": item.role, "content": item.content})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            msgs.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return msgs


def _first_action(t: Trajectory) -> int:
    for n, item in enumerate(t.items):
        if isinstance(item, FunctionCallItem) or (
                isinstance(item, MessageItem) and item.role == "assistant"):
            return n
    return len(t.items)


def fingerprint(env: str, messages: list[dict[str, Any]], tools: list[str],
                verifier: VerifierSpec) -> str:
    """Normalized identity of a task: near-identical failures collapse onto one task."""
    texts = [[m["role"], _norm(m["content"]) if isinstance(m.get("content"), str) else
              json.dumps(m.get("tool_calls") or m.get("content"), sort_keys=True)]
             for m in messages]
    canon = json.dumps({"env": env, "messages": texts, "tools": sorted(tools),
                        "verifier": _identity(verifier)}, sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()


def _identity(verifier: VerifierSpec) -> dict[str, Any]:
    """The verifier as the fingerprint sees it. A tool_call task expecting one call with no
    alternatives keeps the one-object shape it was stored in before several calls were
    possible, so its fingerprint (and task id) did not change; several calls are sorted,
    since their order does not matter."""
    dump = verifier.model_dump(mode="json")
    if isinstance(verifier, ToolCallSpec):
        calls = [{"name": c.name, "arguments": c.arguments} if c.plain
                 else c.model_dump(mode="json") for c in verifier.expected]
        dump["expected"] = calls[0] if len(calls) == 1 else sorted(
            calls, key=lambda c: json.dumps(c, sort_keys=True))
    return dump


def split_of(fp: str, holdout_fraction: float) -> Split:
    """Deterministic from the fingerprint: the same task always lands on the same side."""
    return "holdout" if int(fp[:8], 16) / 0x1_0000_0000 < holdout_fraction else "train"


def environment_name(t: Trajectory) -> str:
    """The environment a trajectory ran in (`metadata.environment.name`; tool_call if unset)."""
    meta = t.metadata.get("environment")
    return str(meta.get("name", "tool_call")) if isinstance(meta, dict) else "tool_call"


def tool_specs(t: Trajectory) -> tuple[list[dict[str, Any]], list[str]]:
    """The trajectory's tools as a task stores them, and the names marked unsafe."""
    tools = [tool.model_dump(mode="json", exclude_none=True) for tool in t.tools]
    return tools, sorted(d["name"] for d in tools if d.get("x-unsafe"))


def new_task(env: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
             verifier: VerifierSpec, *, failure_mode: FailureMode,
             holdout_fraction: float) -> TaskSpec:
    """The task with its fingerprint, the id derived from it, and its split."""
    fp = fingerprint(env, messages, [d["name"] for d in tools], verifier)
    return TaskSpec(task_id=uuid.uuid5(TASK_ID_NAMESPACE, fp), env=env, messages=messages,
                    tools=tools, verifier=verifier, failure_mode=failure_mode, fingerprint=fp,
                    split=split_of(fp, holdout_fraction))


def _tool_call_turn(t: Trajectory, c: Classification, found: Expected,
                    tools: list[dict[str, Any]], unsafe: list[str]
                    ) -> tuple[list[dict[str, Any]], ToolCallSpec] | Unverifiable:
    """The context before the failing turn and the calls expected for it (module doc)."""
    turns = call_turns(t.items)
    start = decision_start(t)
    users = [n for n, i in enumerate(t.items) if isinstance(i, MessageItem) and i.role == "user"]
    if start == 0 and len(users) >= 2 and (c.step is None or not found.explicit):
        located = _conversation_decision(t, users, turns, found)
        if isinstance(located, Unverifiable):
            return located
        end, want = located
    else:
        first = next((n for n, turn in enumerate(turns) if turn[0] >= start), len(turns))
        j = next((n for n, turn in enumerate(turns) if c.step in turn), first)
        if found.explicit:
            want = list(found.turns[j]) if j < len(found.turns) else []
        else:
            want = found.calls[sum(len(turn) for turn in turns[:j]):]
        if not want:
            return Unverifiable(f"the failing turn #{j + 1} has no expected counterpart")
        end = turns[j][0] if j < len(turns) else max(_first_action(t), start)
    verifier = ToolCallSpec(expected=want, unsafe_tools=unsafe)
    broken = _self_check(verifier, tools)
    if broken:
        return Unverifiable(broken)
    return to_messages(t.items[:end]), verifier


def _is_answer(item: Any) -> bool:
    return isinstance(item, MessageItem) and item.role == "assistant"


def _conversation_decision(t: Trajectory, users: list[int], turns: list[list[int]],
                           found: Expected) -> tuple[int, list[ExpectedCall]] | Unverifiable:
    """(item index of the failed decision, the calls expected there) of a conversation of
    several requests, placed by the whole path (module doc), or why it cannot be."""
    def call(n: int) -> tuple[str, Any]:
        item = t.items[n]
        assert isinstance(item, FunctionCallItem)
        return item.name, parse_arguments(item.arguments)

    path = [(e.name, e.arguments) for e in found.calls]
    bounds = [0, *users[1:], len(t.items)]  # calls before the first request count in it
    requests = [[[call(n) for n in turn] for turn in turns if lo <= turn[0] < hi]
                for lo, hi in itertools.pairwise(bounds)]
    flat = [[c for group in groups for c in group] for groups in requests]
    if [c for r in flat for c in r] == path:
        return Unverifiable("every expected call was made, in order: what failed is not a call "
                            "(a tool_call task cannot check an answer)")
    fits = []
    for k in range(len(requests)):
        head = [c for r in flat[:k] for c in r]
        tail = [c for r in flat[k + 1:] for c in r]
        if (len(head) + len(tail) <= len(path) and path[:len(head)] == head
                and path[len(path) - len(tail):] == tail
                and flat[k] != path[len(head):len(path) - len(tail)]):
            fits.append((k, len(head), len(path) - len(tail)))
    # Where several fit, the one the fewest path calls are left to (every other request's
    # calls taken as the path's wherever they can be); a tie is not placed.
    tightest = [f for f in fits if f[2] - f[1] == min((b - a for _, a, b in fits), default=0)]
    if len(tightest) != 1:
        which = " and ".join(f"#{k + 1}" for k, _, _ in tightest) or "none"
        return Unverifiable(f"the expected calls do not place the failure in one of the "
                            f"{len(users)} user requests (requests that fit equally: {which}); "
                            "a later request's calls are never expected of an earlier one")
    k, lo, hi = tightest[0]
    part = path[lo:hi]
    at, end = 0, None
    for turn, group in zip((x for x in turns if bounds[k] <= x[0] < bounds[k + 1]),
                           requests[k], strict=True):
        if part[at:at + len(group)] != group:
            end = turn[0]
            break
        at += len(group)
    if end is None:  # every call of the request was the path's: it stopped short
        after = max([bounds[k] - 1, *(x[-1] for x in turns if bounds[k] <= x[0] < bounds[k + 1])])
        end = next((n for n in range(after + 1, bounds[k + 1])
                    if _is_answer(t.items[n])), None)
        if end is None:
            return Unverifiable(f"request #{k + 1} stopped short of its expected calls "
                                "without an answer to put the decision at")
    want = found.calls[lo + at:hi]
    if found.explicit:  # the turn that starts there (or the rest of the one it is inside)
        offset = 0
        for turn_calls in found.turns:
            if offset + len(turn_calls) > lo + at:
                want = list(turn_calls[lo + at - offset:])
                break
            offset += len(turn_calls)
    if not want:
        return Unverifiable(f"request #{k + 1} made calls past its expected ones; a tool_call "
                            "task cannot expect an answer without a call")
    return end, want


def _self_check(verifier: ToolCallSpec, tools: list[dict[str, Any]]) -> str | None:
    """Why the task's own expected calls would not score 1.0, or None when they do."""
    reference = [Call(c.name, c.arguments) for c in verifier.expected]
    try:
        r = verify_calls(verifier, reference, tools or None)  # no tools logged: no names
    except ValueError as err:
        return str(err)
    if r.reward == 1.0:
        return None
    why = r.details.get("mismatches") or r.details.get("missing_calls") or r.details
    return (f"the expected calls fail their own check ({r.failure_mode}: {why}); the "
            f"correction does not fit the tools the agent was offered")


def build_task(t: Trajectory, c: Classification, *, retry: Trajectory | None = None,
               holdout_fraction: float = 0.2) -> TaskSpec | Unverifiable:
    env_meta = t.metadata.get("environment")
    env = environment_name(t)
    tools, unsafe = tool_specs(t)
    start = _first_action(t)
    verifier: VerifierSpec
    if env == "code":
        assert isinstance(env_meta, dict)
        if not isinstance(env_meta.get("tests"), str) or not env_meta["tests"].strip():
            return Unverifiable("code task without tests")
        messages = to_messages(t.items[:start])
        entry = env_meta.get("entrypoint")
        verifier = CodeSpec(tests=env_meta["tests"],
                            entrypoint=entry if isinstance(entry, str) else None)
    else:
        found = expected_actions(t, retry)
        if found is None:
            return Unverifiable("no expected action: no human correction, structured feedback "
                                "or successful retry in the session")
        if env == "workplace":
            assert isinstance(env_meta, dict)
            initial = env_meta.get("initial_state")
            if not isinstance(initial, dict):
                return Unverifiable("workplace trajectory without metadata.environment."
                                    "initial_state")
            from flywheel.environments.workplace import apply_calls

            try:
                expected_state = apply_calls(
                    initial, [{"name": c.name, "arguments": c.arguments} for c in found.calls],
                    strict=True)
            except ValueError as err:
                return Unverifiable(f"the expected actions do not apply to the initial state: "
                                    f"{err}")
            messages = to_messages(t.items[:start])
            verifier = WorkplaceSpec(initial_state=initial, expected_state=expected_state,
                                     max_steps=max(8, 2 * len(found.calls)), unsafe_tools=unsafe)
        elif env == "tool_call":
            built = _tool_call_turn(t, c, found, tools, unsafe)
            if isinstance(built, Unverifiable):
                return built
            messages, verifier = built
        else:
            return Unverifiable(f"unknown environment {env!r}")
    if not any(m["role"] == "user" for m in messages):
        return Unverifiable("no user request before the failing decision")
    return new_task(env, messages, tools, verifier, failure_mode=c.mode,
                    holdout_fraction=holdout_fraction)
