"""The adapter lifecycle, event-sourced: commands append events, `project` derives state.

Projections: `adapter_versions` (each version and its status), `evaluations` (decision
records), `production` (the pointer per policy, with a revision) and `serving_state` (what
the `production` alias resolves to). Every command runs in the caller's transaction: it locks
the policy's production row (serializing promotions and rollbacks per policy), checks its
preconditions, appends its event (events + outbox) and applies it with `project` — the same
function `replay` uses, so rebuilding from the log gives the identical state. Moving the
pointer is a conditional update on the expected revision: a promotion and a rollback that
race cannot both win.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.config import Topics
from flywheel.db.outbox import append_events
from flywheel.errors import PermanentError
from flywheel.events import (
    LIFECYCLE_EVENTS,
    AdapterEvaluated,
    AdapterEvaluatedPayload,
    AdapterPromoted,
    AdapterPromotedPayload,
    AdapterRejected,
    AdapterRejectedPayload,
    AdapterRolledBack,
    AdapterRolledBackPayload,
    AdapterTrained,
    CandidateProposed,
    Event,
    ServingSwitched,
    parse_event,
)

PROJECTIONS = ("evaluations", "production", "serving_state", "adapter_versions",
               "candidate_selections")


class LifecycleError(PermanentError, RuntimeError):
    """A command whose preconditions do not hold (the message says what to do instead)."""


class NotFound(LifecycleError):
    pass


class Conflict(LifecycleError):
    """State changed under the command (a concurrent promotion/rollback won)."""


def adapter_key(policy: str, version: int) -> str:
    return f"{policy}@v{version}"


# ---------------------------------------------------------------- projection

async def project(conn: AsyncConnection, event: Event) -> None:
    """Apply one lifecycle event to the projections (other events are ignored)."""
    if isinstance(event, AdapterTrained):
        p = event.payload
        await conn.execute(text("""INSERT INTO adapter_versions (policy, version, path,
                parent_version, stage, steps, groups, metrics, created_at, status)
            VALUES (:p, :v, :path, :parent, :stage, :steps, :groups, CAST(:m AS jsonb), :at,
                    :status) ON CONFLICT DO NOTHING"""),
            {"p": p.policy, "v": p.version, "path": p.path, "parent": p.parent_version,
             "stage": p.stage, "steps": p.steps, "groups": p.groups,
             "m": json.dumps(p.metrics), "at": event.occurred_at,
             "status": "candidate" if p.gate else "snapshot"})
    elif isinstance(event, AdapterEvaluated):
        await _project_evaluated(conn, event)
    elif isinstance(event, AdapterPromoted):
        q = event.payload
        await _move_pointer(conn, q.policy, q.version, q.expected_revision, event)
        await _set_status(conn, q.policy, q.version, "promoted")
        await _decide_evaluation(conn, q.evaluation_id, "promoted", q.actor, q.reason, event)
        await _supersede_pending(conn, q.policy)
    elif isinstance(event, AdapterRejected):
        r = event.payload
        await _set_status(conn, r.policy, r.version, "rejected")
        if r.evaluation_id is not None:
            await _decide_evaluation(conn, r.evaluation_id, "rejected", r.actor, r.reason, event)
    elif isinstance(event, AdapterRolledBack):
        b = event.payload
        await _move_pointer(conn, b.policy, b.to_version, b.expected_revision, event)
        if b.from_version is not None:
            await _set_status(conn, b.policy, b.from_version, "rolled_back")
        await _supersede_pending(conn, b.policy)
    elif isinstance(event, CandidateProposed):
        c = event.payload  # a snapshot the validation pass chose becomes a candidate
        await conn.execute(text("""UPDATE adapter_versions SET status = 'candidate'
            WHERE policy = :p AND version = :v AND status = 'snapshot'"""),
            {"p": c.policy, "v": c.version})
        await conn.execute(text("""INSERT INTO candidate_selections (policy, version,
                selection, created_at) VALUES (:p, :v, CAST(:s AS jsonb), :at)
            ON CONFLICT DO NOTHING"""),
            {"p": c.policy, "v": c.version, "s": c.model_dump_json(), "at": event.occurred_at})
    elif isinstance(event, ServingSwitched):
        s = event.payload
        await conn.execute(text("""INSERT INTO serving_state (policy, version, served_name,
                replicas, switched_at) VALUES (:p, :v, :n, CAST(:r AS jsonb), :at)
            ON CONFLICT (policy) DO UPDATE SET version = :v, served_name = :n,
                replicas = CAST(:r AS jsonb), switched_at = :at"""),
            {"p": s.policy, "v": s.version, "n": s.served_name, "r": json.dumps(s.replicas),
             "at": event.occurred_at})


async def _project_evaluated(conn: AsyncConnection, event: AdapterEvaluated) -> None:
    e = event.payload
    await conn.execute(text("""UPDATE evaluations SET state = 'superseded'
        WHERE policy = :p AND version = :v AND state = 'pending'"""),
        {"p": e.policy, "v": e.version})
    await conn.execute(text("""INSERT INTO evaluations (evaluation_id, policy, version,
            baseline_version, eval_set_version, mode, recommendation, state, record, created_at)
        VALUES (:id, :p, :v, :b, :es, :mode, :rec, 'pending', CAST(:record AS jsonb), :at)
        ON CONFLICT DO NOTHING"""),
        {"id": e.evaluation_id, "p": e.policy, "v": e.version, "b": e.baseline_version,
         "es": e.eval_set_version, "mode": e.mode, "rec": e.recommendation,
         "record": e.model_dump_json(), "at": event.occurred_at})
    await conn.execute(text("""UPDATE adapter_versions SET status = 'evaluated',
            evaluation_id = :id WHERE policy = :p AND version = :v"""),
        {"id": e.evaluation_id, "p": e.policy, "v": e.version})


async def _move_pointer(conn: AsyncConnection, policy: str, version: int | None,
                        expected: int, event: Event) -> None:
    await _ensure_pointer(conn, policy)
    actor = getattr(event.payload, "actor", None)
    moved = await conn.execute(text("""UPDATE production SET version = :v,
            revision = revision + 1, updated_at = :at, updated_by = :who
        WHERE policy = :p AND revision = :expected"""),
        {"p": policy, "v": version, "at": event.occurred_at, "who": actor,
         "expected": expected})
    if moved.rowcount != 1:
        raise Conflict(f"production of {policy!r} changed concurrently (expected revision "
                       f"{expected}); look at `flywheel adapters ls` and retry")


async def _ensure_pointer(conn: AsyncConnection, policy: str) -> None:
    await conn.execute(text("""INSERT INTO production (policy, version, revision)
        VALUES (:p, NULL, 0) ON CONFLICT DO NOTHING"""), {"p": policy})


async def _set_status(conn: AsyncConnection, policy: str, version: int, status: str) -> None:
    await conn.execute(text("""UPDATE adapter_versions SET status = :s
        WHERE policy = :p AND version = :v"""), {"p": policy, "v": version, "s": status})


async def _decide_evaluation(conn: AsyncConnection, evaluation_id: uuid.UUID, state: str,
                             actor: str, reason: str, event: Event) -> None:
    await conn.execute(text("""UPDATE evaluations SET state = :s, decided_by = :who,
            decided_at = :at, decision_reason = :why WHERE evaluation_id = :id"""),
        {"s": state, "who": actor, "at": event.occurred_at, "why": reason,
         "id": evaluation_id})


async def _supersede_pending(conn: AsyncConnection, policy: str) -> None:
    """Production moved: pending evaluations compared a candidate with the old production."""
    await conn.execute(text("""UPDATE evaluations SET state = 'superseded'
        WHERE policy = :p AND state = 'pending'
          AND baseline_version IS DISTINCT FROM
              (SELECT version FROM production WHERE policy = :p)"""), {"p": policy})


# ---------------------------------------------------------------- commands

async def apply_event(conn: AsyncConnection, event: Event, topics: Topics) -> Event:
    await project(conn, event)
    await append_events(conn, [event], topics)
    return event


async def lock_production(conn: AsyncConnection, policy: str) -> tuple[int | None, int]:
    """Lock the policy's pointer row for this transaction; (version, revision)."""
    await _ensure_pointer(conn, policy)
    row = (await conn.execute(text("""SELECT version, revision FROM production
        WHERE policy = :p FOR UPDATE"""), {"p": policy})).one()
    return row.version, row.revision


