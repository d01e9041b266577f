"""What the pipeline is doing, read from Postgres and Kafka at the moment of asking.

One source for `flywheel status --json` (`collect`), `GET /v1/status` (`overview` + `lag`)
and the Prometheus exposition (`flywheel.api.metrics`): each reads the same queries, so the three
never disagree.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiokafka.errors import KafkaError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.adapters import queries
from flywheel.adapters.registry import gate_activity, latest_baseline
from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.errors import unavailable
from flywheel.runtime.endpoints import StackNotRunning, read_run, resolve_bootstrap, resolve_db_url
from flywheel.runtime.kafka import consumer_groups, group_lag
from flywheel.runtime.logs import mask_secrets, mask_text
from flywheel.validation import store as validation_store

_COUNTS = text("""
SELECT (SELECT count(*) FROM trajectories)                          AS trajectories,
       (SELECT count(*) FROM trajectories t
          LEFT JOIN trajectory_outcomes o USING (trajectory_id)
         WHERE coalesce(o.is_failure, t.is_failure))                AS failures,
       (SELECT count(*) FROM trajectories t
          LEFT JOIN trajectory_outcomes o USING (trajectory_id)
         WHERE coalesce(o.status, t.status) = 'awaiting_outcome')   AS awaiting_outcome,
       (SELECT count(*) FROM feedback)                              AS feedback,
       (SELECT count(*) FROM feedback WHERE applied_at IS NOT NULL) AS feedback_applied,
       (SELECT count(*) FROM feedback
         WHERE applied_at IS NULL AND error IS NULL)                AS feedback_pending,
       (SELECT count(*) FROM feedback WHERE error IS NOT NULL)      AS feedback_parked,
       (SELECT count(*) FROM dead_letters)                          AS dlq,
       (SELECT count(*) FROM outbox WHERE published_at IS NULL AND error IS NULL)
                                                                    AS outbox_pending,
       (SELECT count(*) FROM outbox WHERE error IS NOT NULL)        AS outbox_parked,
       (SELECT count(*) FROM events)                                AS events,
       (SELECT count(*) FROM tasks)                                 AS tasks,
       (SELECT count(*) FROM tasks WHERE split = 'holdout')         AS tasks_holdout,
       (SELECT count(*) FROM failures WHERE status = 'unverifiable') AS unverifiable,
       (SELECT coalesce(max(version), 0) FROM eval_sets)            AS evalset_version,
       (SELECT count(*) FROM rollout_groups)                        AS groups,
       (SELECT count(*) FROM rollout_groups WHERE trainable)        AS groups_trainable,
       (SELECT count(*) FROM rollout_groups
         WHERE trainable AND trained_at IS NULL)                    AS groups_backlog,
       (SELECT count(*) FROM rollout_groups WHERE consumed_as = 'stale')
                                                                    AS groups_stale_dropped,
       (SELECT coalesce(sum(not_run), 0) FROM rollout_groups)       AS rollouts_not_run,
       (SELECT count(*) FROM rollout_requests WHERE status = 'requested')
                                                                    AS requests_outstanding,
       (SELECT count(*) FROM task_stats WHERE retired IS NOT NULL)  AS tasks_retired,
       (SELECT count(*) FROM evaluations WHERE state = 'pending')   AS pending_reviews
""")
_MODES = text("SELECT failure_mode, count(*) FROM failures GROUP BY 1 ORDER BY 1")
_SPLITS = text("""SELECT CASE WHEN v.task_id IS NOT NULL THEN 'validation' ELSE t.split END,
    count(*) FROM tasks t LEFT JOIN validation_tasks v USING (task_id) GROUP BY 1 ORDER BY 1""")
_TRAINER = text("""
SELECT state, detail, version, steps, stale_dropped, metrics,
       extract(epoch FROM now() - updated_at) AS heartbeat_age_s
