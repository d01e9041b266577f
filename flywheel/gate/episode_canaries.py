"""Verifier canaries for episode tasks (`EpisodeSpec` on env `toolset`, and hand-built
`ToolsetSpec` tasks: `spec_canaries`): whole episodes whose right score is known, scored by
the very episode verifier the candidate is judged by.

An episode's output is what the `toolset` environment's `asession_output` gives (calls with
their sources, the end state and the reference end state, the answers). A canary builds one
by hand: the end state is the reference (`REFERENCE`) where the canary's calls would reach
it, another state (`ELSEWHERE`) where they would not — the verifier compares the two it is
given, so the canary checks the verifier's judgement, not the toolset. The right path is
the spec's reference path (or its required calls). Kinds:

* `reference` — the right path, every user turn answered, the required answer content and
  tool results there: must succeed;
* `stopped_early` — the path without its last call, the answer without its content;
* `stopped_before_user_turn` — the right path, but no answer after the last scripted user
  message (only with a scripted user);
* `wrong_tool` — another offered tool in place of the path's first call;
* `wrong_arguments` — the path's first call with every argument wrong;
* `destructive_call` — the right path, then a destructive tool, refused (must be unsafe);
* `unsafe_path` — the right end state reached through a destructive call that ran (a
  toolset that allows it live): must be unsafe, whatever the state;
* `loop_to_budget` — the right path, then its first call again until past the step budget;
* `empty` — no call, an empty answer.
"""

from __future__ import annotations

import copy
from typing import Any

from flywheel.environments.base import tool_names, unsafe_names
from flywheel.gate.canary_base import Canary, wrong_value
from flywheel.tasks import EpisodeSpec, ExpectedCall, TaskSpec, ToolsetSpec

REFERENCE: dict[str, Any] = {"canary": "the reference end state"}
ELSEWHERE: dict[str, Any] = {"canary": "another end state"}


def _call(name: str, arguments: dict[str, Any], output: str = "ok", *, source: str = "live",
          unsafe: bool = False) -> dict[str, Any]:
    return {"name": name, "arguments": copy.deepcopy(arguments), "output": output,
            "source": source, "status": "error" if source == "refused" else "ok",
            "unsafe": unsafe, "rule": None}


def _path(spec: EpisodeSpec) -> list[ExpectedCall]:
    return list(spec.reference_calls) if spec.check_state else list(spec.required_calls)


def _output(spec: EpisodeSpec, calls: list[dict[str, Any]], *, at_reference: bool,
            answers: list[str] | None = None, ended_by: str | None = None) -> dict[str, Any]:
    # The setup calls are the conversation's earlier turns: the session ran them, the
    # agent did not, so they are no calls of the episode.
    return {"calls": calls, "state": copy.deepcopy(REFERENCE if at_reference else ELSEWHERE),
            "reference_state": copy.deepcopy(REFERENCE),
            "answers": answers if answers is not None else _answers(spec),
            "ended_by": ended_by}


def _answers(spec: EpisodeSpec, content: bool = True) -> list[str]:
    final = " ".join(spec.answer_contains) if content and spec.answer_contains else "Done."
    return [*("Done." for _ in spec.user_turns), final]


def _right(spec: EpisodeSpec, lookup: str) -> list[dict[str, Any]]:
    """The path's calls (after the setup), the expected results among their outputs (a
    call to `lookup` gives them when the path has none)."""
    skip = len(spec.setup) if spec.check_state else 0
    calls = [_call(c.name, c.arguments) for c in _path(spec)[skip:]]
    results = "\n".join(spec.expected_results)
    if results:
        calls = calls or [_call(lookup, {})]
        calls[0]["output"] = f"{calls[0]['output']}\n{results}"
    return calls


def _wrong_paths(right: list[dict[str, Any]], others: list[str]
                 ) -> dict[str, list[dict[str, Any]]]:
    """The right path with its first call made to another offered tool (`wrong_tool`) and,
    when that call has arguments, with every one wrong (`wrong_arguments`)."""
    first = right[0]
    paths = {"wrong_tool": [_call(others[0] if others else "no_such_tool",
                                  first["arguments"]), *right[1:]]}
    if first["arguments"]:
        args = {k: wrong_value(v, [v]) for k, v in first["arguments"].items()}
        paths["wrong_arguments"] = [_call(first["name"], args), *right[1:]]
    return paths


def _looped(right: list[dict[str, Any]], max_steps: int) -> list[dict[str, Any]]:
    """The right path, then its first call again until one past the step budget."""
    first = right[0]
    return [*right, *(_call(first["name"], first["arguments"])
                      for _ in range(max_steps - len(right) + 1))]


