"""Score one turn of tool calls against the expected calls (pure, no I/O).

The expected calls and the calls made compare as multisets: each expected call is paired
with at most one call of the same name, in the assignment that maximises the reward
(ties: the earliest calls). With m expected calls, n calls made and k = max(m, n):

* `valid_json` = 1 once the output parsed into calls (an output without any call is
  `invalid_format`, "no tool call");
* `right_tool` = (pairs) / k — every expected call without a same-name partner, and every
  extra call, counts against;
* `arguments` = (Σ argument share of each pair, see `matching.arguments_match`) / k;
* reward = 0.1·valid_json + 0.3·right_tool + 0.6·arguments, in [0, 1]. Success ⇔ reward
  1.0 ⇔ m = n and every pair matches exactly. For one expected call and one call made this
  is the single-call score the verifier always had.

A call to an unsafe tool (`spec.unsafe_tools`, or `x-unsafe` in its schema) scores 0 with
`unsafe_action`, whatever else the turn got right. Failure modes, first that applies:
`unsafe_action`, `hallucinated_tool` (a tool the task does not offer; only with `tools`),
`incomplete` (fewer calls than expected, each one paired), `wrong_tool` (otherwise a call
without a partner: a wrong, an extra or a duplicated call), `bad_arguments`. `details` say
which: `calls` (as parsed), `missing_calls`, `extra_calls`, and per pair the `mismatches`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flywheel.environments.base import (
    ToolSchemas,
    result,
    tool_by_name,
    tool_names,
    unsafe_names,
)
from flywheel.environments.calls import Call
from flywheel.environments.matching import Schema, arguments_match
from flywheel.tasks import ExpectedCall, ToolCallSpec, VerifierResult

WEIGHTS = {"valid_json": 0.1, "right_tool": 0.3, "arguments": 0.6}
_EXACT_LIMIT = 12
"""With more calls than this on both sides the pairing is greedy (exact search is 2^n)."""


def check_spec(spec: ToolCallSpec, tools: ToolSchemas | None) -> set[str]:
    """The unsafe tool names; a task that expects an unsafe call is a bug, said as such."""
    unsafe = unsafe_names(spec.unsafe_tools, tools)
    bad = sorted({c.name for c in spec.expected} & unsafe)
    if bad:
        raise ValueError(f"task expects a call to {bad}, marked unsafe; fix the task (its "
                         f"expected calls or its unsafe_tools)")
    return unsafe


def _schema(tools: ToolSchemas | None, name: str) -> Schema | None:
    params = (tool_by_name(tools, name) or {}).get("parameters") if tools is not None else None
    return params if isinstance(params, Mapping) else None


def call_share(want: ExpectedCall, call: Call,
               tools: ToolSchemas | None = None) -> tuple[float, dict[str, list[str]]] | None:
    """Argument share of `call` against `want`, or None when the names differ."""
    if call.name != want.name:
        return None
    return arguments_match(want.arguments, call.arguments, _schema(tools, call.name),
                           alternatives=want.alternatives, optional=want.optional)


def best_assignment(weights: Sequence[Sequence[float | None]]) -> list[tuple[int, int]]:
    """(row, column) pairs of a maximum-weight matching; None marks a pair not allowed."""
    rows = len(weights)
    cols = len(weights[0]) if rows else 0
    if min(rows, cols) == 0:
        return []
    if rows < cols:  # the search keeps a bit mask of the columns: make them the smaller side
        flipped = [[weights[r][c] for r in range(rows)] for c in range(cols)]
        return sorted((r, c) for c, r in best_assignment(flipped))
    if cols > _EXACT_LIMIT:
        return _greedy(weights)
    memo: dict[tuple[int, int], tuple[float, tuple[tuple[int, int], ...]]] = {}

    def best(row: int, used: int) -> tuple[float, tuple[tuple[int, int], ...]]:
        if row == rows:
            return 0.0, ()
        if (row, used) not in memo:
            top: tuple[float, tuple[tuple[int, int], ...]] | None = None
            for col in range(cols):  # earliest column first: ties keep the earliest pairs
                w = weights[row][col]
                if w is not None and not used >> col & 1:
                    score, pairs = best(row + 1, used | 1 << col)
                    if top is None or score + w > top[0] + 1e-12:
                        top = (score + w, ((row, col), *pairs))
            skip = best(row + 1, used)  # this row stays unpaired
            memo[row, used] = skip if top is None or skip[0] > top[0] + 1e-12 else top
        return memo[row, used]

    return list(best(0, 0)[1])


def _greedy(weights: Sequence[Sequence[float | None]]) -> list[tuple[int, int]]:
    free, pairs = set(range(len(weights[0]))), []
    for row, line in enumerate(weights):
        options = [(w, -c) for c, w in enumerate(line) if w is not None and c in free]
        if options:
            col = -max(options)[1]
            free.discard(col)
            pairs.append((row, col))
    return pairs


def verify_calls(spec: ToolCallSpec, calls: Sequence[Call], tools: ToolSchemas | None = None,
                 **details: Any) -> VerifierResult:
    """Score the calls of one turn against `spec` (see the module doc); `details` are kept."""
    unsafe = check_spec(spec, tools)
    zero = dict.fromkeys((*WEIGHTS, "unsafe"), 0.0)
    want = spec.expected
    if not calls:
        return result(0.0, zero, "invalid_format", **details,
                      error=f"no tool call: the task expects {len(want)} call(s) "
                            f"({', '.join(c.name for c in want)}) in this turn")
    shares = [[call_share(w, c, tools) for c in calls] for w in want]
    weights = [[None if s is None else WEIGHTS["right_tool"] + WEIGHTS["arguments"] * s[0]
                for s in row] for row in shares]
    matched = [(i, j, s) for i, j in best_assignment(weights) if (s := shares[i][j]) is not None]
    k = max(len(want), len(calls))
    comps = {**zero, "valid_json": 1.0, "right_tool": len(matched) / k,
             "arguments": sum(s[0] for _, _, s in matched) / k}
    details["calls"] = [c.as_json() for c in calls[:20]]
    missing = sorted(set(range(len(want))) - {i for i, _, _ in matched})
    extra = sorted(set(range(len(calls))) - {j for _, j, _ in matched})
    if missing:
        details["missing_calls"] = [want[i].name for i in missing]
    if extra:
        details["extra_calls"] = [calls[j].name for j in extra]
    if any(c.name in unsafe for c in calls):
        return result(0.0, {**comps, "unsafe": 1.0}, "unsafe_action", **details)
    reward = sum(WEIGHTS[key] * comps[key] for key in WEIGHTS)
    offered = tool_names(tools) if tools is not None else None
    if offered is not None and any(c.name not in offered for c in calls):
        return result(reward, comps, "hallucinated_tool", **details)
    if missing or extra:
        mode = "incomplete" if not extra else "wrong_tool"
        return result(reward, comps, mode, **details)
    wrong = [{"expected": i, "call": j, "tool": want[i].name,
              **{kind: keys for kind, keys in why.items() if keys}}
             for i, j, (share, why) in matched if share < 1.0]
    if wrong:
        return result(reward, comps, "bad_arguments", **details, mismatches=wrong)
    return result(1.0, comps, None, **details)