FROM trainer_status ORDER BY updated_at DESC LIMIT 1
""")
_DLQ = text("""SELECT consumer, reason, count(*) FROM dead_letters GROUP BY 1, 2
               ORDER BY 1, 2""")
_BREAKDOWN = text("""
SELECT coalesce(f.failure_mode, t.failure_mode) AS failure_mode,
       coalesce(f.failures, 0) AS failures, coalesce(f.unverifiable, 0) AS unverifiable,
       coalesce(t.train, 0) AS tasks_train, coalesce(t.holdout, 0) AS tasks_holdout
FROM (SELECT failure_mode, count(*) AS failures,
             count(*) FILTER (WHERE status = 'unverifiable') AS unverifiable
      FROM failures GROUP BY 1) f
FULL JOIN (SELECT failure_mode, count(*) FILTER (WHERE split = 'train') AS train,
                  count(*) FILTER (WHERE split = 'holdout') AS holdout
           FROM tasks GROUP BY 1) t USING (failure_mode)
ORDER BY failures DESC, failure_mode
""")
# The newest evaluation of every evaluated version, in version order: the holdout curve.
_HOLDOUT = text("""
SELECT DISTINCT ON (version) version, evaluation_id, state, recommendation, created_at,
       baseline_version,
       (record->'candidate'->>'success_rate')::float AS success_rate,
       (record->'baseline'->>'success_rate')::float AS baseline_success_rate
FROM evaluations WHERE policy = :p ORDER BY version, created_at DESC
""")

TRAINER_DOWN_AFTER_S = 30.0
"""A trainer heartbeat older than this reads as state `down`."""
LAG_TIMEOUT_S = 5.0
LAG_CACHE_S = 3.0


GATE_ABSENT: dict[str, Any] = {
    "state": "absent", "version": None, "baseline_version": None, "eval_set_version": None,
    "round": 0, "rounds_planned": 0, "samples_done": 0, "samples_planned": 0, "detail": None,
    "power": None, "started_at": None, "elapsed_s": None, "heartbeat_age_s": None}


async def gate(conn: AsyncConnection, policy: str) -> dict[str, Any]:
    """The gate's activity (`flywheel.adapters.registry.gate_activity`) with `warning`: the
    newest eval set's power warning (None when it can see the gains it is asked to find)."""
    found = await gate_activity(conn, policy) or dict(GATE_ABSENT)
    found["warning"] = (found["power"] or {}).get("warning")
    return found


def _unfrozen(found: dict[str, Any], evalset_version: int, holdout: int) -> dict[str, Any]:
    """The gate's `warning` while holdout tasks wait for an eval set: nothing is decided,
    and the first training goes without a baseline, until one is frozen — the step a new
    user publishing logs misses (the gate only logs that it is retrying)."""
    if evalset_version == 0 and holdout > 0 and found["warning"] is None:
        found["warning"] = (f"no eval set is frozen: until `flywheel evalset freeze` freezes "
                            f"the holdout ({holdout} tasks now) the gate takes no baseline "
                            f"and decides no candidate, and after trainer.baseline_wait_s "
                            f"the first training starts GRPO without the warm start the "
                            f"baseline would choose")
    return found


async def counts(conn: AsyncConnection, policy: str) -> dict[str, Any]:
    """Every Postgres figure of `flywheel status --json` (all but `lag`)."""
    row = (await conn.execute(_COUNTS)).mappings().one()
    reasons: dict[str, int] = {}
    by_consumer: dict[str, dict[str, int]] = {}
    for consumer, reason, n in (await conn.execute(_DLQ)).all():
        reasons[reason] = reasons.get(reason, 0) + int(n)
        by_consumer.setdefault(consumer, {})[reason] = int(n)
    modes = {m: int(n) for m, n in (await conn.execute(_MODES)).all()}
    splits = {s: int(n) for s, n in (await conn.execute(_SPLITS)).all()}
    trainer = (await conn.execute(_TRAINER)).mappings().first()
    return {
        **{k: int(v) for k, v in row.items()},
        "dlq_by_reason": dict(sorted(reasons.items())),
        "dlq_by_consumer": by_consumer,
        "failure_modes": modes,
        "tasks_by_split": splits,
        "trainer": _trainer(trainer),
        "gate": _unfrozen(await gate(conn, policy), int(row["evalset_version"]),
                          int(row["tasks_holdout"])),
        "validation": await validation(conn, policy),
    }