async def record_evaluation(conn: AsyncConnection, payload: AdapterEvaluatedPayload,
                            topics: Topics) -> list[Event]:
    """Record the decision; in `auto` mode also carry it out (promote or reject). An
    `incomplete` evaluation is recorded and left pending: neither a promotion nor a verdict
    on the candidate (re-evaluate it once the infrastructure is back)."""
    current, _ = await lock_production(conn, payload.policy)
    if current != payload.baseline_version:
        raise Conflict(f"production of {payload.policy!r} moved to {version_label(current)} while "
                       f"{version_label(payload.baseline_version)} was the baseline; re-evaluate")
    events: list[Event] = [await apply_event(conn, AdapterEvaluated(
        aggregate_id=adapter_key(payload.policy, payload.version), payload=payload), topics)]
    if payload.mode == "auto":
        reason = " ".join(payload.reasons)
        if payload.recommendation == "promote":
            events.append(await approve(conn, payload.evaluation_id, actor="gate",
                                        reason=reason, topics=topics))
        elif payload.recommendation == "reject":
            events.append(await reject(conn, payload.evaluation_id, actor="gate",
                                       reason=reason, topics=topics))
    return events


async def _evaluation(conn: AsyncConnection, evaluation_id: uuid.UUID) -> Any:
    row = (await conn.execute(text("""SELECT e.*, a.status AS adapter_status
        FROM evaluations e LEFT JOIN adapter_versions a USING (policy, version)
        WHERE e.evaluation_id = :id"""), {"id": evaluation_id})).mappings().first()
    if row is None:
        raise NotFound(f"no evaluation {evaluation_id}: see `flywheel promotions ls`")
    return row


