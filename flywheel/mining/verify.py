"""`flywheel verify check|profile`: run verifiers over outputs, see the reward distribution.

`profile` scores, for each stored task of an environment, the attempt the deployed agent
actually made (from the task's source trajectory) and the task's reference behaviour. The
reference must score 1.0 — a verifier that cannot recognise the right answer is broken — and
the production attempts must not (they failed). Profile a verifier before training on it.
"""

from __future__ import annotations

import json
import random
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.environments import load_environment, profile_rewards
from flywheel.mining.expected import call_groups
from flywheel.tasks import (
    CodeSpec,
    RolloutNotRun,
    TaskSpec,
    ToolCallSpec,
    VerifierResult,
    WorkplaceSpec,
)
from flywheel.trajectory import FunctionCallItem, MessageItem, Trajectory


def score(task: TaskSpec, output: Any) -> VerifierResult | RolloutNotRun:
    try:
        return load_environment(task.env).verify_task(task, output)
    except RolloutNotRun as err:
        return err


def result_json(r: VerifierResult | RolloutNotRun) -> dict[str, Any]:
    if isinstance(r, RolloutNotRun):
        return {"reward": None, "not_run": r.kind, "error": r.message}
    return {"reward": r.reward, "components": r.reward_components,
            "failure_mode": r.failure_mode}


def check(task: TaskSpec, outputs: list[Any]) -> list[dict[str, Any]]:
    """One result per output; an output of a kind the environment cannot score says so."""
    results = []
    for o in outputs:
        try:
            results.append(result_json(score(task, o)))
        except TypeError as err:  # e.g. a number where a message or calls were due
            results.append({"reward": None, "error": str(err)})
    return results


def assistant_message(calls: list[tuple[str, Any]]) -> dict[str, Any]:
    """An OpenAI-style assistant message making `calls` ((name, arguments) each)."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": args}}
        for n, (name, args) in enumerate(calls)]}


def reference_output(task: TaskSpec) -> Any | None:
    v = task.verifier
    if isinstance(v, ToolCallSpec):
        return assistant_message([(c.name, json.dumps(c.arguments)) for c in v.expected])
    if isinstance(v, WorkplaceSpec):
        return v.expected_state
    return None  # code tasks carry tests, not a reference solution


def attempted_output(task: TaskSpec, t: Trajectory, evidence: dict[str, Any]) -> Any | None:
    """What the deployed agent actually did at the failing decision, as verifier input."""
    calls = [i for i in t.items if isinstance(i, FunctionCallItem)]
    if isinstance(task.verifier, ToolCallSpec):
        turns = call_groups(t.items)
        turn = next((tn for tn in turns if any(c.call_id == evidence.get("call_id")
                                                for c in tn)), turns[0] if turns else None)
        if turn is None:
            return None  # the agent made no call (e.g. answered in text): nothing to score
        return assistant_message([(c.name, c.arguments) for c in turn])
    if isinstance(task.verifier, WorkplaceSpec):
        return [{"name": c.name, "arguments": c.arguments} for c in calls]
    if isinstance(task.verifier, CodeSpec):
        texts = [i.content for i in t.items if isinstance(i, MessageItem)
                 and i.role == "assistant" and isinstance(i.content, str)]
        return texts[-1] if texts else None
    return None


async def profile(conn: AsyncConnection, env: str, sample: int, seed: int = 0) -> dict[str, Any]:
    rows: Any = (await conn.execute(text("""
        SELECT t.spec, f.record, f.evidence FROM tasks t
        JOIN LATERAL (SELECT f.record, f.evidence FROM failures f
                      WHERE f.task_id = t.task_id ORDER BY f.mined_at LIMIT 1) f ON true
        WHERE t.env = :env ORDER BY t.task_id"""), {"env": env})).all()
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    attempts: list[VerifierResult | RolloutNotRun] = []
    references: list[VerifierResult | RolloutNotRun] = []
    for spec, record, evidence in rows[:sample]:
        task = TaskSpec.model_validate(spec)
        out = attempted_output(task, Trajectory.model_validate(record), evidence)
        if out is not None:
            attempts.append(score(task, out))
        ref = reference_output(task)
        if ref is not None:
            references.append(score(task, ref))
    return {"env": env, "tasks": min(sample, len(rows)),
            "production_attempts": profile_rewards(attempts),
            "reference": profile_rewards(references) if references else None}
