"""`GET /metrics` and `GET /v1/status` on real Postgres and Kafka: the exposition parses, every
family is there, and the values are the seeded rows (and the real consumer lag)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import httpx
import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import lifecycle
from flywheel.api.metrics import metrics_router
from flywheel.api.operator import operator_lifespan, operator_router
from flywheel.config import GateSettings, Settings
from flywheel.demo.watch import finished, read_progress
from flywheel.events import AdapterEvaluated, Event
from flywheel.gate.power import report
from flywheel.observe.status import collect
from flywheel.runtime.kafka import ensure_topics
from flywheel.stack.broker import free_port
from flywheel.web.app import create_app
from tests.support.helpers import produce
from tests.test_adapters_lifecycle import evaluate, train, with_mode

pytestmark = [pytest.mark.postgres, pytest.mark.kafka]


@dataclass
class Seeded:
    pending: uuid.UUID
    outbox: int


async def seed_pipeline(pg_dsn: str) -> None:
    """Rows of every pipeline table the status reads, with hand-countable totals."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        ids = [uuid.uuid4() for _ in range(6)]
        for i, tid in enumerate(ids):
            status = "failure" if i < 2 else "success" if i < 5 else "awaiting_outcome"
            await conn.execute("""INSERT INTO trajectories (trajectory_id, agent, status,
                is_failure, record) VALUES ($1, 'bot', $2, $3, '{}')""", tid, status, i < 2)
        # Feedback: a thumbs-down turned success #2 into a failure; one waits for its
        # trajectory, one could not be applied.
        await conn.execute("""INSERT INTO trajectory_outcomes (trajectory_id, status,
            is_failure, feedback_count, record) VALUES ($1, 'failure', true, 1, '{}')""", ids[2])
        for applied, error in ((ids[2], None), (None, None), (None, "broken")):
            await conn.execute("""INSERT INTO feedback (feedback_id, request_id, record,
                applied_to, applied_at, error) VALUES ($1, 'r', '{}', $2,
                CASE WHEN $2::uuid IS NULL THEN NULL ELSE now() END, $3)""",
                uuid.uuid4(), applied, error)
        for mode, status in (("wrong_tool", "task"), ("wrong_tool", "unverifiable"),
                             ("bad_arguments", "task")):
            await conn.execute("""INSERT INTO failures (trajectory_id, agent, failure_mode,
                evidence, status, record) VALUES ($1, 'bot', $2, '{}', $3, '{}')""",
                uuid.uuid4(), mode, status)
        tasks = []
        for i, (mode, split) in enumerate((("wrong_tool", "train"), ("bad_arguments", "train"),
                                           ("wrong_tool", "holdout"))):
            tasks.append(uuid.uuid4())
            await conn.execute("""INSERT INTO tasks (task_id, fingerprint, env, failure_mode,
                split, expected_from, spec) VALUES ($1, $2, 'tool_call', $3, $4, 'feedback',
                '{}')""", tasks[-1], f"fp{i}", mode, split)
        for offset, reason in enumerate(("invalid_json", "invalid_json", "too_large")):
            await conn.execute("""INSERT INTO dead_letters (topic, partition, "offset", raw,
                reason, error) VALUES ('t', 0, $1, 'x', $2, 'bad')""", offset, reason)
        # The same position parked by the miner too: each consumer's dead letter counts once.
        await conn.execute("""INSERT INTO dead_letters (consumer, topic, partition, "offset",
            raw, reason, error) VALUES ('miner', 't', 0, 0, 'x', 'bug', 'TypeError: …')""")
        for trainable, consumed in ((True, "stale"), (True, "trained"), (True, None),
                                    (False, None)):
            await conn.execute("""INSERT INTO rollout_groups (group_id, task_id, env, scored,
                not_run, trainable, rollouts, worker, duration_ms, trained_at, consumed_as)
                VALUES ($1, $2, 'tool_call', 8, 0, $3, '[]', 'w', 10,
                        CASE WHEN $4::text IS NULL THEN NULL ELSE now() END, $4)""",
                uuid.uuid4(), tasks[0], trainable, consumed)
        await conn.execute("""INSERT INTO trainer_status (policy, state, detail, version, steps,
            stale_dropped, metrics, updated_at) VALUES ('policy', 'training', NULL, 2, 7, 1,
            $1, now())""", json.dumps({"loss": 0.25, "reward_mean": 0.5,
                                       "tokens_per_s": 1200.0, "step_s": 1.5}))
        power = report(GateSettings(samples_per_task=4), tasks=10, discordance=None,
                       source="", production_success=None)
        await conn.execute("""INSERT INTO gate_status (policy, state, version,
            baseline_version, eval_set_version, round, rounds_planned, samples_done,
            samples_planned, started_at, updated_at, detail, power)
            VALUES ('policy', 'evaluating', 3, 1, 1, 2, 8, 40, 160,
                    now() - interval '90 seconds', now(), '40 pairs, gain +0.050', $1)""",
            power.model_dump_json())
    finally:
        await conn.close()