def _unsafe_paths(right: list[dict[str, Any]], tool: str
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the right path then `tool` refused, `tool` run then the right path)."""
    refused = _call(tool, {}, "error: not executed", source="refused", unsafe=True)
    return [*right, refused], [_call(tool, {}, "done"), *right]


def episode_canaries(task: TaskSpec) -> list[Canary]:
    spec = task.verifier
    assert isinstance(spec, EpisodeSpec)
    unsafe = sorted(unsafe_names(spec.unsafe_tools, task.tools))
    safe = sorted(tool_names(task.tools) - set(unsafe))
    right = _right(spec, safe[0] if safe else "lookup")
    moved = spec.check_state and bool(right)  # the right calls change the state
    others = sorted(set(safe) - {c["name"] for c in right})
    out = [Canary(task, "reference", "success", _output(spec, right, at_reference=True)),
           Canary(task, "empty", "failure",
                  _output(spec, [], at_reference=not moved, answers=[""]))]
    if right:
        short = [_call(c["name"], c["arguments"]) for c in right[:-1]]
        out.append(Canary(task, "stopped_early", "failure", _output(
            spec, short, at_reference=False, answers=_answers(spec, content=False))))
    if spec.user_turns:
        out.append(Canary(task, "stopped_before_user_turn", "failure", _output(
            spec, right, at_reference=True, answers=_answers(spec)[:-1])))
    if right and (moved or spec.required_calls):
        out += [Canary(task, kind, "failure", _output(spec, calls, at_reference=False))
                for kind, calls in _wrong_paths(right, others).items()]
    if right:
        out.append(Canary(task, "loop_to_budget", "failure",
                          _output(spec, _looped(right, spec.max_steps), at_reference=True)))
    if unsafe:
        refused, ran = _unsafe_paths(right, unsafe[0])
        out.append(Canary(task, "destructive_call", "unsafe", _output(
            spec, refused, at_reference=not moved, ended_by="unsafe")))
        out.append(Canary(task, "unsafe_path", "unsafe",
                          _output(spec, ran, at_reference=True)))
    return out


def spec_canaries(task: TaskSpec) -> list[Canary]:
    """Canaries of a hand-built `ToolsetSpec` task, scored by `verify_toolset`: it compares
    the episode's end state with the spec's `expected_state` (so the canary's state is that
    one where its calls would reach it, another otherwise) and counts `expected_calls`.
    Kinds as for episodes, less the answers' (a `ToolsetSpec` checks no answer):
    `reference`, `empty`, `stopped_early`, `wrong_tool`, `wrong_arguments`,
    `loop_to_budget`, `destructive_call`, `unsafe_path`."""
    spec = task.verifier
    assert isinstance(spec, ToolsetSpec)
    unsafe = sorted(unsafe_names(spec.unsafe_tools, task.tools))
    safe = sorted(tool_names(task.tools) - set(unsafe))
    right = [_call(c.name, c.arguments) for c in spec.expected_calls]
    there = copy.deepcopy(spec.expected_state)
    elsewhere = None if there is None else {**ELSEWHERE, "differs_from": copy.deepcopy(there)}

    def out(calls: list[dict[str, Any]], *, at_expected: bool,
            ended_by: str | None = None) -> dict[str, Any]:
        return {"calls": calls, "state": copy.deepcopy(there if at_expected else elsewhere),
                "ended_by": ended_by}

    found = [Canary(task, "reference", "success", out(right, at_expected=True)),
             Canary(task, "empty", "failure", out([], at_expected=False))]
    if right:
        found.append(Canary(task, "stopped_early", "failure",
                            out(right[:-1], at_expected=False, ended_by="end")))
        others = sorted(set(safe) - {c["name"] for c in right})
        found += [Canary(task, kind, "failure", out(calls, at_expected=False))
                  for kind, calls in _wrong_paths(right, others).items()]
        found.append(Canary(task, "loop_to_budget", "failure",
                            out(_looped(right, spec.max_steps), at_expected=True)))
    if unsafe:
        refused, ran = _unsafe_paths(right, unsafe[0])
        found.append(Canary(task, "destructive_call", "unsafe",
                            out(refused, at_expected=False, ended_by="unsafe")))
        found.append(Canary(task, "unsafe_path", "unsafe", out(ran, at_expected=True)))
    return found


def toolset_canaries(task: TaskSpec) -> list[Canary]:
    """Canaries of a `toolset` task: its episode verifier's (`EpisodeSpec`, mined) or
    `verify_toolset`'s (a hand-built `ToolsetSpec`)."""
    if isinstance(task.verifier, EpisodeSpec):
        return episode_canaries(task)
    return spec_canaries(task) if isinstance(task.verifier, ToolsetSpec) else []
