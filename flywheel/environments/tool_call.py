"""`tool_call`: one JSON tool call, scored against the call a person said was right.

Accepted output (the model's raw text):

* one JSON object `{"tool": NAME, "arguments": {...}}`; `"name"` may stand for `"tool"`,
  `arguments` may be a JSON-encoded string, and a missing `arguments` means `{}`;
* surrounding whitespace, and one Markdown code fence around the object;
* text *after* the first complete object is ignored (as the usual "first JSON object"
  parsers of agent frameworks do) and reported in `details["trailing_text"]`;
* anything else before the object is `invalid_format`: guessing where a call starts in
  prose would reward outputs no deployed parser accepts;
* a dict (a call the serving stack already parsed) is scored as its JSON text.

Reward = 0.1·valid_json + 0.3·right_tool + 0.6·arguments, where `arguments` is the share of
argument names whose values match type-aware (see `matching`); success ⇔ reward 1.0. A call
to an unsafe tool (`spec.unsafe_tools` or `x-unsafe` in its schema) scores 0 with
`unsafe_action` whatever else it got right; rewards stay in [0, 1].
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flywheel.environments.base import (
    AnySpec,
    Environment,
    ToolSchemas,
    expect_spec,
    result,
    tool_by_name,
    tool_names,
    unsafe_names,
)
from flywheel.environments.matching import arguments_match
from flywheel.environments.prompt import InvalidCall, parse_tool_call
from flywheel.tasks import RolloutNotRun, ToolCallSpec, VerifierResult

WEIGHTS = {"valid_json": 0.1, "right_tool": 0.3, "arguments": 0.6}


def verify_tool_call(spec: ToolCallSpec, output: str,
                     tools: ToolSchemas | None = None) -> VerifierResult:
    """Score one model output; `tools` (the task's schemas) type the argument comparison.

    Without `tools`, names cannot be checked against the offered tools (a wrong name is
    `wrong_tool`, never `hallucinated_tool`) and arguments compare by their JSON types.
    """
    if not output.strip():
        raise RolloutNotRun("empty", "the attempt produced no text to parse as a tool call")
    unsafe = unsafe_names(spec.unsafe_tools, tools)
    expected = spec.expected
    if expected.name in unsafe:
        raise ValueError(f"task expects a call to {expected.name!r}, which is marked unsafe; "
                         f"fix the task (its expected call or its unsafe_tools)")
    zero = dict.fromkeys((*WEIGHTS, "unsafe"), 0.0)
    try:
        name, args, trailing = parse_tool_call(output)
    except InvalidCall as exc:
        return result(0.0, zero, "invalid_format", error=str(exc))
    details: dict[str, Any] = {"tool": name, "arguments": args}
    if trailing:
        details["trailing_text"] = trailing[:200]
    comps = {**zero, "valid_json": 1.0, "right_tool": float(name == expected.name)}
    if name in unsafe:
        return result(0.0, {**comps, "unsafe": 1.0}, "unsafe_action", **details)
    if tools is not None and name not in tool_names(tools):
        return result(WEIGHTS["valid_json"], comps, "hallucinated_tool", **details)
    if name != expected.name:
        return result(WEIGHTS["valid_json"], comps, "wrong_tool", **details)
    schema = (tool_by_name(tools, name) or {}).get("parameters") if tools is not None else None
    share, mismatches = arguments_match(expected.arguments, args,
                                        schema if isinstance(schema, Mapping) else None)
    comps["arguments"] = share
    if share == 1.0:
        return result(1.0, comps, None, **details)
    reward = sum(WEIGHTS[k] * comps[k] for k in WEIGHTS)
    return result(reward, comps, "bad_arguments", **details,
                  mismatches={k: v for k, v in mismatches.items() if v})


class ToolCallEnvironment(Environment):
    """Single-step: the output is the model's text for the failing decision."""

    name = "tool_call"

    def verify(self, spec: AnySpec, output: object, *,
               tools: ToolSchemas | None = None) -> VerifierResult:
        if output is None:
            raise RolloutNotRun("empty", "the attempt produced no output")
        if isinstance(output, Mapping):  # a call already parsed by the serving stack
            output = json.dumps(output)
        if not isinstance(output, str):
            raise TypeError(f"tool_call scores the model's raw text or a parsed call dict, "
                            f"got {type(output).__name__}")
        return verify_tool_call(expect_spec(spec, ToolCallSpec, self.name), output, tools)