async def seed_lifecycle(engine: AsyncEngine, settings: Settings) -> uuid.UUID:
    """v1 promoted (manual approval), v2 evaluated and pending, v3 a fresh candidate."""
    s = with_mode(settings, "manual")
    await train(engine, s, 1)
    (first,) = await evaluate(engine, s, 1, rate=0.75, base_rate=0.25)
    async with engine.begin() as conn:
        await lifecycle.approve(conn, evaluation_id(first), actor="ops", reason="good",
                                topics=s.topics)
    await train(engine, s, 2)
    (second,) = await evaluate(engine, s, 2, rate=1.0, base_rate=0.75)
    await train(engine, s, 3)
    return evaluation_id(second)


def evaluation_id(event: Event) -> uuid.UUID:
    assert isinstance(event, AdapterEvaluated), event
    return event.payload.evaluation_id


@pytest.fixture
async def seeded(engine: AsyncEngine, settings: Settings, pg_dsn: str) -> Seeded:
    await seed_pipeline(pg_dsn)
    pending = await seed_lifecycle(engine, settings)
    # Three messages nobody consumed: ingest and the miner both lag by 3.
    await ensure_topics(settings.kafka.bootstrap or "", settings.topics.all(), partitions=1)
    await produce(settings.kafka.bootstrap or "", settings.topics.trajectories,
                  [b"{}", b"{}", b"{}"])
    conn = await asyncpg.connect(pg_dsn)
    try:
        outbox = int(await conn.fetchval("SELECT count(*) FROM outbox"))
    finally:
        await conn.close()
    return Seeded(pending, outbox)


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    s = settings.model_copy(update={"api": settings.api.model_copy(update={
        "tokens": {"reader": [], "ops": ["operate"]}, "serve": False})})
    app = create_app(s, routers=[operator_router(), metrics_router()],
                     lifespan_hooks=[operator_lifespan])
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
        yield client


