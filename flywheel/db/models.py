"""Tables. The Alembic migrations in `migrations/` must match these exactly (a test checks)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class TrajectoryRow(Base):
    __tablename__ = "trajectories"

    trajectory_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    agent: Mapped[str] = mapped_column(Text)
    session_id: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(Text)
    is_failure: Mapped[bool] = mapped_column(Boolean)
    model: Mapped[str | None] = mapped_column(Text)
    adapter_version: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ingested_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )
    source_topic: Mapped[str | None] = mapped_column(Text)
    source_partition: Mapped[int | None] = mapped_column(Integer)
    source_offset: Mapped[int | None] = mapped_column(BigInteger)
    record: Mapped[dict[str, Any]] = mapped_column(JSONB)

    __table_args__ = (
        Index("ix_trajectories_agent_session", "agent", "session_id"),
        Index("ix_trajectories_failures", "ingested_at", postgresql_where=text("is_failure")),
        # Feedback may name a trajectory by the request's id (e.g. the response's `id`).
        Index("ix_trajectories_request_id", text("((record -> 'metadata') ->> 'request_id')")),
    )


class EventRow(Base):
    """Append-only log of every domain event (projections are rebuilt from it)."""

    __tablename__ = "events"

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    event_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), unique=True)
    type: Mapped[str] = mapped_column(Text)
    aggregate_id: Mapped[str] = mapped_column(Text)
    occurred_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    schema_version: Mapped[int] = mapped_column(Integer)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONB)
    recorded_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )

    __table_args__ = (Index("ix_events_type_seq", "type", "seq"),)


class OutboxRow(Base):
    """Messages to publish, written in the domain transaction; the relay publishes them."""

    __tablename__ = "outbox"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    event_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), unique=True)
    topic: Mapped[str] = mapped_column(Text)
    key: Mapped[str] = mapped_column(Text)
    value: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )
    published_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    error: Mapped[str | None] = mapped_column(Text)
    """Why the broker refused the row for good (e.g. too large): parked, shown in status."""

    __table_args__ = (
        Index("ix_outbox_pending", "id", postgresql_where=text("published_at IS NULL")),
    )


class DeadLetterRow(Base):
    """A message some consumer could not process: refused by ingest (`DeadLettered`) or
    parked by a downstream consumer (`RecordParked`). Each consumer reads the topic on its
    own, so one message can be a dead letter of several, once each."""

    __tablename__ = "dead_letters"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    consumer: Mapped[str] = mapped_column(Text, server_default=text("'ingest'"))
    topic: Mapped[str] = mapped_column(Text)
    partition: Mapped[int] = mapped_column(Integer)
    offset: Mapped[int] = mapped_column(BigInteger)
    key: Mapped[bytes | None] = mapped_column(LargeBinary)
    raw: Mapped[bytes] = mapped_column(LargeBinary)
    reason: Mapped[str] = mapped_column(Text)
    error: Mapped[str] = mapped_column(Text)
    received_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )

    # One dead letter per consumer and source position: a redelivery is not counted twice.
    __table_args__ = (
        UniqueConstraint("consumer", "topic", "partition", "offset",
                         name="uq_dead_letters_position"),
    )


class FailureRow(Base):
    """One row per mined failed trajectory: its classification and what became of it."""

    __tablename__ = "failures"

    trajectory_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    agent: Mapped[str] = mapped_column(Text)
    session_id: Mapped[str | None] = mapped_column(Text)
    request_key: Mapped[str | None] = mapped_column(Text)
    failure_mode: Mapped[str] = mapped_column(Text)
    evidence: Mapped[dict[str, Any]] = mapped_column(JSONB)
    status: Mapped[str] = mapped_column(Text)
    """`task` (became or joined a task) or `unverifiable` (may still be upgraded by a retry)."""
    reason: Mapped[str | None] = mapped_column(Text)
    task_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    record: Mapped[dict[str, Any]] = mapped_column(JSONB)
    mined_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())

    __table_args__ = (
        Index("ix_failures_session_request", "session_id", "request_key"),
        Index("ix_failures_status", "status"),
    )


class FeedbackRow(Base):
    """Feedback as received, in arrival order; `applied_to` once it met its trajectory."""

    __tablename__ = "feedback"

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    feedback_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), unique=True)
    trajectory_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    """The trajectory it names (or NULL: it names the request instead)."""
    request_id: Mapped[str | None] = mapped_column(Text)
    record: Mapped[dict[str, Any]] = mapped_column(JSONB)
    received_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now())
    applied_to: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    applied_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    error: Mapped[str | None] = mapped_column(Text)
    """Why applying it failed for good (parked, shown in status); NULL otherwise."""

    __table_args__ = (
        Index("ix_feedback_pending", "seq",
              postgresql_where=text("applied_at IS NULL AND error IS NULL")),
        Index("ix_feedback_applied_to", "applied_to"),
    )


class TrajectoryOutcomeRow(Base):
    """Projection of the feedback log: a trajectory with its feedback applied. No row: the
    trajectory stands as ingested."""

    __tablename__ = "trajectory_outcomes"

    trajectory_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    status: Mapped[str] = mapped_column(Text)
    is_failure: Mapped[bool] = mapped_column(Boolean)
    feedback_count: Mapped[int] = mapped_column(Integer)
    record: Mapped[dict[str, Any]] = mapped_column(JSONB)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now())


class SessionSuccessRow(Base):
    """Successful trajectories by session and request: a later retry can verify a failure."""

    __tablename__ = "session_successes"

    trajectory_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    session_id: Mapped[str] = mapped_column(Text)
    request_key: Mapped[str] = mapped_column(Text)
    record: Mapped[dict[str, Any]] = mapped_column(JSONB)

    __table_args__ = (Index("ix_session_successes_key", "session_id", "request_key"),)


class TaskRow(Base):
    __tablename__ = "tasks"

    task_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(Text, unique=True)
    env: Mapped[str] = mapped_column(Text)
    failure_mode: Mapped[str] = mapped_column(Text)
    split: Mapped[str] = mapped_column(Text)
    expected_from: Mapped[str] = mapped_column(Text)
    spec: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now())

    __table_args__ = (Index("ix_tasks_split_env", "split", "env"),)


class TaskSourceRow(Base):
    """Provenance: every trajectory that produced (a duplicate of) the task."""

    __tablename__ = "task_sources"

    task_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("tasks.task_id"), primary_key=True)
    trajectory_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    added_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())

    __table_args__ = (Index("ix_task_sources_trajectory", "trajectory_id"),)


class EvalSetRow(Base):
    __tablename__ = "eval_sets"

    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    frozen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    task_count: Mapped[int] = mapped_column(Integer)


class EvalSetTaskRow(Base):
    __tablename__ = "eval_set_tasks"

    version: Mapped[int] = mapped_column(
        Integer, ForeignKey("eval_sets.version"), primary_key=True)
    task_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("tasks.task_id"), primary_key=True)


class TaskStatsRow(Base):
    """Per-task sampling record: drives selection (prefer 0 < success < 1) and retirement."""

    __tablename__ = "task_stats"

    task_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("tasks.task_id"), primary_key=True)
    groups: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    successes: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    not_run: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    retired: Mapped[str | None] = mapped_column(Text)
    """Why the task is no longer sampled (`always_solved`, `never_solved`), or NULL."""
    last_sampled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class RolloutRequestRow(Base):
    """Work handed to rollout workers; one scored group answers one request."""

    __tablename__ = "rollout_requests"

    request_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    task_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), ForeignKey("tasks.task_id"))
    adapter_version: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(Text)
    """`requested` → `done` | `failed`."""
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now())
    done_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_rollout_requests_status", "status"),)


class RolloutGroupRow(Base):
    """A scored group of G attempts at one task by one policy version."""

    __tablename__ = "rollout_groups"

    group_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    task_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), ForeignKey("tasks.task_id"))
    adapter_version: Mapped[int | None] = mapped_column(Integer)
    """Policy version that sampled the group (NULL = the base model)."""
    env: Mapped[str] = mapped_column(Text)
    scored: Mapped[int] = mapped_column(Integer)
    not_run: Mapped[int] = mapped_column(Integer)
    reward_mean: Mapped[float | None] = mapped_column(Float)
    reward_std: Mapped[float | None] = mapped_column(Float)
    success_rate: Mapped[float | None] = mapped_column(Float)
    trainable: Mapped[bool] = mapped_column(Boolean)
    """False for zero-variance or too-small groups: recorded, never sent to training."""
    rollouts: Mapped[list[dict[str, Any]]] = mapped_column(JSONB)
    worker: Mapped[str] = mapped_column(Text)
    duration_ms: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now())
    trained_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    """When the trainer consumed the group (trained on it, or dropped it as stale)."""
    consumed_as: Mapped[str | None] = mapped_column(Text)
    """`trained` (in adapter version `trained_version`) or `stale` (dropped, counted)."""
    trained_version: Mapped[int | None] = mapped_column(Integer)

    __table_args__ = (
        UniqueConstraint("task_id", "group_id", name="uq_rollout_groups_task_group"),
        Index("ix_rollout_groups_backlog", "created_at",
              postgresql_where=text("trainable AND trained_at IS NULL")),
    )


class AdapterVersionRow(Base):
    """Registry of immutable adapter versions (written by the trainer, read by workers)."""

    __tablename__ = "adapter_versions"

    policy: Mapped[str] = mapped_column(Text, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str] = mapped_column(Text)
    """Directory of the PEFT adapter in the artifact store."""
    parent_version: Mapped[int | None] = mapped_column(Integer)
    stage: Mapped[str] = mapped_column(Text, server_default=text("'grpo'"))
    steps: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now())
    status: Mapped[str] = mapped_column(Text, server_default=text("'candidate'"))
    """Lifecycle (a projection of the event log): `candidate` → `evaluated` (awaiting review)
    → `promoted` | `rejected`; `rolled_back` once production moved away from it by rollback;
    `snapshot`: published for sampling, not proposed to the gate (an operator may still
    evaluate it)."""
    groups: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    metrics: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'"))
    """The trainer's last step metrics for this version (loss, reward_mean, …)."""
    evaluation_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    """The newest gate evaluation of this version."""


