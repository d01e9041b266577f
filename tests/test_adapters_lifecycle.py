"""The adapter lifecycle on real Postgres: auto and manual decisions, rollback, the race
between promotion and rollback, replay, and the operator API's auth."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import lifecycle, queries
from flywheel.api.operator import operator_lifespan, operator_router
from flywheel.config import Settings
from flywheel.db.outbox import append_events
from flywheel.events import AdapterTrained, AdapterTrainedPayload, Event
from flywheel.gate.candidate import decision_payload
from flywheel.gate.decision import Attempt, EvalRun
from flywheel.web.app import create_app

pytestmark = [pytest.mark.postgres]
POLICY = "policy"


def run(version: int | None, rate: float, n: int = 30, k: int = 4) -> EvalRun:
    attempts = [Attempt(task=f"t{i}", index=j, success=j < round(rate * k), reward=1.0,
                        invalid=False, unsafe=False, latency_ms=50.0, tokens=12)
                for i in range(n) for j in range(k)]
    return EvalRun(version, {f"t{i}": ["env:tool_call"] for i in range(n)}, attempts)


def with_mode(settings: Settings, mode: str) -> Settings:
    return settings.model_copy(update={"gate": settings.gate.model_copy(update={"mode": mode})})


async def train(engine: AsyncEngine, settings: Settings, version: int) -> None:
    event = AdapterTrained(aggregate_id=f"{POLICY}@v{version}", payload=AdapterTrainedPayload(
        policy=POLICY, version=version, parent_version=version - 1 or None,
        path=f"/adapters/{POLICY}/v{version}", stage="grpo", steps=2 * version, groups=8,
        stale_dropped=0, metrics={"loss": 0.1, "reward_mean": 0.3}))
    async with engine.begin() as conn:
        await lifecycle.project(conn, event)
        await append_events(conn, [event], settings.topics)


async def evaluate(engine: AsyncEngine, settings: Settings, version: int,
                   rate: float, base_rate: float) -> list[Event]:
    # The fixed design: `run` puts each task's successes on its first sample indices, so
    # a sequential test's first rounds would not show the rates (the rule itself is tested
    # in test_gate_decision.py and test_gate_sequential.py).
    fixed = settings.model_copy(update={"gate": settings.gate.model_copy(
        update={"test": "mcnemar"})})
    async with engine.begin() as conn:
        current, _ = await lifecycle.lock_production(conn, POLICY)
        payload = decision_payload(fixed, version, current, 1, run(version, rate),
                                   run(current, base_rate))
        return await lifecycle.record_evaluation(conn, payload, settings.topics)


async def production(engine: AsyncEngine) -> int | None:
    async with engine.connect() as conn:
        return (await conn.execute(text("SELECT version FROM production"))).scalar()


async def status(engine: AsyncEngine, version: int) -> str:
    async with engine.connect() as conn:
        return str((await conn.execute(text(
            "SELECT status FROM adapter_versions WHERE version = :v"), {"v": version})).scalar())


async def assert_replay_identical(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        before = await lifecycle.snapshot(conn)
        await lifecycle.replay(conn)
        after = await lifecycle.snapshot(conn)
    assert after == before
    assert sum(len(v) for v in before.values()) > 0


async def test_auto_mode_promotes_rejects_and_rollback_restores(
        engine: AsyncEngine, settings: Settings) -> None:
    s = with_mode(settings, "auto")
    await train(engine, s, 1)
    events = await evaluate(engine, s, 1, rate=0.75, base_rate=0.25)
    assert [e.type for e in events] == ["AdapterEvaluated", "AdapterPromoted"]
    assert await production(engine) == 1 and await status(engine, 1) == "promoted"

    await train(engine, s, 2)
    events = await evaluate(engine, s, 2, rate=0.75, base_rate=0.75)  # no gain
    assert [e.type for e in events] == ["AdapterEvaluated", "AdapterRejected"]
    assert await production(engine) == 1 and await status(engine, 2) == "rejected"

    await train(engine, s, 3)
    await evaluate(engine, s, 3, rate=1.0, base_rate=0.75)
    assert await production(engine) == 3

    async with engine.begin() as conn:
        back = await lifecycle.rollback(conn, POLICY, to=None, actor="ops", reason="bad in prod",
                                        topics=s.topics)
    assert (back.payload.from_version, back.payload.to_version) == (3, 1)
    assert await production(engine) == 1 and await status(engine, 3) == "rolled_back"

    # The rolled-back version's old decision cannot promote it again …
    async with engine.connect() as conn:
        (old,) = await queries.list_evaluations(conn, POLICY, version=3)
    with pytest.raises(lifecycle.LifecycleError, match="already promoted"):
        async with engine.begin() as conn:
            await lifecycle.approve(conn, uuid.UUID(old["evaluation_id"]), actor="ops",
                                    reason="again", topics=s.topics)
    # … a new evaluation can.
    events = await evaluate(engine, s, 3, rate=1.0, base_rate=0.75)
    assert events[-1].type == "AdapterPromoted" and await production(engine) == 3

    async with engine.begin() as conn:
        await lifecycle.rollback(conn, POLICY, to=lifecycle.BASE, actor="ops", reason="all off",
                                 topics=s.topics)
    assert await production(engine) is None
    with pytest.raises(lifecycle.LifecycleError, match="base model"):
        async with engine.begin() as conn:
            await lifecycle.rollback(conn, POLICY, to=None, actor="ops", reason="x",
                                     topics=s.topics)
    async with engine.connect() as conn:
        revision = (await conn.execute(text("SELECT revision FROM production"))).scalar()
        moves = (await conn.execute(text("""SELECT count(*) FROM events
            WHERE type IN ('AdapterPromoted', 'AdapterRolledBack')"""))).scalar()
        outbox = (await conn.execute(text("SELECT count(*) FROM outbox"))).scalar()
    assert revision == moves == 5
    assert outbox == (await _count_events(engine))  # every event is published
    await assert_replay_identical(engine)


async def _count_events(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM events"))).scalar_one())


async def test_manual_mode_waits_for_an_operator(engine: AsyncEngine,
                                                 settings: Settings) -> None:
    s = with_mode(settings, "manual")
    await train(engine, s, 1)
    (evaluated,) = await evaluate(engine, s, 1, rate=0.75, base_rate=0.25)
    assert evaluated.type == "AdapterEvaluated"
    assert await production(engine) is None and await status(engine, 1) == "evaluated"
    eid = evaluated.payload.evaluation_id  # type: ignore[union-attr]
    async with engine.begin() as conn:
        promoted = await lifecycle.approve(conn, eid, actor="alice", reason="looks right",
                                           topics=s.topics)
    assert promoted.payload.previous_version is None and await production(engine) == 1

    await train(engine, s, 2)
    (bad,) = await evaluate(engine, s, 2, rate=0.75, base_rate=0.75)
    bad_id = bad.payload.evaluation_id  # type: ignore[union-attr]
    with pytest.raises(lifecycle.LifecycleError, match="--force"):
        async with engine.begin() as conn:
            await lifecycle.approve(conn, bad_id, actor="alice", reason="ship it",
                                    topics=s.topics)
    async with engine.begin() as conn:
        await lifecycle.reject(conn, bad_id, actor="alice", reason="no gain",
                               topics=s.topics)
    async with engine.connect() as conn:
        record = await queries.get_evaluation(conn, bad_id)
    assert record is not None and record["state"] == "rejected"
    assert record["decided_by"] == "alice" and record["decision_reason"] == "no gain"
    assert record["record"]["baseline"]["version"] == 1
    await assert_replay_identical(engine)


async def test_promote_and_rollback_racing_exactly_one_wins(
        engine: AsyncEngine, settings: Settings) -> None:
    s = with_mode(settings, "manual")
    await train(engine, s, 1)
    (first,) = await evaluate(engine, s, 1, rate=0.75, base_rate=0.25)
    async with engine.begin() as conn:
        await lifecycle.approve(conn, first.payload.evaluation_id,  # type: ignore[union-attr]
                                actor="a", reason="r", topics=s.topics)
    version = 1
    for _ in range(5):
        version += 1
        await train(engine, s, version)
        (ev,) = await evaluate(engine, s, version, rate=1.0, base_rate=0.25)
        eid = ev.payload.evaluation_id  # type: ignore[union-attr]
        before = await production(engine)
        assert before is not None

        async def promote(eid: uuid.UUID = eid) -> str:
            async with engine.begin() as conn:
                await lifecycle.approve(conn, eid, actor="a", reason="r",
                                        topics=s.topics)
            return "promote"

        async def roll() -> str:
            async with engine.begin() as conn:
                await lifecycle.rollback(conn, POLICY, to=lifecycle.BASE, actor="b",
                                         reason="r", topics=s.topics)
            return "rollback"

        results = await asyncio.gather(promote(), roll(), return_exceptions=True)
        wins = [r for r in results if isinstance(r, str)]
        for loss in results:
            if isinstance(loss, BaseException):
                assert isinstance(loss, lifecycle.LifecycleError), loss
        # Serialized per policy: either one won and the other saw the change and refused,
        # or both ran one after the other (promotion, then the rollback of it). Never two
        # moves from the same pointer revision.
        async with engine.connect() as conn:
            expected = list((await conn.execute(text("""SELECT payload->>'expected_revision'
                FROM events WHERE type IN ('AdapterPromoted', 'AdapterRolledBack')"""))
                ).scalars())
        assert len(expected) == len(set(expected)), "two moves from the same revision"
        assert wins, results
        if wins == ["promote"]:
            assert await production(engine) == version
        else:
            assert await production(engine) is None
            # Back to an adapter for the next round: a fresh candidate, evaluated, approved.
            version += 1
            await train(engine, s, version)
            (fresh,) = await evaluate(engine, s, version, rate=1.0, base_rate=0.25)
            async with engine.begin() as conn:
                await lifecycle.approve(conn, fresh.payload.evaluation_id,  # type: ignore
                                        actor="c", reason="restore", topics=s.topics)
    await assert_replay_identical(engine)


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    s = settings.model_copy(update={"api": settings.api.model_copy(update={
        "tokens": {"pub": ["publish"], "ops": ["operate"]}, "serve": False})})
    app = create_app(s, routers=[operator_router()], lifespan_hooks=[operator_lifespan])
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
        yield client


async def test_operate_endpoints_need_the_operate_scope(
        api: httpx.AsyncClient, engine: AsyncEngine, settings: Settings) -> None:
    s = with_mode(settings, "manual")
    await train(engine, s, 1)
    (ev,) = await evaluate(engine, s, 1, rate=0.75, base_rate=0.25)
    eid = ev.payload.evaluation_id  # type: ignore[union-attr]
    actions = [f"/v1/promotions/{eid}/approve", f"/v1/promotions/{eid}/reject",
               "/v1/adapters/rollback"]
    for path in actions:
        assert (await api.post(path, json={"reason": "x"})).status_code == 401
        r = await api.post(path, json={"reason": "x"}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        r = await api.post(path, json={"reason": "x"}, headers={"Authorization": "Bearer pub"})
        assert r.status_code == 403 and "operate" in r.json()["detail"]
    assert (await api.get("/v1/promotions")).status_code == 401
    ops = {"Authorization": "Bearer ops", "X-Flywheel-Actor": "alice"}
    listed = (await api.get("/v1/promotions?state=pending", headers=ops)).json()
    assert [p["evaluation_id"] for p in listed] == [str(eid)]
    r = await api.post(f"/v1/promotions/{eid}/approve", json={"reason": "good"}, headers=ops)
    assert r.status_code == 200, r.text
    assert r.json()["payload"]["actor"].startswith("alice (token ")
    again = await api.post(f"/v1/promotions/{eid}/approve", json={"reason": "x"}, headers=ops)
    assert again.status_code == 409 and "already promoted" in again.json()["detail"]
    adapters = (await api.get("/v1/adapters", headers=ops)).json()
    assert adapters["production"]["version"] == 1
    assert [a["production"] for a in adapters["adapters"]] == [True]
    r = await api.post("/v1/adapters/rollback", json={"reason": "regression"}, headers=ops)
    assert r.status_code == 200 and r.json()["payload"]["to_version"] is None
    shown = (await api.get("/v1/adapters/1", headers=ops)).json()
    assert [h["type"] for h in shown["history"]] == [
        "AdapterTrained", "AdapterEvaluated", "AdapterPromoted", "AdapterRolledBack"]
    assert (await api.get("/v1/adapters/9", headers=ops)).status_code == 404
