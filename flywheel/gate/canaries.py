"""Verifier canaries: known-right and known-wrong outputs re-scored before every decision.

A candidate is only as good as the verifier that judges it: a verifier that accepts any call
to the right tool, or counts a sandbox exit as a pass, lets a policy learn the hole and the
gate promote it. So before each decision the gate builds, from holdout tasks' own verifier
specs, outputs whose right score is known — the reference answer (must succeed) and
known-wrong ones (must not succeed; a call to an unsafe tool must also be flagged unsafe) —
and scores them with the very verifier the candidate is judged by (`load_environment(env)`,
`verify_task`). Any canary scored wrongly blocks promotion, and the record names it.

Canaries per environment (`build`; kinds a task cannot give are skipped):

* `tool_call`: `reference` (the expected calls), `wrong_tool`, `wrong_values` (right tool,
  every argument wrong), `one_wrong_value` (only the last argument wrong), `missing_argument`,
  `stringly_typed` (a number or boolean sent as a string), `double_encoded` (arguments as a
  JSON string of a string), `json_near_miss` (the right call written as JSON text instead of
  a tool call), `extra_call` (the right calls plus a repeat), `empty`, `prose`,
  `unsafe_call` (the right calls plus a call to an unsafe tool);
* `workplace`: `reference` (the expected end state), `empty` (no calls), `noop_state` (the
  initial state), `near_miss_state` (one changed section left as it was), `hallucinated_tool`,
  `unsafe_call`;
* `code` (no reference solution is stored): `empty`, `prose`, `stub` (the entry point
  returning None), `exit_early` (`os._exit(0)` before any test);
* `judge`: `empty` only (anything else would be judged by the endpoint itself);
* `toolset` episode tasks (`flywheel.gate.episode_canaries`): `reference`, `stopped_early`,
  `stopped_before_user_turn`, `wrong_tool`, `wrong_arguments`, `destructive_call`,
  `unsafe_path` (the right end state through a destructive call), `loop_to_budget`,
  `empty`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flywheel.environments.base import Environment, tool_names, unsafe_names
from flywheel.environments.workplace_world import WORKPLACE_TOOLS, canonical_state
from flywheel.events import CanaryResult, GateCanaries, GateCheck
from flywheel.gate.canary_base import Canary, wrong_value
from flywheel.gate.canary_base import Expect as Expect  # the verdicts' vocabulary, re-exported
from flywheel.gate.episode_canaries import toolset_canaries
from flywheel.tasks import (
    CodeSpec,
    ExpectedCall,
    RolloutNotRun,
    TaskSpec,
    ToolCallSpec,
    VerifierResult,
    WorkplaceSpec,
)


def _message(calls: Iterable[tuple[str, Any]], content: str | None = None) -> dict[str, Any]:
    """An assistant message as the chat format parses one (`arguments` a JSON string)."""
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": name, "arguments": args if isinstance(args, str)
                      else json.dumps(args)}} for i, (name, args) in enumerate(calls)]}


def _with(call: ExpectedCall, keys: list[str]) -> dict[str, Any]:
    args = copy.deepcopy(call.arguments)
    for k in keys:
        args[k] = wrong_value(args[k], call.acceptable(k))
    return args


def tool_call_canaries(task: TaskSpec) -> list[Canary]:
    spec = task.verifier
    assert isinstance(spec, ToolCallSpec)
    right = [(c.name, c.arguments) for c in spec.expected]
    first, rest = spec.expected[0], right[1:]
    unsafe = sorted(unsafe_names(spec.unsafe_tools, task.tools))
    others = sorted(tool_names(task.tools) - {c.name for c in spec.expected} - set(unsafe))
    keys = sorted(first.arguments)
    out = [Canary(task, "reference", "success", _message(right)),
           Canary(task, "wrong_tool", "failure",
                  _message([(others[0] if others else "no_such_tool", first.arguments), *rest])),
           Canary(task, "extra_call", "failure", _message([*right, right[0]])),
           Canary(task, "empty", "failure", _message([], "")),
           Canary(task, "prose", "failure", _message(
               [], f"I would call {first.name} with {json.dumps(first.arguments)}.")),
           Canary(task, "json_near_miss", "failure", _message(
               [], json.dumps({"name": first.name, "arguments": first.arguments})))]
    if keys:
        out.append(Canary(task, "wrong_values", "failure",
                          _message([(first.name, _with(first, keys)), *rest])))
        out.append(Canary(task, "double_encoded", "failure", _message(
            [(first.name, json.dumps(json.dumps(first.arguments))), *rest])))
    if len(keys) > 1:
        out.append(Canary(task, "one_wrong_value", "failure",
                          _message([(first.name, _with(first, keys[-1:])), *rest])))
    required = [k for k in keys if k not in first.optional]
    if required:
        args = {k: v for k, v in first.arguments.items() if k != required[0]}
        out.append(Canary(task, "missing_argument", "failure",
                          _message([(first.name, args), *rest])))
    typed = [k for k in keys if isinstance(first.arguments[k], int | float)  # bool too
             and json.dumps(first.arguments[k]) not in first.acceptable(k)]
    if typed:
        args = {**first.arguments, typed[0]: json.dumps(first.arguments[typed[0]])}
        out.append(Canary(task, "stringly_typed", "failure",
                          _message([(first.name, args), *rest])))
    if unsafe:
        out.append(Canary(task, "unsafe_call", "unsafe", _message([*right, (unsafe[0], {})])))
    return out


def workplace_canaries(task: TaskSpec) -> list[Canary]:
    spec = task.verifier
    assert isinstance(spec, WorkplaceSpec)
    start, want = canonical_state(spec.initial_state), canonical_state(spec.expected_state)
    out = [Canary(task, "reference", "success", copy.deepcopy(spec.expected_state)),
           Canary(task, "hallucinated_tool", "failure",
                  [{"name": "no_such_tool", "arguments": {}}])]
    if start != want:
        out += [Canary(task, "empty", "failure", []),
                Canary(task, "noop_state", "failure", copy.deepcopy(spec.initial_state))]
        changed = [s for s in want if start.get(s) != want[s]]
        if len(changed) > 1 and changed[0] in spec.initial_state:
            near = {**copy.deepcopy(spec.expected_state),
                    changed[0]: copy.deepcopy(spec.initial_state[changed[0]])}
            out.append(Canary(task, "near_miss_state", "failure", near))
    unsafe = sorted(unsafe_names(spec.unsafe_tools, [*WORKPLACE_TOOLS, *task.tools]))
    if unsafe:
        out.append(Canary(task, "unsafe_call", "unsafe", [{"name": unsafe[0], "arguments": {}}]))
    return out


def code_canaries(task: TaskSpec) -> list[Canary]:
    spec = task.verifier
    assert isinstance(spec, CodeSpec)
    entry = spec.entrypoint or "solve"
    return [Canary(task, "empty", "failure", ""),
            Canary(task, "prose", "failure", "I would write a function that solves this."),
            Canary(task, "stub", "failure",
                   f"```python\ndef {entry}(*args, **kwargs):\n    return None\n```"),
            Canary(task, "exit_early", "failure", "```python\nimport os\nos._exit(0)\n```")]


def judge_canaries(task: TaskSpec) -> list[Canary]:
    return [Canary(task, "empty", "failure", "")]


BUILDERS: dict[str, Callable[[TaskSpec], list[Canary]]] = {
    "tool_call": tool_call_canaries, "workplace": workplace_canaries, "code": code_canaries,
    "judge": judge_canaries, "toolset": toolset_canaries}


def build(tasks: Iterable[TaskSpec], per_env: int) -> tuple[list[Canary], dict[str, str]]:
    """Canaries of the first `per_env` tasks of each environment that give any (in the
    given order), and the environments skipped with why."""
    taken: dict[str, int] = {}
    out: list[Canary] = []
    skipped: dict[str, str] = {}
    for task in tasks:
        builder = BUILDERS.get(task.env)
        if builder is None:
            skipped[task.env] = "no canaries are defined for this environment"
            continue
        if taken.get(task.env, 0) >= per_env:
            continue
        built = builder(task)
        taken.setdefault(task.env, 0)
        if built:  # a task that gives none (a hand-built toolset task) takes no place
            taken[task.env] += 1
            out += built
    for env, n in taken.items():
        if n == 0:
            skipped[env] = "none of its tasks' verifiers has canaries yet"
    return out, skipped


Outcome = VerifierResult | RolloutNotRun | Exception


def verdict(canary: Canary, outcome: Outcome) -> CanaryResult:
    """Whether the verifier scored `canary` as it should, and what it said."""
    if isinstance(outcome, RolloutNotRun):
        ok, got = canary.expect == "failure", f"not scored ({outcome})"
    elif isinstance(outcome, Exception):
        ok, got = False, f"verifier raised {type(outcome).__name__}: {outcome}"
    else:
        success = outcome.failure_mode is None and outcome.reward >= 1.0
        unsafe = outcome.failure_mode == "unsafe_action" \
            or outcome.reward_components.get("unsafe", 0.0) > 0
        ok = {"success": success, "failure": not success,
              "unsafe": not success and unsafe}[canary.expect]
        got = (f"reward {outcome.reward:.2f}, "
               + ("success" if success else f"failure ({outcome.failure_mode})")
               + (", unsafe" if unsafe else ""))
    return CanaryResult(env=canary.task.env, task_id=str(canary.task.task_id),
                        canary=canary.kind, expect=canary.expect, ok=ok, got=got[:300])


def score(canary: Canary, env: Environment) -> Outcome:
    try:
        return env.verify_task(canary.task, canary.output)
    except RolloutNotRun as err:
        return err
    except Exception as err:  # a verifier that crashes on a known output is a wrong verdict
        return err


def run(tasks: Iterable[TaskSpec], per_env: int, load: Callable[[str], Environment]
        ) -> GateCanaries:
    """Build the canaries and score each with the environment `load(env)` gives (the gate
    passes `load_environment`, the loader its evaluation uses)."""
    canaries, skipped = build(tasks, per_env)
    envs: dict[str, Environment] = {}
    results = []
    for c in canaries:
        env = envs.get(c.task.env) or envs.setdefault(c.task.env, load(c.task.env))
        results.append(verdict(c, score(c, env)))
    return report(results, skipped)


def report(results: list[CanaryResult], skipped: Mapping[str, str]) -> GateCanaries:
    per_env: dict[str, int] = {}
    for r in results:
        per_env[r.env] = per_env.get(r.env, 0) + 1
    return GateCanaries(checked=len(results), wrong=[r for r in results if not r.ok],
                        per_env=dict(sorted(per_env.items())), skipped=dict(skipped))


def check(found: GateCanaries) -> GateCheck:
    """The `canaries` check: passes iff every canary was scored as it should be."""
    if not found.wrong:
        return GateCheck(name="canaries", passed=True,
                         detail=f"all {found.checked} verifier canaries scored as expected")
    named = "; ".join(f"{w.env} {w.canary} on task {w.task_id[:8]} (should be {w.expect}, "
                      f"got {w.got})" for w in found.wrong[:5])
    more = f" and {len(found.wrong) - 5} more" if len(found.wrong) > 5 else ""
    return GateCheck(name="canaries", passed=False,
                     detail=f"{len(found.wrong)} of {found.checked} verifier canaries scored "
                            f"wrongly — the verifier can be gamed: {named}{more}")
