""""What changed": the holdout tasks a candidate fixed and broke, paired, in words (pure).

A task's success on each side is the share of its paired attempts (same task, sample index
and seed on both sides) that succeeded; the candidate *fixed* a task where its share is
higher, *broke* one where it is lower. Each listed task shows one pair where the sides
differ — both replies side by side and the verifier's verdict on each. For an episode task
the pair is shown turn by turn (calls, tool results, answers, the scripted user's messages)
with the first turn whose calls differ (`diverged_at`) and the episode verifier's own reason.
Counts are per failure mode of the failing side (what production got wrong on a fixed task,
what the candidate gets wrong on a broken one: "broke 5 by answering empty") and per
expected tool.
"""

from __future__ import annotations

import json

from flywheel.events import ChangeCount, ChangedSide, ChangedTask, EpisodeTurn, GateChanges
from flywheel.gate.decision import Attempt, EvalRun


def reason(a: Attempt) -> str:
    """The verifier's verdict on one attempt, in words (with its own reason where it gave
    one: the episode verifier's)."""
    said = f": {a.reason}" if a.reason else ""
    if a.success:
        return f"success (reward {a.reward:.2f}){said}"
    if a.reason:
        return f"{a.failure_mode or 'failure'}: reward {a.reward:.2f}{said}"
    parts = ", ".join(f"{k} {v:g}" for k, v in sorted(a.components.items()))
    extra = ["cut by max_tokens" if a.finish_reason == "length" else "",
             f"called {', '.join(a.calls)}" if a.calls else ("no tool called"
                                                             if a.turns else "")]
    said = "; ".join(x for x in extra if x)
    return (f"{a.failure_mode or 'failure'}: reward {a.reward:.2f}"
            + (f" ({parts})" if parts else "") + (f"; {said}" if said else ""))


def _side(attempts: list[Attempt], shown: Attempt) -> ChangedSide:
    return ChangedSide(success=sum(a.success for a in attempts) / len(attempts),
                       reply=shown.reply, failure_mode=shown.failure_mode,
                       reason=reason(shown),
                       episode=None if shown.episode is None
                       else [EpisodeTurn.model_validate(t) for t in shown.episode])


def diverged_at(a: list[EpisodeTurn] | None, b: list[EpisodeTurn] | None) -> int | None:
    """The first turn (1-based) whose calls (tools and arguments) differ between two
    episodes, a turn one of them lacks included; None when neither has a turn that differs."""
    if a is None or b is None:
        return None
    for k in range(max(len(a), len(b))):
        if k >= len(a) or k >= len(b):
            return k + 1
        if [(c.name, _args(c.arguments)) for c in a[k].calls] \
                != [(c.name, _args(c.arguments)) for c in b[k].calls]:
            return k + 1
    return None


def _args(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _count(table: dict[str, ChangeCount], key: str, fixed: bool) -> None:
    c = table.get(key, ChangeCount())
    table[key] = ChangeCount(fixed=c.fixed + fixed, broken=c.broken + (not fixed))


def changes(cand: EvalRun, base: EvalRun, limit: int) -> GateChanges:
    """The tasks `cand` fixed and broke against `base`, at most `limit` of each listed."""
    prod = {(a.task, a.index): a for a in base.attempts}
    pairs: dict[str, list[tuple[Attempt, Attempt]]] = {}
    for a in cand.attempts:
        b = prod.get((a.task, a.index))
        if b is not None:
            pairs.setdefault(a.task, []).append((a, b))
    fixed: list[tuple[float, ChangedTask]] = []
    broken: list[tuple[float, ChangedTask]] = []
    per_mode: dict[str, ChangeCount] = {}
    per_tool: dict[str, ChangeCount] = {}
    for task, ps in sorted(pairs.items()):
        ps.sort(key=lambda p: p[0].index)
        gain = sum(a.success - b.success for a, b in ps) / len(ps)
        if gain == 0:
            continue
        won = gain > 0
        # The first pair that went the task's way: candidate right and production wrong
        # on a fixed task, the other way round on a broken one.
        a, b = next((a, b) for a, b in ps if a.success == won and b.success != won)
        groups = cand.task_groups.get(task, base.task_groups.get(task, []))
        cs, ps_ = _side([p[0] for p in ps], a), _side([p[1] for p in ps], b)
        item = ChangedTask(task_id=task, groups=groups, candidate=cs, production=ps_,
                           diverged_at=diverged_at(cs.episode, ps_.episode))
        (fixed if won else broken).append((abs(gain), item))
        failing = b if won else a
        _count(per_mode, failing.failure_mode or "failure", won)
        for g in groups:
            if g.startswith("tool:"):
                _count(per_tool, g.removeprefix("tool:"), won)
    return GateChanges(tasks=len(pairs), fixed_count=len(fixed), broken_count=len(broken),
                       fixed=_largest(fixed, limit), broken=_largest(broken, limit),
                       per_mode=dict(sorted(per_mode.items())),
                       per_tool=dict(sorted(per_tool.items())))


def _largest(found: list[tuple[float, ChangedTask]], limit: int) -> list[ChangedTask]:
    return [t for _, t in sorted(found, key=lambda x: (-x[0], x[1].task_id))][:limit]
