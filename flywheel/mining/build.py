"""Task builder (pure): a classified failure → a verifiable task, or a reason it is not.

The expected action comes, in order of trust, from a human correction
(`outcome.human_intervention.corrected_items`), structured feedback
(`outcome.feedback = {"expected_call": …}`), or a later successful retry of the same request
in the same session. A failure with no way to verify is `Unverifiable` — never guessed.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from flywheel.mining.classify import Classification, parse_arguments
from flywheel.schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    Trajectory,
)
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


def calls_of(t: Trajectory) -> list[ExpectedCall] | None:
    """The function calls a (successful) trajectory made, or None if any is malformed."""
    out = []
    for item in t.items:
        if isinstance(item, FunctionCallItem):
            args = parse_arguments(item.arguments)
            if args is None:
                return None
            out.append(ExpectedCall(name=item.name, arguments=args))
    return out


def expected_calls(t: Trajectory, retry: Trajectory | None = None
                   ) -> tuple[list[ExpectedCall], str] | None:
    """(expected calls, where they came from), or None when the trajectory does not show them."""
    hi = t.outcome.human_intervention
    if hi is not None and hi.corrected_items:
        calls = [ExpectedCall(name=i.name, arguments=parse_arguments(i.arguments) or {})
                 for i in hi.corrected_items if isinstance(i, FunctionCallItem)]
        if calls:
            return calls, "human_correction"
    if t.outcome.feedback:
        try:
            fb = json.loads(t.outcome.feedback)
        except json.JSONDecodeError:
            fb = None
        if isinstance(fb, dict) and isinstance(fb.get("expected_call"), dict):
            try:
                return [ExpectedCall.model_validate(fb["expected_call"])], "feedback"
            except ValidationError:
                pass  # malformed feedback is no evidence of the expected action
    if retry is not None and retry.outcome.status == "success":
        retried = calls_of(retry)
        if retried:
            return retried, f"retry:{retry.trajectory_id}"
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
                        "verifier": verifier.model_dump(mode="json")}, sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()


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
        found = expected_calls(t, retry)
        if found is None:
            return Unverifiable("no expected action: no human correction, structured feedback "
                                "or successful retry in the session")
        calls, _source = found
        if env == "workplace":
            assert isinstance(env_meta, dict)
            initial = env_meta.get("initial_state")
            if not isinstance(initial, dict):
                return Unverifiable("workplace trajectory without metadata.environment."
                                    "initial_state")
            from flywheel.environments.workplace import apply_calls

            try:
                expected_state = apply_calls(initial, [c.model_dump() for c in calls],
                                             strict=True)
            except ValueError as err:
                return Unverifiable(f"the expected actions do not apply to the initial state: "
                                    f"{err}")
            messages = to_messages(t.items[:start])
            verifier = WorkplaceSpec(initial_state=initial, expected_state=expected_state,
                                     max_steps=max(8, 2 * len(calls)), unsafe_tools=unsafe)
        elif env == "tool_call":
            call_steps = [n for n, i in enumerate(t.items) if isinstance(i, FunctionCallItem)]
            k = call_steps.index(c.step) if c.step in call_steps else 0
            if k >= len(calls):
                return Unverifiable(f"the failing call #{k + 1} has no expected counterpart")
            cut = call_steps[k] if k < len(call_steps) else start
            messages = to_messages(t.items[:cut])
            verifier = ToolCallSpec(expected=calls[k], unsafe_tools=unsafe)
        else:
            return Unverifiable(f"unknown environment {env!r}")
    if not any(m["role"] == "user" for m in messages):
        return Unverifiable("no user request before the failing decision")
    return new_task(env, messages, tools, verifier, failure_mode=c.mode,
                    holdout_fraction=holdout_fraction)