class EvaluationRow(Base):
    """Gate decision records (projection of `AdapterEvaluated` and the decisions on it)."""

    __tablename__ = "evaluations"

    evaluation_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    policy: Mapped[str] = mapped_column(Text)
    version: Mapped[int] = mapped_column(Integer)
    baseline_version: Mapped[int | None] = mapped_column(Integer)
    eval_set_version: Mapped[int] = mapped_column(Integer)
    mode: Mapped[str] = mapped_column(Text)
    recommendation: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(Text)
    """`pending` (manual mode, awaiting an operator), `promoted`, `rejected`, `superseded`."""
    record: Mapped[dict[str, Any]] = mapped_column(JSONB)
    """The whole `AdapterEvaluated` payload: both sides' metrics, thresholds, test, reasons."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    decided_by: Mapped[str | None] = mapped_column(Text)
    decided_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    decision_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (Index("ix_evaluations_policy_created", "policy", "created_at"),)


class ProductionRow(Base):
    """The production pointer per policy (projection); `revision` orders every change."""

    __tablename__ = "production"

    policy: Mapped[str] = mapped_column(Text, primary_key=True)
    version: Mapped[int | None] = mapped_column(Integer)
    """None = the base model."""
    revision: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    updated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    updated_by: Mapped[str | None] = mapped_column(Text)


class ServingStateRow(Base):
    """What the `production` alias resolves to on the serving replicas (projection)."""

    __tablename__ = "serving_state"

    policy: Mapped[str] = mapped_column(Text, primary_key=True)
    version: Mapped[int | None] = mapped_column(Integer)
    served_name: Mapped[str] = mapped_column(Text)
    replicas: Mapped[list[str]] = mapped_column(JSONB)
    switched_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class EvalRunRow(Base):
    """Cache of holdout evaluations of one version under one gate configuration, so the
    production side is not re-sampled for every candidate (not a projection)."""

    __tablename__ = "eval_runs"

    key: Mapped[str] = mapped_column(Text, primary_key=True)
    policy: Mapped[str] = mapped_column(Text)
    version: Mapped[int | None] = mapped_column(Integer)
    eval_set_version: Mapped[int] = mapped_column(Integer)
    result: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now())


class BaselineRow(Base):
    """`flywheel baseline`: base model (and production) on the frozen holdout, with the
    recommended next stage."""

    __tablename__ = "baselines"

    baseline_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    policy: Mapped[str] = mapped_column(Text)
    eval_set_version: Mapped[int] = mapped_column(Integer)
    record: Mapped[dict[str, Any]] = mapped_column(JSONB)
    recommendation: Mapped[str] = mapped_column(Text)
    """`sft`, `grpo` or `more_tasks`."""
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now())


class GateStatusRow(Base):
    """What the gate is doing (an evaluation or a baseline in progress, with its progress)
    and what the newest eval set can see: a heartbeat row per policy, not a projection."""

    __tablename__ = "gate_status"

    policy: Mapped[str] = mapped_column(Text, primary_key=True)
    state: Mapped[str] = mapped_column(Text)
    """`idle`, `baseline` (measuring the base model) or `evaluating` (a candidate)."""
    version: Mapped[int | None] = mapped_column(Integer)
    """The candidate being evaluated (None: the base model, during a baseline)."""
    baseline_version: Mapped[int | None] = mapped_column(Integer)
    """Production it is compared with (None = the base model)."""
    eval_set_version: Mapped[int | None] = mapped_column(Integer)
    round: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    rounds_planned: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    samples_done: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    """Candidate attempts sampled so far in this evaluation."""
    samples_planned: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    """Candidate attempts at the budget (the sequential test usually stops sooner)."""
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    detail: Mapped[str | None] = mapped_column(Text)
    power: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    """The newest eval set's power record (`GatePower`): its MDE and any warning."""


