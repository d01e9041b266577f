"""`flywheel status`: pipeline counts from Postgres and consumer lag from Kafka."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.kafka import group_lag
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url

_COUNTS = text("""
SELECT (SELECT count(*) FROM trajectories)                          AS trajectories,
       (SELECT count(*) FROM trajectories WHERE is_failure)         AS failures,
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
       (SELECT coalesce(sum(not_run), 0) FROM rollout_groups)       AS rollouts_not_run,
       (SELECT count(*) FROM rollout_requests WHERE status = 'requested')
                                                                    AS requests_outstanding,
       (SELECT count(*) FROM task_stats WHERE retired IS NOT NULL)  AS tasks_retired
""")
_MODES = text("SELECT failure_mode, count(*) FROM failures GROUP BY 1 ORDER BY 1")
_TRAINER = text("""
SELECT state, detail, version, steps, stale_dropped, metrics,
       extract(epoch FROM now() - updated_at) AS heartbeat_age_s
FROM trainer_status ORDER BY updated_at DESC LIMIT 1
""")
_DLQ_REASONS = text("SELECT reason, count(*) FROM dead_letters GROUP BY reason ORDER BY reason")


async def collect(settings: Settings) -> dict[str, Any]:
    """Stable keys: trajectories, failures, dlq, dlq_by_reason, outbox_pending, outbox_parked,
    events, tasks,
    tasks_holdout, unverifiable, evalset_version, groups, groups_trainable, groups_backlog,
    rollouts_not_run, requests_outstanding, tasks_retired, failure_modes, trainer (state,
    version, steps, stale_dropped, metrics; state `down` when its heartbeat is older than 30 s),
    lag (per consumer group)."""
    engine = make_engine(resolve_db_url(settings), pool_size=1)
    try:
        async with engine.connect() as conn:
            row = (await conn.execute(_COUNTS)).mappings().one()
            reasons = {r: int(n) for r, n in (await conn.execute(_DLQ_REASONS)).all()}
            modes = {m: int(n) for m, n in (await conn.execute(_MODES)).all()}
            trainer = (await conn.execute(_TRAINER)).mappings().first()
    finally:
        await engine.dispose()
    bootstrap = resolve_bootstrap(settings)
    topics = settings.topics
    lag = {}
    for group, topic in ((settings.ingest.group_id, topics.trajectories),
                         (settings.miner.group_id, topics.trajectories),
                         (settings.rollout.group_id, topics.rollout_requests),
                         (settings.trainer.group_id, topics.rollouts)):
        parts = await group_lag(bootstrap, group, topic)
        lag[group] = {"topic": topic, "total": sum(parts.values()), "partitions": parts}
    return {
        **{k: int(v) for k, v in row.items()},
        "dlq_by_reason": reasons,
        "failure_modes": modes,
        "trainer": _trainer(trainer),
        "lag": lag,
    }


def _trainer(row: Any) -> dict[str, Any]:
    if row is None:
        return {"state": "absent", "version": None, "steps": 0, "stale_dropped": 0,
                "metrics": {}}
    data = dict(row)
    age = float(data.pop("heartbeat_age_s"))
    if age > 30 and data["state"] not in {"stopped"}:
        data["state"], data["detail"] = "down", f"no heartbeat for {age:.0f}s"
    data["heartbeat_age_s"] = round(age, 1)
    return data