async def validation(conn: AsyncConnection, policy: str) -> dict[str, Any]:
    """The validation pass: `state` (`absent` before any validation split, `ok`,
    `overfitting`: sampling paused until the miner adds tasks), `detail`, `tasks` (the
    validation split) and the newest scored version with its training reward and gap."""
    st = await validation_store.status(conn, policy)
    curve = await validation_store.curve_rows(conn, policy)
    return {"state": st["state"] if st else "absent", "detail": st["detail"] if st else None,
            "tasks": await validation_store.validation_count(conn),
            "newest": curve[-1] if curve else None}


async def lag(settings: Settings) -> dict[str, dict[str, Any]]:
    """Per consumer group: topic, total lag and lag per partition."""
    pairs = consumer_groups(settings)
    bootstrap = resolve_bootstrap(settings)
    found = await asyncio.gather(*(group_lag(bootstrap, g, t) for g, t in pairs))
    return {group: {"topic": topic, "total": sum(parts.values()), "partitions": parts}
            for (group, topic), parts in zip(pairs, found, strict=True)}


_lag_cache: dict[tuple[Any, ...], tuple[float, tuple[dict[str, Any], str | None]]] = {}


async def lag_or_error(settings: Settings, *, cached: bool = True
                       ) -> tuple[dict[str, dict[str, Any]], str | None]:
    """`lag`, or ({}, why) when no broker is configured or it does not answer within
    `LAG_TIMEOUT_S`: a status page must still show what Postgres knows while Kafka is down.

    Reading lag opens a consumer per group; the answer is reused for `LAG_CACHE_S`, so
    dashboard tabs and scrapers polling the API at once do not each pay for it."""
    key = (settings.kafka.bootstrap, settings.home, tuple(consumer_groups(settings)))
    now = time.monotonic()
    hit = _lag_cache.get(key)
    if cached and hit is not None and now - hit[0] < LAG_CACHE_S:
        return hit[1]
    try:
        async with asyncio.timeout(LAG_TIMEOUT_S):
            result: tuple[dict[str, Any], str | None] = (await lag(settings), None)
    except (KafkaError, OSError, TimeoutError, StackNotRunning) as err:
        result = {}, f"consumer lag unavailable: {str(err) or type(err).__name__}"
    _lag_cache[key] = (time.monotonic(), result)
    return result


def stack_state(settings: Settings) -> dict[str, Any] | None:
    """The local supervisor's view from run.json — its state, and per component (Postgres,
    the broker, each service) whether it is up, its pid, restarts and last error — with
    every secret masked. None when no local stack runs here."""
    try:
        run = read_run(settings)
    except (OSError, ValueError):
        return None
    if not run:
        return None
    keep = ("status", "supervisor_pid", "components", "broker", "updated_at", "started_at",
            "notes", "drain")
    state: dict[str, Any] = mask_secrets({k: run[k] for k in keep if k in run})
    return state


async def _postgres_counts(settings: Settings) -> tuple[dict[str, Any] | None, str | None]:
    """`counts`, or (None, why) when Postgres does not answer within `LAG_TIMEOUT_S`."""
    engine = make_engine(resolve_db_url(settings), pool_size=1)
    try:
        async with asyncio.timeout(LAG_TIMEOUT_S):
            async with engine.connect() as conn:
                return await counts(conn, settings.policy), None
    except Exception as err:
        if unavailable(err) is None:
            raise
        return None, describe_error(err)
    finally:
        await engine.dispose()


def describe_error(err: BaseException) -> str:
    """One line for a dependency error, secrets masked (a DSN may appear in it)."""
    return mask_text(f"{type(err).__name__}: {err}"[:300]) if str(err) else type(err).__name__


