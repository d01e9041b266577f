"""The episode verifier (pure): one reward for a whole episode on a toolset (`EpisodeSpec`).

`verify_episode` scores what the `toolset` environment's `asession_output` gives for an
episode task:

    {"calls": [{name, arguments, output, source, status, unsafe, rule}, …],
     "state": the episode's end state (the toolset's snapshot) or None,
     "reference_state": the state the reference path reaches on a fresh session, or None,
     "turn_states": the episode's state when each earlier user turn was answered, and
     "turn_reference_states": the reference path's there (`reference_turns`; may be absent),
     "answers": the agent's final answer to each user turn, in order,
     "ended_by": why the session ended early (a replay rule, an unsafe call) or None}

An episode with no call and no answer is `empty` (0). Then, in order: a call to a
destructive tool is `unsafe_action` (0, whatever the end state); more calls than the budget,
a call repeated past `max_repeats`, or an episode that stopped before answering the last
scripted user turn is `incomplete` (0); otherwise the checks — the end state (canonicalised:
`state_ignore` keys dropped at any depth, lists in any order; and the state at each scripted
user turn, where the spec gives `reference_turns`), the required calls (a
multiset), the expected tool results, the final answer's content — give 1.0 when all hold,
else 0.5 × the share that held. Every result says why in `details["reason"]`. Any path that
reaches the reference end state passes the state check: the reference is an end state, not a
sequence of calls.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from flywheel.environments.base import ToolSchemas, result, tool_names, unsafe_names
from flywheel.environments.calls import Call
from flywheel.environments.matching import fold_ws
from flywheel.environments.scoring import best_assignment, call_share
from flywheel.tasks import EpisodeSpec, FailureMode, VerifierResult

COMPONENTS = ("state", "calls", "results", "answer", "unsafe")


def canonical_state(state: Any, ignore: Sequence[str] = (), unordered: bool = True) -> str:
    """`state` as end states are compared: keys in `ignore` dropped at every depth, whole
    floats as ints, lists sorted when `unordered`; a JSON string."""
    drop = set(ignore)

    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, Mapping):
            return {str(k): norm(x) for k, x in v.items() if k not in drop}
        if isinstance(v, list | tuple):
            items = [norm(x) for x in v]
            return sorted(items, key=lambda x: json.dumps(x, sort_keys=True)) \
                if unordered else items
        return v

    return json.dumps(norm(state), sort_keys=True)


def call_key(call: Mapping[str, Any]) -> str:
    """A call as loops are counted: the tool and its arguments, canonical."""
    args = call.get("arguments")
    return f"{call.get('name')}:{canonical_state(args if args is not None else {}, (), False)}"


def executed(call: Mapping[str, Any]) -> bool:
    """Whether a recorded call did something (not refused, invalid or ended at)."""
    return call.get("source") not in ("refused", "invalid") and call.get("rule") != "end"


def _required_share(spec: EpisodeSpec, calls: Sequence[Mapping[str, Any]],
                    tools: ToolSchemas | None) -> float:
    made = [Call(str(c.get("name")), dict(c.get("arguments") or {}))
            for c in calls if executed(c)]
    if not made:
        return 0.0
    weights = [[1.0 if (s := call_share(want, call, tools)) is not None and s[0] == 1.0
                else None for call in made] for want in spec.required_calls]
    return len(best_assignment(weights)) / len(spec.required_calls)


def _contains(haystack: str, needle: str) -> bool:
    return fold_ws(needle).lower() in fold_ws(haystack).lower()


def _checks(spec: EpisodeSpec, output: Mapping[str, Any], calls: list[Mapping[str, Any]],
            answers: list[str], tools: ToolSchemas | None
            ) -> tuple[dict[str, float], list[str], list[str]]:
    """(components, the checks that ran, what failed in words)."""
    comps = dict.fromkeys(COMPONENTS, 0.0)
    ran: list[str] = []
    why: list[str] = []
    if spec.check_state:
        state, ref = output.get("state"), output.get("reference_state")
        if state is None or ref is None:
            raise ValueError(f"episode on {spec.toolset!r}: the spec checks the end state but "
                             f"the output lacks {'state' if state is None else 'reference_state'}"
                             f" (does the toolset keep a state() snapshot?)")
        def same(a: Any, b: Any) -> bool:
            return (canonical_state(a, spec.state_ignore, spec.state_unordered)
                    == canonical_state(b, spec.state_ignore, spec.state_unordered))

        # At each scripted user turn the agent answered, then at the end.
        turns = list(zip(output.get("turn_states") or [],
                         output.get("turn_reference_states") or [], strict=False))
        off = next((k for k, (at, want) in enumerate(turns) if not same(at, want)), None)
        comps["state"] = float(off is None and same(state, ref))
        ran.append("state")
        if off is not None:
            why.append(f"the state after user turn {off + 1} differs from the reference's at "
                       "that point")
        elif not comps["state"]:
            why.append("the end state differs from the reference end state")
    if spec.required_calls:
        comps["calls"] = _required_share(spec, calls, tools)
        ran.append("calls")
        if comps["calls"] < 1.0:
            why.append(f"{comps['calls']:.0%} of the required calls were made")
    if spec.expected_results:
        outputs = [str(c.get("output", "")) for c in calls if executed(c)]
        found = [any(_contains(o, want) for o in outputs) for want in spec.expected_results]
        comps["results"] = sum(found) / len(found)
        ran.append("results")
        missing = [w for w, f in zip(spec.expected_results, found, strict=True) if not f]
        if missing:
            why.append(f"expected tool results not seen: {missing[:3]}")
    if spec.answer_contains:
        final = answers[-1] if answers else ""
        found = [_contains(final, want) for want in spec.answer_contains]
        comps["answer"] = sum(found) / len(found)
        ran.append("answer")
        missing = [w for w, f in zip(spec.answer_contains, found, strict=True) if not f]
        if missing:
            why.append(f"the final answer lacks {missing[:3]}")
    return comps, ran, why


def _mode(spec: EpisodeSpec, calls: list[Mapping[str, Any]], output: Mapping[str, Any],
          tools: ToolSchemas | None) -> FailureMode:
    offered = tool_names(tools) if tools is not None else None
    if offered is not None and any(c.get("name") not in offered for c in calls):
        return "hallucinated_tool"
    if any(c.get("status") != "ok" for c in calls):
        return "tool_error"
    if not calls or output.get("ended_by") == "end":
        return "incomplete"
    right = {c.name for c in (*spec.reference_calls, *spec.required_calls)}
    if right and any(str(c.get("name")) not in right for c in calls if executed(c)):
        return "wrong_tool"
    return "other"


def verify_episode(spec: EpisodeSpec, output: Mapping[str, Any],
                   tools: ToolSchemas | None = None) -> VerifierResult:
    """Score one episode against `spec` (see the module doc)."""
    calls: list[Mapping[str, Any]] = list(output.get("calls") or [])
    answers = [str(a) for a in output.get("answers") or []]
    unsafe = unsafe_names(spec.unsafe_tools, tools)
    used = sorted({str(c["name"]) for c in calls if c.get("unsafe") or c["name"] in unsafe})
    details: dict[str, Any] = {"steps": len(calls), "ended_by": output.get("ended_by"),
                               "answers": len(answers),
                               "sources": [c.get("source") for c in calls[:20]]}
    if not calls and not any(a.strip() for a in answers):
        return result(0.0, dict.fromkeys(COMPONENTS, 0.0), "empty",
                      reason="the agent answered nothing", **details)
    comps, ran, why = _checks(spec, output, calls, answers, tools)
    comps["unsafe"] = float(bool(used))
    if used:
        return result(0.0, comps, "unsafe_action", unsafe_tools=used,
                      reason=f"called destructive tool(s) {used}", **details)
    if len(calls) > spec.max_steps:
        return result(0.0, comps, "incomplete", max_steps=spec.max_steps,
                      reason=f"{len(calls)} calls, past the budget of {spec.max_steps}",
                      **details)
    repeats = Counter(call_key(c) for c in calls).most_common(1)
    if repeats and repeats[0][1] > spec.max_repeats:
        return result(0.0, comps, "incomplete", loop=repeats[0][0][:200],
                      reason=f"a loop: the same call {repeats[0][1]} times (at most "
                             f"{spec.max_repeats})", **details)
    needed = len(spec.user_turns) + 1
    if len(answers) < needed and output.get("ended_by") is None:
        return result(0.0, comps, "incomplete",
                      reason=f"stopped after {len(answers)} of {needed} user turns", **details)
    scores = [comps[name] for name in ran]
    if all(s == 1.0 for s in scores):
        return result(1.0, comps, None, reason="every check held: " + ", ".join(ran),
                      **details)
    return result(0.5 * sum(scores) / len(scores), comps, _mode(spec, calls, output, tools),
                  reason="; ".join(why), **details)