class TrainerStatusRow(Base):
    """The trainer's heartbeat: an explicit state instead of a silent hang."""

    __tablename__ = "trainer_status"

    policy: Mapped[str] = mapped_column(Text, primary_key=True)
    state: Mapped[str] = mapped_column(Text)
    """`starting`, `waiting` (batch filling), `training`, `starved`, `stalled`, `stopped`,
    `overfitting` (idle: the validation pass paused sampling until more tasks are mined)."""
    detail: Mapped[str | None] = mapped_column(Text)
    version: Mapped[int | None] = mapped_column(Integer)
    steps: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    stale_dropped: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    metrics: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'"))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class OtelSpanRow(Base):
    """A GenAI span the OTLP receiver took (`POST /v1/traces`), kept until its trajectory is
    complete (every trace in it has its root span) and after, so that a late span of a
    finished trace is merged into the same trajectory: the whole group is re-sent."""

    __tablename__ = "otel_spans"

    trajectory_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    trace_id: Mapped[str] = mapped_column(Text, primary_key=True)
    span_id: Mapped[str] = mapped_column(Text, primary_key=True)
    is_root: Mapped[bool] = mapped_column(Boolean)
    span: Mapped[dict[str, Any]] = mapped_column(JSONB)
    received_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )

    __table_args__ = (Index("ix_otel_spans_trace_id", "trace_id"),)


