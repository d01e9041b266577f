"""Trajectory wire format v1 and its conversion from OpenAI Chat Completions transcripts.

A trajectory is what a deployed agent did: the tools it was offered, the ordered items
(messages, function calls, their outputs, reasoning) and the outcome. Items follow the OpenAI
Responses API shapes so agent logs map in without loss. Unknown top-level fields are moved
into `metadata["unknown_fields"]`; unknown fields inside nested objects are kept in place.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1
# Namespace of content-derived trajectory ids (uuid5), fixed forever: changing it would turn
# re-sent duplicates of id-less records into new rows.
CONTENT_ID_NAMESPACE = uuid.UUID("6b1f0c52-4a9e-4d57-9a0f-3c1d2e8b7a11")

OutcomeStatus = Literal["success", "failure", "error", "timeout", "escalated"]
CallStatus = Literal["ok", "error", "timeout"]
PG_BIGINT_MAX = 2**63 - 1
"""Largest integer a Postgres `bigint` holds: the bound of every integer field that is (or
may become) a column, so a value is refused at validation rather than by the database."""
_NAIVE_MARGIN = timedelta(days=1)


def storable_datetime(value: datetime) -> datetime:
    """A timestamp Postgres can store: `timestamptz` keeps UTC, and the driver converts to
    UTC first, so an instant outside years 1-9999 in UTC (`0001-01-01T00:00:00+23:59`) would
    fail in the database, not here. A naive timestamp is converted with the ingesting
    machine's zone, so it must stay a day clear of the edges whatever that zone is."""
    if value.utcoffset() is None:
        if datetime.min + _NAIVE_MARGIN <= value.replace(tzinfo=None) <= \
                datetime.max - _NAIVE_MARGIN:
            return value
    else:
        try:
            value.astimezone(UTC)
            return value
        except (OverflowError, ValueError):
            pass
    raise ValueError(f"{value.isoformat()} is outside the range a timestamp can be stored in "
                     "once converted to UTC (years 1 to 9999); check the year and the UTC "
                     "offset")


StoredDatetime = Annotated[datetime, AfterValidator(storable_datetime)]
"""A datetime field that lands in a `timestamptz` column."""
Count = Annotated[int, Field(ge=0, le=PG_BIGINT_MAX)]