def dependency_report(db_error: str | None, lag_error: str | None) -> dict[str, Any]:
    """`dependencies` of every status answer: which of Postgres and Kafka answered."""
    return {"postgres": {"up": db_error is None, "error": db_error},
            "kafka": {"up": lag_error is None, "error": lag_error}}


async def collect(settings: Settings) -> dict[str, Any]:
    """`flywheel status --json`. Stable keys: trajectories, failures (with feedback applied),
    awaiting_outcome (stored without an outcome, none from feedback yet), feedback,
    feedback_applied, feedback_pending (its trajectory not stored yet), feedback_parked,
    dlq (dead letters of every consumer), dlq_by_reason, dlq_by_consumer ({consumer:
    {reason: n}}: ingest's refused input, and what the miner, its feedback subscriber,
    rollout workers, trainer or gate parked),
    outbox_pending, outbox_parked, events, tasks, tasks_holdout, tasks_by_split,
    unverifiable, evalset_version, groups, groups_trainable, groups_backlog,
    groups_stale_dropped, rollouts_not_run, requests_outstanding, tasks_retired,
    pending_reviews, failure_modes, trainer (state, version, steps, stale_dropped, metrics;
    state `down` when its heartbeat is older than 30 s), gate (state `idle`, `baseline`,
    `evaluating`, `down` or `absent`; the candidate, samples done / planned, elapsed_s, the
    newest eval set's power record with its MDE, and `warning`), lag (per consumer group),
    validation (state `absent`, `ok` or `overfitting`, detail, tasks, the newest scored
    version's validation success, training reward and gap),
    dependencies (`postgres` / `kafka`: up, error), stack (the local supervisor's view, or
    null). While Postgres is down only lag, dependencies and stack are there."""
    (data, db_error), (lags, lag_error) = await asyncio.gather(
        _postgres_counts(settings), lag_or_error(settings, cached=False))
    return {**(data or {}), "lag": lags, "dependencies": dependency_report(db_error, lag_error),
            "stack": stack_state(settings)}


async def overview(conn: AsyncConnection, settings: Settings) -> dict[str, Any]:
    """`counts` plus what the dashboard draws: the adapter lineage with each version's
    training metrics and holdout result, the holdout curve, the failure-mode breakdown, the
    production pointer and the newest baseline record (None before `flywheel baseline`)."""
    policy = settings.policy
    data = await counts(conn, policy)
    adapters = await queries.list_adapters(conn, policy)
    holdout = [{**row, "evaluation_id": str(row["evaluation_id"]),
                "created_at": row["created_at"].isoformat()}
               for row in (await conn.execute(_HOLDOUT, {"p": policy})).mappings()]
    breakdown = [dict(r) for r in (await conn.execute(_BREAKDOWN)).mappings()]
    return {
        **data,
        "policy": policy,
        "production": await queries.production(conn, policy),
        "adapters": adapters,
        "reward_curve": [{"version": a["version"], "steps": a["steps"],
                          "reward_mean": _number(a["metrics"].get("reward_mean")),
                          "loss": _number(a["metrics"].get("loss"))} for a in adapters],
        "holdout_curve": holdout,
        "validation_curve": await validation_store.curve_rows(conn, policy),
        "failure_breakdown": breakdown,
        "baseline": await latest_baseline(conn, policy),
    }


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _trainer(row: Any) -> dict[str, Any]:
    if row is None:
        return {"state": "absent", "detail": None, "version": None, "steps": 0,
                "stale_dropped": 0, "metrics": {}, "heartbeat_age_s": None}
    data = dict(row)
    age = float(data.pop("heartbeat_age_s"))
    if age > TRAINER_DOWN_AFTER_S and data["state"] not in {"stopped"}:
        data["state"], data["detail"] = "down", f"no heartbeat for {age:.0f}s"
    data["heartbeat_age_s"] = round(age, 1)
    return data