class ValidationTaskRow(Base):
    """The validation split: training tasks the trainer never updates on (sticky once
    assigned; `flywheel.validation.split`). The frozen holdout is never among them."""

    __tablename__ = "validation_tasks"

    task_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("tasks.task_id"), primary_key=True)
    stratum: Mapped[str] = mapped_column(Text)
    """`<failure mode>|<tool>`: what the share is stratified by."""
    assigned_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now())


class ValidationRunRow(Base):
    """One version scored on the validation tasks (cache keyed like the gate's rounds)."""

    __tablename__ = "validation_runs"

    key: Mapped[str] = mapped_column(Text, primary_key=True)
    policy: Mapped[str] = mapped_column(Text)
    version: Mapped[int | None] = mapped_column(Integer)
    """None = the base model (production before any promotion)."""
    tasks: Mapped[int] = mapped_column(Integer)
    samples: Mapped[int] = mapped_column(Integer)
    success_rate: Mapped[float] = mapped_column(Float)
    reward_mean: Mapped[float] = mapped_column(Float)
    seconds: Mapped[float] = mapped_column(Float)
    """Wall time of the pass (what validation cost this version)."""
    result: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now())

    __table_args__ = (Index("ix_validation_runs_policy", "policy", "version"),)


class ValidationStatusRow(Base):
    """The validation pass's state per policy: `ok`, `overfitting` (sampling paused until
    the pool grows), with the train-task count the pause waits to see grow."""

    __tablename__ = "validation_status"

    policy: Mapped[str] = mapped_column(Text, primary_key=True)
    state: Mapped[str] = mapped_column(Text)
    detail: Mapped[str | None] = mapped_column(Text)
    train_tasks: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    """Train tasks when the state was entered (an overfitting pause ends once it grows)."""
    after_version: Mapped[int | None] = mapped_column(Integer)
    """The overfitting alarm looks only at versions after this one (set when a pause
    ends: the versions before it were already judged)."""
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class CandidateSelectionRow(Base):
    """How a version became a candidate when validation chose it (a projection of
    `CandidateProposed`); versions the trainer proposed at publication have no row."""

    __tablename__ = "candidate_selections"

    policy: Mapped[str] = mapped_column(Text, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    selection: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

class ServedResponseRow(Base):
    """A `POST /v1/responses` answer kept for `previous_response_id` chaining (and
    `GET /v1/responses/{id}`); bounded: only the newest `api.responses_kept` are kept."""

    __tablename__ = "served_responses"

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    response_id: Mapped[str] = mapped_column(Text, unique=True)
    conversation: Mapped[list[Any]] = mapped_column(JSONB)
    """The chat messages through this answer (its instructions left out: a chained call
    does not inherit them), as the chat format renders them."""
    body: Mapped[dict[str, Any]] = mapped_column(JSONB)
    """The `response` object as it was answered."""
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now())


class ToolsetRow(Base):
    """One registered version of a toolset (a projection of `ToolsetRegistered` /
    `ToolsetRemoved`): the configuration as given (secrets included, unlike the event) and
    the tools read from the backend."""

    __tablename__ = "toolsets"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(Text)
    config: Mapped[dict[str, Any]] = mapped_column(JSONB)
    tools: Mapped[list[Any]] = mapped_column(JSONB)
    protocol_version: Mapped[str | None] = mapped_column(Text)
    protocol_tools: Mapped[list[Any]] = mapped_column(JSONB)
    digest: Mapped[str] = mapped_column(Text)
    registered_by: Mapped[str] = mapped_column(Text)
    registered_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now())
    removed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    """Set on the newest version when the toolset was removed."""
