"""How a task is put to the policy (its messages and tools, through the policy's chat
format), and the legacy one-JSON-object call format some stored outputs still use.

Rollouts, the gate and SFT send a task's own messages and tools: the policy's chat template
renders the tools, the instruction and one example call per tool (so serving renders exactly
the same prompt), and no prefill or stop rule other than the end-of-turn token applies. Only
`code` tasks get a task-level instruction, as a system message (`CODE_INSTRUCTION`): their
answer is a fenced code block the verifier extracts.

`parse_tool_call` reads the old `{"tool": NAME, "arguments": {...}}` text format; the
tool_call verifier still accepts it for outputs scored from text (`flywheel verify check`).
"""

from __future__ import annotations

import json
from typing import Any

from flywheel.tasks import CodeSpec, TaskSpec


def code_instruction(entrypoint: str | None) -> str:
    return ("Write Python code that solves the request"
            + (f" by defining `{entrypoint}`" if entrypoint else "")
            + ". Reply with only the code in one ```python block.")


def task_messages(task: TaskSpec) -> list[dict[str, Any]]:
    """The chat messages a task is put to the policy with (its tools go separately)."""
    messages = [dict(m) for m in task.messages]
    if not isinstance(task.verifier, CodeSpec):
        return messages
    instruction = code_instruction(task.verifier.entrypoint)
    system = [m["content"] for m in messages
              if m["role"] == "system" and isinstance(m.get("content"), str)]
    rest = [m for m in messages if m["role"] != "system"]
    return [{"role": "system", "content": "\n".join([*system, instruction])}, *rest]


def task_tools(task: TaskSpec) -> list[dict[str, Any]] | None:
    """The tools a task offers, None when it offers none (templates render `[]` for some)."""
    return [dict(t) for t in task.tools] or None


class InvalidCall(ValueError):
    """The output is not one JSON tool call; the message says what is wrong."""


def _unfence(text: str) -> str:
    if not text.startswith("```"):
        return text
    body = text.split("\n", 1)[1] if "\n" in text else ""
    close = body.find("```")
    return (body if close < 0 else body[:close]).strip()


def parse_tool_call(text: str) -> tuple[str, dict[str, Any], str]:
    """(tool name, arguments, trailing text) of the call in `text`, or InvalidCall."""
    body = _unfence(text.strip())
    if not body.startswith("{"):
        raise InvalidCall("output must start with a JSON object like "
                          '{"tool": "name", "arguments": {...}}')
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as exc:
        raise InvalidCall(f"not valid JSON: {exc}") from None
    name = obj.get("tool", obj.get("name"))
    if not isinstance(name, str) or not name.strip():
        raise InvalidCall('the object needs a string "tool" (or "name") naming the tool')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise InvalidCall(f'"arguments" is a string but not JSON: {exc}') from None
    if not isinstance(args, dict):
        raise InvalidCall(f'"arguments" must be a JSON object, got {type(args).__name__}')
    return name.strip(), args, body[end:].strip()