def samples(exposition: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


async def test_metrics_exposition_matches_the_database(
        api: httpx.AsyncClient, seeded: Seeded, settings: Settings) -> None:
    r = await api.get("/metrics")  # no token: scrapers carry none
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = samples(r.text)

    def one(name: str, **labels: str) -> float:
        return m[name][tuple(sorted(labels.items()))]

    assert one("flywheel_trajectories_ingested_total") == 6
    assert one("flywheel_trajectories_failed_total") == 3  # 2 as ingested, 1 by feedback
    assert one("flywheel_trajectories_awaiting_outcome") == 1
    assert one("flywheel_feedback_received_total") == 3
    assert one("flywheel_feedback_applied_total") == 1
    assert one("flywheel_feedback_pending") == 1
    assert one("flywheel_feedback_parked") == 1
    assert one("flywheel_failures_mined_total", failure_mode="wrong_tool") == 2
    assert one("flywheel_failures_mined_total", failure_mode="bad_arguments") == 1
    assert one("flywheel_failures_unverifiable") == 1
    assert one("flywheel_tasks", split="train") == 2 and one("flywheel_tasks", split="holdout") == 1
    assert one("flywheel_dead_letters_total", consumer="ingest", reason="invalid_json") == 2
    assert one("flywheel_dead_letters_total", consumer="ingest", reason="too_large") == 1
    assert one("flywheel_dead_letters_total", consumer="miner", reason="bug") == 1
    assert one("flywheel_rollout_groups_scored_total") == 4
    assert one("flywheel_rollout_groups_trainable_total") == 3
    assert one("flywheel_rollout_groups_stale_dropped_total") == 1
    assert one("flywheel_rollout_groups_backlog") == 1
    # The trainer state is a labelled gauge: exactly one state is 1.
    states = {dict(k)["state"]: v for k, v in m["flywheel_trainer_state"].items()}
    assert states["training"] == 1 and sum(states.values()) == 1 and "down" in states
    assert one("flywheel_trainer_steps") == 7
    assert one("flywheel_trainer_loss") == 0.25
    assert one("flywheel_trainer_reward_mean") == 0.5
    assert one("flywheel_trainer_tokens_per_second") == 1200
    assert one("flywheel_trainer_step_seconds") == 1.5
    assert one("flywheel_adapter_versions", status="promoted") == 1
    assert one("flywheel_adapter_versions", status="evaluated") == 1
    assert one("flywheel_adapter_versions", status="candidate") == 1
    assert one("flywheel_adapter_versions", status="rejected") == 0
    assert one("flywheel_production_version") == 1
    assert one("flywheel_pending_reviews") == 1
    # The newest evaluation is v2 (100 % on the holdout) against production v1 (75 %).
    assert one("flywheel_last_evaluation_success_rate", side="candidate", version="2") == 1.0
    assert one("flywheel_last_evaluation_success_rate", side="production", version="1") == 0.75
    # The gate is evaluating v3 (40 of 160 samples, 90 s in) on an eval set it cannot see
    # the design gain on (10 tasks × k = 4, nothing known: MDE 0.947).
    gate = {dict(k)["state"]: v for k, v in m["flywheel_gate_state"].items()}
    assert gate["evaluating"] == 1 and sum(gate.values()) == 1 and "down" in gate
    assert one("flywheel_gate_samples_done") == 40 and one("flywheel_gate_samples_planned") == 160
    assert 89 <= one("flywheel_gate_elapsed_seconds") < 120
    assert abs(one("flywheel_gate_mde") - 0.947366) < 1e-5
    assert one("flywheel_gate_design_gain") == 0.1 and one("flywheel_gate_mde_warning") == 1
    assert one("flywheel_last_evaluation_samples") == 120  # v2: 30 tasks × 4
    assert 0 < one("flywheel_last_evaluation_mde") < 1
    # Per task group, paired: 30 tasks × 4 at 0.75 → 1.0: 30 pairs won, 90 tied.
    assert one("flywheel_last_evaluation_group_gain", group="env:tool_call") == 0.25
    assert one("flywheel_last_evaluation_group_p_value", group="env:tool_call") == 0.5 ** 30
    # What changed: v2 succeeds wherever v1 failed, and fails nowhere.
    assert one("flywheel_last_evaluation_changed_tasks", change="fixed") > 0
    assert one("flywheel_last_evaluation_changed_tasks", change="broken") == 0
    assert one("flywheel_last_evaluation_behaviour", side="candidate", figure="empty_rate") == 0
    assert one("flywheel_outbox_pending") == seeded.outbox > 0
    assert one("flywheel_kafka_up") == 1
    topics = settings.topics
    assert one("flywheel_consumer_lag", group="flywheel-ingest", topic=topics.trajectories) == 3
    assert one("flywheel_consumer_lag", group="flywheel-miner", topic=topics.trajectories) == 3
    assert one("flywheel_consumer_lag", group="flywheel-miner-feedback",
               topic=topics.feedback) == 0
    assert one("flywheel_consumer_lag", group="flywheel-trainer", topic=topics.rollouts) == 0

    # Prometheus 3 asks for OpenMetrics first: same families, that format.
    r = await api.get("/metrics", headers={"Accept": "application/openmetrics-text; "
                                           "version=1.0.0, text/plain; version=0.0.4; q=0.5"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    families = {f.name for f in openmetrics_families(r.text)}  # type: ignore[no-untyped-call]
    assert {"flywheel_trajectories_ingested", "flywheel_trainer_state",
            "flywheel_consumer_lag"} <= families


async def test_status_endpoint_is_the_cli_status_plus_the_dashboard_data(
        api: httpx.AsyncClient, seeded: Seeded, settings: Settings) -> None:
    assert (await api.get("/v1/status")).status_code == 401
    r = await api.get("/v1/status", headers={"Authorization": "Bearer reader"})
    assert r.status_code == 200, r.text
    data = r.json()
    cli = json.loads(json.dumps(await collect(settings)))
    for key, value in cli.items():
        if key in ("trainer", "gate"):  # heartbeat age moves between the two reads
            moving = {"heartbeat_age_s": 0, "elapsed_s": 0}
            assert {**value, **moving} == {**data[key], **moving}
        else:
            assert data[key] == value, key
    assert data["lag_error"] is None and data["lag"]["flywheel-ingest"]["total"] == 3
    assert data["trainer"]["state"] == "training" and data["trainer"]["metrics"]["loss"] == 0.25
    assert data["production"]["version"] == 1
    assert [(a["version"], a["status"], a["production"]) for a in data["adapters"]] == [
        (1, "promoted", True), (2, "evaluated", False), (3, "candidate", False)]
    assert [(c["version"], c["steps"], c["reward_mean"]) for c in data["reward_curve"]] == [
        (1, 2, 0.3), (2, 4, 0.3), (3, 6, 0.3)]
    assert [(c["version"], c["success_rate"], c["baseline_success_rate"], c["state"])
            for c in data["holdout_curve"]] == [(1, 0.75, 0.25, "promoted"),
                                                (2, 1.0, 0.75, "pending")]
    assert data["holdout_curve"][1]["evaluation_id"] == str(seeded.pending)
    assert data["failure_breakdown"] == [
        {"failure_mode": "wrong_tool", "failures": 2, "unverifiable": 1, "tasks_train": 1,
         "tasks_holdout": 1},
        {"failure_mode": "bad_arguments", "failures": 1, "unverifiable": 0, "tasks_train": 1,
         "tasks_holdout": 0}]
    assert data["dlq"] == 4
    assert data["dlq_by_reason"] == {"bug": 1, "invalid_json": 2, "too_large": 1}
    assert data["dlq_by_consumer"] == {"ingest": {"invalid_json": 2, "too_large": 1},
                                       "miner": {"bug": 1}}
    assert data["groups_stale_dropped"] == 1 and data["pending_reviews"] == 1
    assert data["baseline"] is None
    g = data["gate"]
    assert (g["state"], g["version"], g["samples_done"], g["samples_planned"]) == (
        "evaluating", 3, 40, 160)
    assert g["warning"].startswith("this eval set cannot see the gains it is asked to find")
    assert g["power"]["mde"] == g["power"]["mde"] and g["power"]["pairs"] == 40
    who = await api.get("/v1/whoami", headers={"Authorization": "Bearer ops"})
    assert who.json()["scopes"] == ["operate"]


async def test_kafka_down_still_answers_from_postgres(settings: Settings) -> None:
    dead = settings.model_copy(update={
        "kafka": settings.kafka.model_copy(update={"bootstrap": f"127.0.0.1:{free_port()}"}),
        "api": settings.api.model_copy(update={"tokens": {"reader": []}, "serve": False})})
    app = create_app(dead, routers=[operator_router(), metrics_router()],
                     lifespan_hooks=[operator_lifespan])
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
        m = samples((await client.get("/metrics")).text)
        status = (await client.get("/v1/status",
                                   headers={"Authorization": "Bearer reader"})).json()
    assert m["flywheel_kafka_up"][()] == 0 and "flywheel_consumer_lag" not in m
    assert m["flywheel_trajectories_ingested_total"][()] == 0
    assert status["lag"] == {} and "Unable to bootstrap" in status["lag_error"]


async def test_demo_progress_reads_the_gate_records(seeded: Seeded, engine: AsyncEngine,
                                                    settings: Settings) -> None:
    """What `make demo` watches comes from the same projections as the status."""
    async with engine.connect() as conn:
        p = await read_progress(conn, settings.policy)
    assert p.production == 1 and p.baseline is None and p.groups == 4
    assert [(a["version"], a["status"]) for a in p.adapters] == [
        (1, "promoted"), (2, "evaluated"), (3, "candidate")]
    assert [(d["version"], d["state"]) for d in p.decisions] == [(1, "promoted"),
                                                                 (2, "pending")]
    assert p.trainer is not None and p.trainer["state"] == "training"
    assert finished(p)  # a GRPO version (v1) was promoted: the loop has turned
