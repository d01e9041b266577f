"""`tool_call`: one model turn of tool calls, scored against the calls a person said were right.

Accepted output (`ToolCallEnvironment.verify`):

* an OpenAI-style assistant message `{"role": "assistant", "content", "tool_calls": [...]}`
  as the chat format's response parser returns it — the main path; a parse failure rides
  along as `"parse_error"` (see `calls`);
* a list of calls, or one call as a dict (`{"function": {...}}` or `{"name", "arguments"}`);
* for compatibility, the model's raw text holding one JSON object
  `{"tool": NAME, "arguments": {...}}` (`parse_tool_call`): `"name"` may stand for `"tool"`,
  `arguments` may be a JSON-encoded string, a missing `arguments` means `{}`, one Markdown
  fence and surrounding whitespace are fine, text *after* the object is ignored and
  reported in `details["trailing_text"]`, anything before it is `invalid_format`.

The calls compare with `spec.expected` as a multiset (`scoring`), arguments strictly by the
tool's JSON schema (`matching`). Reward = 0.1·valid_json + 0.3·right_tool + 0.6·arguments;
success ⇔ reward 1.0 ⇔ exactly the expected calls; unparseable output is `invalid_format`,
no output at all (no text, no call) is `empty` — both reward 0;
a call to an unsafe tool scores 0 with `unsafe_action`. docs/VERIFIER.md has the rules and
how they compare with BFCL's AST checker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flywheel.environments.base import (
    AnySpec,
    Environment,
    ToolSchemas,
    abstained,
    expect_spec,
    result,
)
from flywheel.environments.calls import Call, EmptyOutput, MalformedOutput, output_calls
from flywheel.environments.prompt import InvalidCall, parse_tool_call
from flywheel.environments.scoring import WEIGHTS, check_spec, verify_calls
from flywheel.tasks import ToolCallSpec, VerifierResult

__all__ = ["WEIGHTS", "InvalidCall", "ToolCallEnvironment", "parse_tool_call", "verify_calls",
           "verify_output", "verify_tool_call"]
_ZERO = dict.fromkeys((*WEIGHTS, "unsafe"), 0.0)


def verify_tool_call(spec: ToolCallSpec, output: str,
                     tools: ToolSchemas | None = None) -> VerifierResult:
    """Score the model's raw text (one JSON call); `tools` type the argument comparison.

    Without `tools`, names cannot be checked against the offered tools (a wrong name is
    `wrong_tool`, never `hallucinated_tool`) and arguments compare by their JSON types.
    """
    check_spec(spec, tools)
    if not output.strip():
        return abstained(_ZERO, "the attempt produced no text to parse as a tool call")
    try:
        name, args, trailing = parse_tool_call(output)
    except InvalidCall as exc:
        return result(0.0, _ZERO, "invalid_format", error=str(exc))
    extra = {"trailing_text": trailing[:200]} if trailing else {}
    return verify_calls(spec, [Call(name, args)], tools, **extra)


def verify_output(spec: ToolCallSpec, output: object,
                  tools: ToolSchemas | None = None) -> VerifierResult:
    """Score any accepted output (see the module doc): message, calls, one call, or text."""
    if output is None:
        check_spec(spec, tools)
        return abstained(_ZERO, "the attempt produced no output")
    if isinstance(output, str):
        return verify_tool_call(spec, output, tools)
    if not isinstance(output, Mapping | Sequence):
        raise TypeError(f"tool_call scores an assistant message, a list of calls, a call dict "
                        f"or the model's raw text, got {type(output).__name__}")
    check_spec(spec, tools)
    text = output.get("content") if isinstance(output, Mapping) else None
    extra = {"text": text[:200]} if isinstance(text, str) and text.strip() else {}
    try:
        calls = output_calls(output)
    except EmptyOutput as exc:
        return abstained(_ZERO, str(exc))
    except MalformedOutput as exc:
        return result(0.0, _ZERO, "invalid_format", error=str(exc), **extra)
    return verify_calls(spec, calls, tools, **extra)


class ToolCallEnvironment(Environment):
    """Single-step: the output is the model's turn at the failing decision."""

    name = "tool_call"
    reads = "message"

    def verify(self, spec: AnySpec, output: object, *,
               tools: ToolSchemas | None = None) -> VerifierResult:
        return verify_output(expect_spec(spec, ToolCallSpec, self.name), output, tools)
