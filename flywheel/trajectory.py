"""Trajectory wire format v1, and the shapes agents log instead of it (converted on the way in).

A trajectory is what a deployed agent did: the tools it was offered, the ordered items
(messages, function calls, their outputs, reasoning) and, once known, the outcome. Items
follow the OpenAI Responses API shapes so agent logs map in without loss. Chat Completions
transcripts and request/response pairs are converted by `flywheel.formats`, Responses API
logs by `flywheel.responses_log`; a record
without an `agent` is named from its context (`ParseContext`). Unknown top-level fields are
moved into `metadata["unknown_fields"]`; unknown fields inside nested objects are kept in
place.

What arrives later for a stored trajectory (an outcome, a rating, a correction) is
`flywheel.feedback.Feedback`.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from flywheel.formats import (
    ParseContext,
    chat_to_items,
    derive_agent,
    is_chat_transcript,
    is_pair,
    pair_to_record,
)
from flywheel.responses_log import is_responses_log, responses_to_record

__all__ = ["AWAITING_OUTCOME", "ParseContext", "Trajectory", "chat_to_items", "content_id",
           "is_chat_transcript", "normalize", "parse_trajectory"]
SCHEMA_VERSION = 1
# Namespace of content-derived trajectory ids (uuid5), fixed forever: changing it would turn
# re-sent duplicates of id-less records into new rows.
CONTENT_ID_NAMESPACE = uuid.UUID("6b1f0c52-4a9e-4d57-9a0f-3c1d2e8b7a11")

OutcomeStatus = Literal["success", "failure", "error", "timeout", "escalated"]
CallStatus = Literal["ok", "error", "timeout"]
AWAITING_OUTCOME: Literal["awaiting_outcome"] = "awaiting_outcome"
"""The `trajectories.status` of a record stored without an outcome (neither success nor
failure until feedback says which)."""
TrajectoryStatus = OutcomeStatus | Literal["awaiting_outcome"]
PG_BIGINT_MAX = 2**63 - 1
"""Largest integer a Postgres `bigint` holds: the bound of every integer field that is (or
may become) a column, so a value is refused at validation rather than by the database."""
_NAIVE_MARGIN = timedelta(days=1)
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
"""The one rule for a tool's name, wherever a tool is offered: logged (ingest, mining,
training, the gate read what was stored) and served (`tools` of `/v1/chat/completions`).
What vLLM's server and MCP accept: letters, digits, `_`, `-`, dots (`math.factorial`) and
colons (`github:create_issue`), 1 to 128 characters."""


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
    name: str = Field(pattern=TOOL_NAME_PATTERN)
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
    feedback: str | dict[str, Any] | None = None
    """Free text, or structured: `{"expected_call": {…}}` / `{"expected_calls": [...]}`
    (also as a JSON string), which the miner turns into the expected action."""
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
    """Named by the record, else by its context (`flywheel.formats.derive_agent`); how is
    in `metadata.agent_source` when the record did not name it."""
    session_id: str | None = None
    model: str | None = None
    adapter_version: str | None = None
    """Which policy version produced this trajectory, if it was one of ours."""
    started_at: StoredDatetime | None = None
    ended_at: StoredDatetime | None = None
    tools: list[Tool] = Field(default_factory=list)
    items: list[Item] = Field(default_factory=list)
    outcome: Outcome | None = None
    """None: not known yet (stored as awaiting outcome; feedback may bring it later)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    usage: Usage | None = None
    latency_ms: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _says_something(self) -> Trajectory:
        if self.outcome is None and not self.items:
            raise ValueError("a trajectory needs what the agent did (items, Chat Completions "
                             "messages, or a request/response pair) or an outcome; it has "
                             "neither")
        return self

    @property
    def is_failure(self) -> bool:
        return self.outcome is not None and self.outcome.status != "success"

    @property
    def is_success(self) -> bool:
        return self.outcome is not None and self.outcome.status == "success"

    @property
    def status(self) -> TrajectoryStatus:
        """The outcome's status, or `awaiting_outcome`."""
        return self.outcome.status if self.outcome is not None else AWAITING_OUTCOME


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


def _with_metadata(data: dict[str, Any], **fields: Any) -> None:
    """Add `fields` to `data["metadata"]` (left alone when it is not an object: validation
    then says that it must be one)."""
    meta = data.get("metadata", {})
    if isinstance(meta, dict):
        data["metadata"] = {**meta, **fields}


def normalize(record: dict[str, Any], context: ParseContext | None = None) -> dict[str, Any]:
    """Any accepted shape (v1, chat transcript, request/response pair) → a dict that
    validates as `Trajectory`.

    Adds a content-derived `trajectory_id` when missing (from the record as sent, so the
    context does not change it), names the agent from `context` when the record does not,
    moves a top-level `request_id` to `metadata.request_id` (what feedback may refer to) and
    unknown top-level fields into `metadata["unknown_fields"]`.
    """
    if is_responses_log(record):
        data = responses_to_record(record)
    else:
        data = pair_to_record(record) if is_pair(record) else dict(record)
    if isinstance(data.get("tools"), list):
        data["tools"] = [_flatten_tool(t) for t in data["tools"]]
    if is_chat_transcript(data):
        messages = data.pop("messages")
        if not isinstance(messages, list):
            raise ValueError("'messages' must be a list")
        data["items"] = chat_to_items(messages)
        _with_metadata(data, source_format="chat_completions")
    if "trajectory_id" not in data or data["trajectory_id"] in (None, ""):
        data["trajectory_id"] = str(content_id(record))
    agent, source = derive_agent(data.get("agent"), context)
    data["agent"] = agent
    if source != "record":
        _with_metadata(data, agent_source=source)
    request_id = data.pop("request_id", None)
    if request_id is not None:
        _with_metadata(data, request_id=request_id)
    keep_unknown_fields(data, _KNOWN)
    return data


def keep_unknown_fields(data: dict[str, Any], known: frozenset[str] | set[str]) -> None:
    """Move the top-level fields outside `known` into `metadata.unknown_fields` (kept, not
    dropped: a newer producer's field survives an older reader)."""
    unknown = {k: data.pop(k) for k in list(data) if k not in known}
    if not unknown:
        return
    meta = data.get("metadata")
    meta = dict(meta) if isinstance(meta, dict) else {}
    kept = meta.get("unknown_fields", {})
    if not isinstance(kept, dict):
        raise ValueError("metadata.unknown_fields must be an object: it is where unknown "
                         "top-level fields are kept; rename that metadata field")
    meta["unknown_fields"] = {**kept, **unknown}
    data["metadata"] = meta


def parse_trajectory(record: Any, context: ParseContext | None = None) -> Trajectory:
    """Validate one decoded JSON value. Raises `ValueError` (incl. pydantic's) on bad input."""
    if not isinstance(record, dict):
        raise ValueError(f"a trajectory must be a JSON object, got {type(record).__name__}")
    return Trajectory.model_validate(normalize(record, context))