class _Open(BaseModel):
    """Nested objects keep fields this version does not know (extra="allow"). Floats must be
    finite: JSON has no NaN/Infinity and Postgres' jsonb refuses them."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class Tool(_Open):
    """An OpenAI function-tool schema (flat, Responses API style).

    The Chat Completions nesting (`{"type": "function", "function": {...}}`) is flattened by
    `normalize` before validation.
    """

    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})



class MessageItem(_Open):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class FunctionCallItem(_Open):
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    """The raw argument string the model produced (may be invalid JSON: that is evidence)."""


class FunctionCallOutputItem(_Open):
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str
    status: CallStatus = "ok"


class ReasoningItem(_Open):
    type: Literal["reasoning"] = "reasoning"
    content: str | list[dict[str, Any]] | None = None


Item = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]


class HumanIntervention(_Open):
    by: str | None = None
    note: str | None = None
    corrected_items: list[Item] = Field(default_factory=list)
    """What a person says the agent should have done (becomes the expected action)."""


class Outcome(_Open):
    status: OutcomeStatus
    reward: float | None = None
    error: str | None = None
    feedback: str | None = None
    human_intervention: HumanIntervention | None = None


class Usage(_Open):
    input_tokens: Count | None = None
    output_tokens: Count | None = None


class Trajectory(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    schema_version: Literal[1] = 1
    trajectory_id: uuid.UUID
    """Producer-assigned idempotency key; derived from content when absent."""
    agent: str = Field(min_length=1)
    session_id: str | None = None
    model: str | None = None
    adapter_version: str | None = None
    """Which policy version produced this trajectory, if it was one of ours."""
    started_at: StoredDatetime | None = None
    ended_at: StoredDatetime | None = None
    tools: list[Tool] = Field(default_factory=list)
    items: list[Item] = Field(default_factory=list)
    outcome: Outcome
    metadata: dict[str, Any] = Field(default_factory=dict)
    usage: Usage | None = None
    latency_ms: float | None = Field(default=None, ge=0)

    @property
    def is_failure(self) -> bool:
        return self.outcome.status != "success"


_KNOWN = frozenset(Trajectory.model_fields)


def content_id(record: dict[str, Any]) -> uuid.UUID:
    """A deterministic id for a record sent without one: same content → same id."""
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"), default=str)
    return uuid.uuid5(CONTENT_ID_NAMESPACE, canonical)


def _flatten_tool(tool: Any) -> Any:
    if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
        flat = {k: v for k, v in tool.items() if k != "function"}
        flat.update(tool["function"])
        return flat
    return tool


def is_chat_transcript(record: dict[str, Any]) -> bool:
    return "messages" in record and "items" not in record


def chat_to_items(messages: list[Any]) -> list[dict[str, Any]]:
    """OpenAI Chat Completions `messages` (with `tool_calls`) → v1 items, order kept."""
    items: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
        role = msg["role"]
        extra = {k: v for k, v in msg.items() if k not in {"role", "content", "tool_calls",
                                                            "tool_call_id", "status"}}
        if role == "tool":
            if "tool_call_id" not in msg:
                raise ValueError(f"messages[{i}] (role 'tool') needs 'tool_call_id'")
            content = msg.get("content")
            output = content if isinstance(content, str) else json.dumps(content)
            items.append({"type": "function_call_output", "call_id": msg["tool_call_id"],
                          "output": output, "status": msg.get("status", "ok"), **extra})
            continue
        if msg.get("content") not in (None, "", []) or not msg.get("tool_calls"):
            items.append({"type": "message", "role": role, "content": msg.get("content"),
                          **extra})
        calls = msg.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls must be a list of tool calls, got "
                             f"{type(calls).__name__}")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or "name" not in fn:
                raise ValueError(f"messages[{i}].tool_calls[{j}] needs function.name")
            args = fn.get("arguments", "")
            items.append({"type": "function_call", "call_id": call.get("id") or f"call_{i}_{j}",
                          "name": fn["name"],
                          "arguments": args if isinstance(args, str) else json.dumps(args)})
    return items


def normalize(record: dict[str, Any]) -> dict[str, Any]:
    """Any accepted shape (v1 or chat transcript) → a dict that validates as `Trajectory`.

    Adds a content-derived `trajectory_id` when missing and moves unknown top-level fields
    into `metadata["unknown_fields"]`.
    """
    data = dict(record)
    if isinstance(data.get("tools"), list):
        data["tools"] = [_flatten_tool(t) for t in data["tools"]]
    if is_chat_transcript(data):
        messages = data.pop("messages")
        if not isinstance(messages, list):
            raise ValueError("'messages' must be a list")
        data["items"] = chat_to_items(messages)
        data.setdefault("metadata", {})
        if isinstance(data["metadata"], dict):
            data["metadata"] = {**data["metadata"], "source_format": "chat_completions"}
    if "trajectory_id" not in data or data["trajectory_id"] in (None, ""):
        data["trajectory_id"] = str(content_id(record))
    unknown = {k: data.pop(k) for k in list(data) if k not in _KNOWN}
    if unknown:
        meta = data.get("metadata")
        meta = dict(meta) if isinstance(meta, dict) else {}
        kept = meta.get("unknown_fields", {})
        if not isinstance(kept, dict):
            raise ValueError("metadata.unknown_fields must be an object: it is where unknown "
                             "top-level fields are kept; rename that metadata field")
        meta["unknown_fields"] = {**kept, **unknown}
        data["metadata"] = meta
    return data


def parse_trajectory(record: Any) -> Trajectory:
    """Validate one decoded JSON value. Raises `ValueError` (incl. pydantic's) on bad input."""
    if not isinstance(record, dict):
        raise ValueError(f"a trajectory must be a JSON object, got {type(record).__name__}")
    return Trajectory.model_validate(normalize(record))


