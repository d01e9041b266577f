"""The README's JSON examples are executable: each one parses, and its failures mine into tasks.

Every ```json block of README.md is a trajectory (v1, Chat Completions transcript,
request/response pair) or a feedback record; a block that parses as neither fails here, so
the README cannot drift from the wire format.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from flywheel.feedback import Feedback, parse_feedback
from flywheel.mining.build import Unverifiable, build_task
from flywheel.mining.classify import classify_failure
from flywheel.mining.expected import expected_calls
from flywheel.mining.feedback_apply import apply_feedback
from flywheel.tasks import ToolCallSpec
from flywheel.trajectory import Trajectory, parse_trajectory

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```json\n(.*?)^```", re.DOTALL | re.MULTILINE)
_TRAJECTORY_KEYS = {"items", "messages", "request"}


def examples() -> list[dict[str, Any]]:
    blocks = [json.loads(b) for b in _BLOCK.findall(README.read_text())]
    assert len(blocks) >= 4, "the README lost its format examples"
    return blocks


def parse(example: dict[str, Any]) -> Trajectory | Feedback:
    if example.keys() & _TRAJECTORY_KEYS:
        return parse_trajectory(example)
    return parse_feedback(example)


@pytest.mark.parametrize("n", range(len(examples())))
def test_every_json_example_parses(n: int) -> None:
    assert isinstance(parse(examples()[n]), Trajectory | Feedback)


def _task(t: Trajectory) -> ToolCallSpec:
    found = expected_calls(t)
    assert found is not None, "the example shows no expected action"
    task = build_task(t, classify_failure(t, found[0]))
    assert not isinstance(task, Unverifiable), task.reason
    assert isinstance(task.verifier, ToolCallSpec)
    return task.verifier


def test_the_examples_cover_every_shape_and_their_failures_become_tasks() -> None:
    parsed = [parse(e) for e in examples()]
    formats = [p.metadata.get("source_format", "v1") for p in parsed if isinstance(p, Trajectory)]
    assert {"v1", "chat_completions", "request_response"} <= set(formats)
    v1 = next(p for p, f in zip(parsed, formats, strict=False) if f == "v1")
    assert isinstance(v1, Trajectory) and v1.is_failure
    assert [(c.name, c.arguments) for c in _task(v1).expected] == [("refund", {"order_id": "7"})]
    transcript = next(p for p in parsed if isinstance(p, Trajectory)
                      and p.metadata.get("source_format") == "chat_completions")
    assert transcript.status == "awaiting_outcome" and transcript.agent == "unknown"
    pair = next(p for p in parsed if isinstance(p, Trajectory)
                and p.metadata.get("source_format") == "request_response")
    feedback = next(p for p in parsed if isinstance(p, Feedback))
    assert feedback.request_id == pair.metadata["request_id"]
    corrected = apply_feedback(pair, feedback)
    assert corrected.is_failure
    assert [c.name for c in _task(corrected).expected] == ["get_order_status"]
