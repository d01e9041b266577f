"""Every event in the system: frozen pydantic models in one union discriminated on `type`.

An event is immutable: appended to the `events` table and published through the outbox in the
same transaction as the domain write it describes. `aggregate_id` is the Kafka key, so one
aggregate's events stay ordered. Later stages add their events here.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

# Namespace of event ids derived from their cause (a Kafka position, …), so that re-processing
# the same input yields the same event id and the append is a no-op.
EVENT_ID_NAMESPACE = uuid.UUID("0d5e3f8a-7c41-4b8e-b1c2-5a6f9e2d4c37")


def derived_event_id(*parts: object) -> uuid.UUID:
    return uuid.uuid5(EVENT_ID_NAMESPACE, "/".join(str(p) for p in parts))


class _Payload(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    occurred_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    schema_version: int = 1
    aggregate_id: str


class DeadLetterPayload(_Payload):
    source_topic: str
    partition: int
    offset: int
    reason: Literal["not_json", "schema", "too_large"]
    error: str
    size_bytes: int
    raw_preview: str
    """The first KiB of the payload as text (the whole payload is in `dead_letters.raw`)."""


class DeadLettered(_Event):
    """An input could not be accepted; it was stored in `dead_letters` and sent to the DLQ."""

    type: Literal["DeadLettered"] = "DeadLettered"
    payload: DeadLetterPayload


class IngestedRange(_Payload):
    topic: str
    partition: int
    first_offset: int
    last_offset: int


class TrajectoriesIngestedPayload(_Payload):
    inserted: int
    """New rows (re-delivered duplicates excluded)."""
    duplicates: int
    failures: int
    """How many of the inserted trajectories are failures (miner input)."""
    dead_lettered: int
    ranges: list[IngestedRange]


class TrajectoriesIngested(_Event):
    """A batch of trajectories became durable in Postgres."""

    type: Literal["TrajectoriesIngested"] = "TrajectoriesIngested"
    payload: TrajectoriesIngestedPayload


class TaskCreatedPayload(_Payload):
    task_id: uuid.UUID
    env: str
    failure_mode: str
    split: Literal["train", "holdout"]
    fingerprint: str
    source_trajectory_id: uuid.UUID
    expected_from: str
    """Where the expected behaviour came from: human_correction, feedback, retry:<id>, tests."""


class TaskCreated(_Event):
    """A failure became a new verifiable task (duplicates only add a source, no event)."""

    type: Literal["TaskCreated"] = "TaskCreated"
    payload: TaskCreatedPayload


class EvalSetFrozenPayload(_Payload):
    version: int
    task_ids: list[uuid.UUID]


class EvalSetFrozen(_Event):
    """The holdout tasks of this moment became eval-set `version`, unchangeable from now on."""

    type: Literal["EvalSetFrozen"] = "EvalSetFrozen"
    payload: EvalSetFrozenPayload


Event = Annotated[DeadLettered | TrajectoriesIngested | TaskCreated | EvalSetFrozen,
                  Field(discriminator="type")]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def parse_event(data: bytes | str) -> Event:
    return EVENT_ADAPTER.validate_json(data)