async def approve(conn: AsyncConnection, evaluation_id: uuid.UUID, *, actor: str, reason: str,
                  topics: Topics, force: bool = False) -> AdapterPromoted:
    ev = await _evaluation(conn, evaluation_id)
    current, revision = await lock_production(conn, ev["policy"])
    ev = await _evaluation(conn, evaluation_id)  # re-read under the lock
    name = adapter_key(ev["policy"], ev["version"])
    if ev["state"] != "pending":
        raise LifecycleError(f"evaluation {evaluation_id} of {name} is already "
                             f"{ev['state']}" + (f" (by {ev['decided_by']})"
                                                 if ev["decided_by"] else ""))
    if ev["adapter_status"] != "evaluated":
        raise LifecycleError(f"{name} is {ev['adapter_status']}: it needs a new evaluation "
                             "before it can be promoted")
    if current != ev["baseline_version"]:
        raise Conflict(f"production moved to {version_label(current)} since this evaluation "
                       f"compared {name} with {version_label(ev['baseline_version'])}; re-evaluate")
    if ev["recommendation"] == "incomplete":  # no verdict to override: never a promotion
        raise LifecycleError(f"the evaluation of {name} is incomplete "
                             f"({'; '.join(ev['record']['reasons'][:1])}); re-evaluate it "
                             "(`flywheel gate evaluate`) before promoting")
    if ev["recommendation"] != "promote" and not force:
        raise LifecycleError(f"the gate recommended rejecting {name} "
                             f"({'; '.join(ev['record']['reasons'])}); pass --force to "
                             "promote against its recommendation")
    if ev["recommendation"] != "promote":
        reason = f"{reason} (overriding the gate's reject recommendation)"
    event = AdapterPromoted(aggregate_id=name, payload=AdapterPromotedPayload(
        policy=ev["policy"], version=ev["version"], previous_version=current,
        evaluation_id=evaluation_id, expected_revision=revision, actor=actor, reason=reason))
    await apply_event(conn, event, topics)
    return event


async def reject(conn: AsyncConnection, evaluation_id: uuid.UUID, *, actor: str, reason: str,
                 topics: Topics) -> AdapterRejected:
    ev = await _evaluation(conn, evaluation_id)
    await lock_production(conn, ev["policy"])
    ev = await _evaluation(conn, evaluation_id)
    name = adapter_key(ev["policy"], ev["version"])
    if ev["state"] != "pending":
        raise LifecycleError(f"evaluation {evaluation_id} of {name} is already {ev['state']}")
    event = AdapterRejected(aggregate_id=name, payload=AdapterRejectedPayload(
        policy=ev["policy"], version=ev["version"], evaluation_id=evaluation_id, actor=actor,
        reason=reason))
    await apply_event(conn, event, topics)
    return event


async def reject_unevaluated(conn: AsyncConnection, policy: str, version: int, *, actor: str,
                             reason: str, topics: Topics) -> AdapterRejected:
    await lock_production(conn, policy)
    event = AdapterRejected(aggregate_id=adapter_key(policy, version),
                            payload=AdapterRejectedPayload(policy=policy, version=version,
                                                           evaluation_id=None, actor=actor,
                                                           reason=reason))
    await apply_event(conn, event, topics)
    return event


