"""Feedback wire format v1: what arrives later for a stored trajectory.

Deployed agents rarely know their outcome when they log a call: a user's thumbs-down, a
failed ticket or a human correction comes later, often from another system. A `Feedback`
names its trajectory (by `trajectory_id`, or by the request's id: the response's `id`, kept
in the trajectory's `metadata.request_id`) and says one or more of: an outcome, a rating,
structured feedback (the expected call(s)) or a correction. The miner applies it
(`flywheel.mining.outcomes`); `parse_feedback` validates what producers send.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flywheel.formats import chat_to_items
from flywheel.trajectory import Item, OutcomeStatus, keep_unknown_fields

# Namespace of content-derived feedback ids (uuid5), fixed forever: re-sent feedback without
# a `feedback_id` gets the same id and is applied once.
FEEDBACK_ID_NAMESPACE = uuid.UUID("3e7d2a10-5c8b-4f19-a6d4-8b0c1f2e9d53")
Rating = Literal["up", "down"]


class OutcomeUpdate(BaseModel):
    """The parts of an outcome a feedback sets; unset parts keep the trajectory's. Other
    fields are kept, as in `Outcome`."""

    model_config = ConfigDict(extra="allow", frozen=True)

    status: OutcomeStatus | None = None
    reward: float | None = None
    error: str | None = None


class Feedback(BaseModel):
    """An outcome, a rating, structured feedback or a correction for one trajectory, named
    by its `trajectory_id` or by the request's id (`request_id`: e.g. the response's `id`,
    kept in the trajectory's `metadata.request_id`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    feedback_id: uuid.UUID
    """Idempotency key; derived from the content when absent (re-sending is a no-op)."""
    trajectory_id: uuid.UUID | None = None
    request_id: str | None = Field(default=None, min_length=1)
    rating: Rating | None = None
    """Thumbs up (`up`: a success) or down (`down`: a failure)."""
    outcome: OutcomeUpdate | None = None
    feedback: str | dict[str, Any] | None = None
    """Free text or structured: `{"expected_call": {…}}` / `{"expected_calls": [...]}`."""
    correction: list[Item] | None = None
    """What the agent should have done: v1 items or Chat Completions messages."""
    by: str | None = None
    note: str | None = None
    created_at: datetime | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _complete(self) -> Feedback:
        if self.trajectory_id is None and self.request_id is None:
            raise ValueError("feedback names no trajectory: set trajectory_id (the id the "
                             "gateway or SDK returned) or request_id (e.g. the response's id)")
        if (self.rating, self.outcome, self.feedback, self.correction, self.note) == \
                (None,) * 5:
            raise ValueError("feedback says nothing: give a rating (up/down), an outcome, "
                             "structured feedback ({\"expected_call\": …}), a correction or "
                             "a note")
        return self

    @property
    def target(self) -> str:
        """What it names its trajectory by (the Kafka key of the feedback topic)."""
        return str(self.trajectory_id) if self.trajectory_id is not None else str(self.request_id)


_FEEDBACK_KNOWN = frozenset(Feedback.model_fields)
_RATINGS: dict[object, Rating] = {"up": "up", "down": "down", "thumbs_up": "up",
                                  "thumbs_down": "down", "+1": "up", "-1": "down"}


def _rating(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool) and value in (1, -1):
        return "up" if value == 1 else "down"
    if isinstance(value, str):
        return _RATINGS.get(value.strip().lower(), value)
    return value  # anything else is reported by validation


def _correction(value: object) -> object:
    """Chat messages (no `type`) become items; one message or item alone becomes a list."""
    entries = [value] if isinstance(value, dict) else value
    if not isinstance(entries, list):
        return value
    out: list[Any] = []
    for n, entry in enumerate(entries):
        if isinstance(entry, dict) and "type" not in entry and "role" in entry:
            out += chat_to_items([entry], first_index=n)
        else:
            out.append(entry)
    return out


def parse_feedback(record: Any, *, trajectory_id: uuid.UUID | None = None,
                   request_id: str | None = None) -> Feedback:
    """Validate one feedback record; `trajectory_id`/`request_id` name its target when the
    record is sent to a URL that does (`POST /v1/trajectories/{id}/feedback`). Raises
    `ValueError` (incl. pydantic's) on bad input."""
    if not isinstance(record, dict):
        raise ValueError(f"feedback must be a JSON object, got {type(record).__name__}")
    data = dict(record)
    for key, value in (("trajectory_id", trajectory_id), ("request_id", request_id)):
        if value is None:
            continue
        if data.get(key) not in (None, str(value), value):
            raise ValueError(f"the body names {key} {data[key]!r} but the URL names {value}: "
                             "send the feedback to its own trajectory's URL")
        data[key] = str(value)
    if "feedback_id" not in data or data["feedback_id"] in (None, ""):
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
        data["feedback_id"] = str(uuid.uuid5(FEEDBACK_ID_NAMESPACE, canonical))
    if "rating" in data:
        data["rating"] = _rating(data["rating"])
    if data.get("correction") is not None:
        data["correction"] = _correction(data["correction"])
    keep_unknown_fields(data, _FEEDBACK_KNOWN)
    return Feedback.model_validate(data)
