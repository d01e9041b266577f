"""Feedback applied to a trajectory, and episodes across records (pure, no I/O).

`apply_feedback` folds one `Feedback` into a trajectory's outcome. The status it leaves:
the feedback's explicit `outcome.status`, else its rating (`up` → success, `down` →
failure), else failure when it brings a correction or expected calls (someone says the
agent should have acted otherwise), else the trajectory's own (still awaiting, if it had
none). Later feedback overrides earlier; a correction or structured feedback replaces the
previous one. Every feedback applied is listed in `metadata.feedback`.

A request/response pair is one model call whose request repeats the conversation so far;
its feedback is about the answer (`decision_start`). So a correction or expected calls for a
pair are made absolute: prefixed with the calls the request already holds, the same turn
numbering a retry or a v1 correction has. (Whether two records are one episode:
`mining.expected.same_episode`.)
"""

from __future__ import annotations

from typing import Any

from flywheel.feedback import Feedback
from flywheel.mining.classify import decision_start, parse_arguments
from flywheel.mining.expected import feedback_calls
from flywheel.trajectory import FunctionCallItem, Trajectory

_RATED = {"up": "success", "down": "failure"}


def _history_calls(t: Trajectory) -> list[dict[str, Any]] | None:
    """The calls of a pair's request as expected calls (None: one is not a JSON object)."""
    out = []
    for item in t.items[:decision_start(t)]:
        if isinstance(item, FunctionCallItem):
            args = parse_arguments(item.arguments)
            if args is None:
                return None
            out.append({"name": item.name, "arguments": args})
    return out


def _absolute_feedback(t: Trajectory, feedback: str | dict[str, Any]) -> str | dict[str, Any]:
    """Structured feedback for a pair's answer, prefixed with the request's calls."""
    calls = feedback_calls(feedback)
    history = _history_calls(t) if decision_start(t) else []
    if not calls or not history:
        return feedback
    raw = feedback if isinstance(feedback, dict) else {}
    rest = {k: v for k, v in raw.items() if k not in ("expected_call", "expected_calls")}
    return {**rest, "expected_calls": [*history, *(c.model_dump(mode="json") for c in calls)]}


def apply_feedback(t: Trajectory, fb: Feedback) -> Trajectory:
    """`t` with `fb` folded into its outcome (module docstring)."""
    base = t.outcome.model_dump(mode="json", exclude_none=True) if t.outcome else {}
    structured = fb.feedback is not None and feedback_calls(fb.feedback) is not None
    status = (fb.outcome.status if fb.outcome is not None and fb.outcome.status else None) \
        or (_RATED[fb.rating] if fb.rating else None) \
        or ("failure" if fb.correction or structured else None) \
        or base.get("status")
    data = t.model_dump(mode="json", exclude_none=True)
    meta = dict(data.get("metadata", {}))
    meta["feedback"] = [*meta.get("feedback", []), _summary(fb)]
    data["metadata"] = meta
    if status is None:  # a note alone on a trajectory with no outcome: nothing to judge yet
        return Trajectory.model_validate(data)
    outcome = {**base, **(fb.outcome.model_dump(mode="json", exclude_none=True)
                          if fb.outcome is not None else {}), "status": status}
    if fb.rating:
        outcome["rating"] = fb.rating
    if fb.feedback is not None:
        outcome["feedback"] = _absolute_feedback(t, fb.feedback)
    if fb.correction is not None:
        context = t.items[:decision_start(t)]
        outcome["human_intervention"] = {
            "by": fb.by, "note": fb.note,
            "corrected_items": [i.model_dump(mode="json", exclude_none=True)
                                for i in [*context, *fb.correction]]}
    data["outcome"] = outcome
    return Trajectory.model_validate(data)


def apply_all(t: Trajectory, feedback: list[Feedback]) -> Trajectory:
    """`t` with every feedback applied in arrival order."""
    for fb in feedback:
        t = apply_feedback(t, fb)
    return t


def _summary(fb: Feedback) -> dict[str, Any]:
    return {k: v for k, v in {"feedback_id": str(fb.feedback_id), "rating": fb.rating,
                              "by": fb.by, "note": fb.note,
                              "created_at": fb.created_at.isoformat() if fb.created_at
                              else None}.items() if v is not None}