BASE = -1
"""`rollback(to=BASE)`: back to the base model (no adapter)."""


async def rollback(conn: AsyncConnection, policy: str, *, to: int | None, actor: str,
                   reason: str, topics: Topics) -> AdapterRolledBack:
    """Re-point production to an earlier promoted version (default: the one before). From
    the base model (after a rollback to it), `to` names the version to return to."""
    current, revision = await lock_production(conn, policy)
    if current is None and to in (None, BASE):
        raise LifecycleError(f"nothing to roll back: {policy!r} serves the base model")
    target: int | None
    if to is None and current is not None:
        target = await _previous_production(conn, policy, current)
    elif to == BASE:
        target = None
    elif to is not None:
        status = (await conn.execute(text("""SELECT status FROM adapter_versions
            WHERE policy = :p AND version = :v"""), {"p": policy, "v": to})).scalar()
        if status is None:
            raise NotFound(f"{adapter_key(policy, to)} does not exist")
        if to == current:
            raise LifecycleError(f"{adapter_key(policy, to)} is already production")
        if status != "promoted":
            raise LifecycleError(f"{adapter_key(policy, to)} is {status}; only a version that "
                                 "was promoted before can be rolled back to")
        target = to
    else:
        raise AssertionError("unreachable: no target")
    event = AdapterRolledBack(aggregate_id=adapter_key(policy, current) if current is not None
                              else f"{policy}@base",
                              payload=AdapterRolledBackPayload(
                                  policy=policy, from_version=current, to_version=target,
                                  expected_revision=revision, actor=actor, reason=reason))
    await apply_event(conn, event, topics)
    return event


async def _previous_production(conn: AsyncConnection, policy: str, current: int
                               ) -> int | None:
    """The newest earlier production version still `promoted` (None = the base model)."""
    history = (await conn.execute(text("""SELECT payload FROM events
        WHERE type = 'AdapterPromoted' AND payload->>'policy' = :p ORDER BY seq"""),
        {"p": policy})).scalars().all()
    statuses: dict[int, str] = dict((await conn.execute(text("""SELECT version, status
        FROM adapter_versions WHERE policy = :p"""), {"p": policy})).all())
    for payload in reversed(history):
        v = payload["version"]
        if v != current and statuses.get(v) == "promoted":
            return int(v)
    return None


def version_label(version: int | None) -> str:
    """`vN`, or `the base model` for no adapter (in messages and logs)."""
    return "the base model" if version is None else f"v{version}"


# ---------------------------------------------------------------- replay

async def replay(conn: AsyncConnection) -> int:
    """Drop every lifecycle projection and rebuild it from the event log, in log order."""
    await conn.execute(text("LOCK TABLE production, evaluations, serving_state, "
                            "adapter_versions, candidate_selections IN ACCESS EXCLUSIVE MODE"))
    for table in PROJECTIONS:
        await conn.execute(text(f"DELETE FROM {table}"))
    rows = (await conn.execute(text("""SELECT type, aggregate_id, event_id, occurred_at,
            schema_version, payload FROM events WHERE type = ANY(:types) ORDER BY seq"""),
        {"types": list(LIFECYCLE_EVENTS)})).mappings().all()
    for row in rows:
        event = parse_event(json.dumps({
            "type": row["type"], "aggregate_id": row["aggregate_id"],
            "event_id": str(row["event_id"]), "occurred_at": row["occurred_at"].isoformat(),
            "schema_version": row["schema_version"], "payload": row["payload"]}))
        await project(conn, event)
    return len(rows)


async def snapshot(conn: AsyncConnection) -> dict[str, list[dict[str, Any]]]:
    """Every lifecycle projection row, in a stable order (what `replay` must reproduce)."""
    order = {"evaluations": "evaluation_id", "production": "policy",
             "serving_state": "policy", "adapter_versions": "policy, version",
             "candidate_selections": "policy, version"}
    out: dict[str, list[dict[str, Any]]] = {}
    for table in PROJECTIONS:
        rows = (await conn.execute(text(f"SELECT * FROM {table} ORDER BY {order[table]}")
                                   )).mappings().all()
        out[table] = [json.loads(json.dumps(dict(r), default=str)) for r in rows]
    return out
