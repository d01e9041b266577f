"""The gate service's rounds on real Postgres, with the sampling replaced by known success
rates (no model): it stops when the test is clear, caches every round of every side so
production is sampled once per index, reports its progress and records what it could see."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import lifecycle, registry
from flywheel.config import Settings
from flywheel.db.outbox import append_events
from flywheel.demo.samples import TOOLS
from flywheel.events import AdapterTrained, AdapterTrainedPayload
from flywheel.gate import candidate as gate_service
from flywheel.gate.decision import Attempt, EvalRun
from flywheel.gate.evaluate import Holdout, task_groups
from flywheel.gate.lifetime import candidate_number, rule_for
from flywheel.mining.store import freeze_eval_set, store_task
from flywheel.policy.base import AdapterRef
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec

pytestmark = [pytest.mark.postgres]
RATES = {None: 0.1, 1: 0.6, 2: 0.6}
"""Success rate of each version (None = the base model): v1 is clearly better than the
base model, v2 the same as v1."""


class FakeFormat:
    version = "fake-format.v1"
    """Part of every round's cache key, as the policy's chat format version is."""


class FakePolicy:
    chat_format = FakeFormat()

    async def ensure_adapter(self, adapter: AdapterRef) -> None:
        pass


class Sampler:
    """Stands in for `evaluate`: each attempt succeeds with its version's rate, drawn from
    (version, task fingerprint, sample index) — not the task's random id, so every run
    draws the same outcomes (v2 at v1's rate is otherwise promoted by chance now and then,
    as the gate's alpha allows); records which rounds were sampled and what the status row
    said meanwhile."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[int | None, int]] = []
        self.seen: list[dict[str, Any]] = []

    async def __call__(self, policy: Any, holdout: Holdout, adapter: AdapterRef | None,
                       settings: Settings, round_: int = 0,
                       on_task: Callable[[int], None] | None = None) -> EvalRun:
        version = adapter.version if adapter else None
        self.calls.append((version, round_))
        async with self.engine.connect() as conn:
            self.seen.append(dict(await registry.gate_activity(conn, settings.policy) or {}))
        s = settings.gate.round_samples
        attempts = []
        for task in holdout.tasks:
            for j in range(round_ * s, round_ * s + s):
                rng = random.Random(f"{version}/{task.fingerprint}/{j}")
                ok = rng.random() < RATES[version]
                attempts.append(Attempt(str(task.task_id), j, ok, float(ok), False, False,
                                        50.0, 10))
            if on_task is not None:
                on_task(s)
        return EvalRun(version, {str(t.task_id): task_groups(t) for t in holdout.tasks},
                       attempts)


async def _probe(*args: Any) -> tuple[list[float], list[float]]:
    return [50.0], [48.0]


async def _train(engine: AsyncEngine, settings: Settings, version: int) -> None:
    event = AdapterTrained(aggregate_id=f"policy@v{version}", payload=AdapterTrainedPayload(
        policy="policy", version=version, parent_version=version - 1 or None,
        path=f"/adapters/v{version}", stage="grpo", steps=version, groups=8, stale_dropped=0,
        metrics={}))
    async with engine.begin() as conn:
        await lifecycle.project(conn, event)
        await append_events(conn, [event], settings.topics)


def _rounds_of(settings: Settings, **gate: Any) -> Settings:
    """`settings` with a gate of up to 10 rounds of 2 samples per task (and `gate`'s own)."""
    return settings.model_copy(update={"gate": settings.gate.model_copy(update={
        "samples_per_task": 20, "round_samples": 2, "group_min_samples": 10_000, **gate})})


async def _gate(engine: AsyncEngine, s: Settings, monkeypatch: pytest.MonkeyPatch,
                sampler: Sampler, place: str) -> gate_service.GateService:
    """Ten frozen holdout tasks (the weather in `place` i) and a gate sampling through
    `sampler`; versions resolve without artifacts (protect_production stays real)."""
    async with engine.begin() as conn:
        for i in range(10):
            task = TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                            messages=[{"role": "user", "content": f"Weather in {place} {i}?"}],
                            verifier=ToolCallSpec(expected=ExpectedCall(
                                name="get_weather", arguments={"city": f"{place}{i}"})),
                            failure_mode="bad_arguments", fingerprint=f"{place}{i}",
                            split="holdout")
            await store_task(conn, task, uuid.uuid4(), "human_correction", s.topics)
        await freeze_eval_set(conn, s.topics)
    monkeypatch.setattr(gate_service, "evaluate", sampler)
    monkeypatch.setattr(gate_service, "probe_latency", _probe)
    gate = gate_service.GateService(s, engine, FakePolicy())  # type: ignore[arg-type]
    monkeypatch.setattr(type(gate.adapters), "__call__", lambda self, v: _ref(v))
    return gate


async def test_rounds_stop_when_clear_and_production_is_sampled_once_per_index(
        engine: AsyncEngine, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _rounds_of(settings)
    sampler = Sampler(engine)
    gate = await _gate(engine, s, monkeypatch, sampler, "city")

    await _train(engine, s, 1)
    events = await gate.evaluate_version(1)
    assert [e.type for e in events] == ["AdapterEvaluated", "AdapterPromoted"]
    record = events[0].payload
    assert record.sequential is not None and record.sequential.stop == "win"
    used = len(record.sequential.rounds)
    assert used < s.gate.max_rounds  # a clear win stops early
    assert sorted(sampler.calls, key=str) == sorted(
        [(1, r) for r in range(used)] + [(None, r) for r in range(used)], key=str)
    assert record.latency == "paired_probe" and record.latency_probe is not None
    assert record.power is not None and record.power.tasks == 10
    # While it ran, the status said so and counted both sides' samples.
    during = [x for x in sampler.seen if x.get("state") == "evaluating"]
    assert during and during[-1]["version"] == 1 and during[-1]["samples_planned"] == 400
    assert during[-1]["samples_done"] == 2 * 20 * (used - 1)
    timed = [(t.side, t.round, t.samples, t.cached) for t in record.rounds]
    assert timed == [(side, r, 20, False) for r in range(used)
                     for side in ("candidate", "production")]
    assert all((t.seconds >= 0 and t.samples_per_s is None) or t.samples_per_s > 0
               for t in record.rounds)

    # v2 against production v1: v1's first rounds are cached from its own evaluation.
    await _train(engine, s, 2)
    sampler.calls.clear()
    events = await gate.evaluate_version(2)
    second = events[0].payload
    assert second.recommendation == "reject" and second.sequential is not None
    assert second.sequential.stop in ("futility", "budget"), second.sequential.reason
    # Each production's lifetime budget starts at candidate 1 (v1 against the base model,
    # v2 against v1); the next candidate against v1 is number 2, at a quarter of the level.
    assert record.lifetime is not None and record.lifetime.candidate_number == 1
    assert second.lifetime is not None and second.lifetime.candidate_number == 1
    async with engine.connect() as conn:
        assert await candidate_number(conn, "policy", 1) == 2
    deeper = len(second.sequential.rounds)
    assert sorted(c for c in sampler.calls if c[0] == 2) == [(2, r) for r in range(deeper)]
    assert sorted(c for c in sampler.calls if c[0] == 1) == [(1, r)
                                                             for r in range(used, deeper)]
    async with engine.connect() as conn:
        rows = (await conn.execute(text("""SELECT coalesce(version, 0), count(*)
            FROM eval_runs GROUP BY 1 ORDER BY 1"""))).all()
        status = await registry.gate_activity(conn, s.policy)
    assert [tuple(r) for r in rows] == [(0, used), (1, max(used, deeper)), (2, deeper)]
    assert status is not None and status["state"] == "idle"
    assert status["power"]["discordance_source"].startswith("v1's own between-sample")

    # An evaluation restarted later samples nothing it has already sampled.
    sampler.calls.clear()
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE adapter_versions SET status = 'evaluated' "
                                "WHERE version = 2"))
    again = gate_service.decision_payload(s, 2, 1, 1, *(await _replay(gate, s)))
    assert sampler.calls == [] and again.sequential == second.sequential


def _ref(version: int | None) -> Any:
    async def go() -> AdapterRef | None:
        return None if version is None else AdapterRef("policy", version, Path("/x"))
    return go()


async def _replay(gate: gate_service.GateService, s: Settings) -> tuple[EvalRun, EvalRun]:
    from flywheel.gate.evaluate import load_holdout

    async with gate.engine.connect() as conn:
        holdout = await load_holdout(conn)
    cand, base, _ = await gate._rounds(2, 1, holdout, rule_for(s.gate, 1))
    return cand, base


class Unreachable(Sampler):
    """The engine cannot run the candidate's attempts at one task (after the retries)."""

    async def __call__(self, policy: Any, holdout: Holdout, adapter: AdapterRef | None,
                       settings: Settings, round_: int = 0, on_task: Any = None) -> EvalRun:
        run = await super().__call__(policy, holdout, adapter, settings, round_)
        if adapter is None:
            return run
        lost = str(holdout.tasks[0].task_id)
        kept = [a for a in run.attempts if a.task != lost]
        gone = len(run.attempts) - len(kept)
        return EvalRun(run.version, run.task_groups, kept, not_run=gone,
                       not_run_kinds={"crash": gone})


async def test_an_evaluation_the_infrastructure_cannot_complete_ends_incomplete(
        engine: AsyncEngine, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _rounds_of(settings)
    sampler = Unreachable(engine)
    gate = await _gate(engine, s, monkeypatch, sampler, "town")

    await _train(engine, s, 1)
    events = await gate.evaluate_version(1)
    # Recorded, nothing carried out: neither promoted nor rejected, and it stopped sampling
    # at the first round it could not complete.
    assert [e.type for e in events] == ["AdapterEvaluated"]
    record = events[0].payload
    assert record.recommendation == "incomplete" and record.sequential is not None
    assert record.sequential.stop == "incomplete" and record.candidate.not_run_kinds == {
        "crash": 2}
    assert sorted(sampler.calls, key=str) == [(1, 0), (None, 0)]
    async with engine.begin() as conn:
        assert await registry.production_version(conn, s.policy) is None
        with pytest.raises(lifecycle.LifecycleError, match="incomplete"):
            await lifecycle.approve(conn, record.evaluation_id, actor="op", reason="ship it",
                                    topics=s.topics, force=True)
        # It spent nothing of production's budget: the next candidate is still number 1.
        assert await candidate_number(conn, s.policy, None) == 1


class Held(Sampler):
    """A sampler whose rounds of `hold` wait until `release` is set."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine)
        self.hold: int | None = None
        self.held, self.release = asyncio.Event(), asyncio.Event()

    async def __call__(self, policy: Any, holdout: Holdout, adapter: AdapterRef | None,
                       settings: Settings, round_: int = 0,
                       on_task: Callable[[int], None] | None = None) -> EvalRun:
        if adapter is not None and adapter.version == self.hold:
            self.held.set()
            await self.release.wait()
        return await super().__call__(policy, holdout, adapter, settings, round_, on_task)


async def test_production_rounds_sampled_ahead_are_what_the_next_evaluation_uses(
        engine: AsyncEngine, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _rounds_of(settings, baseline_samples_per_task=4, prefetch_rounds=6)
    sampler = Held(engine)
    gate = await _gate(engine, s, monkeypatch, sampler, "village")

    # Nothing is sampled ahead before the eval set has its baseline, nor for the base
    # model (its first rounds are the baseline's).
    assert await gate.sample_ahead() == 0 and sampler.calls == []
    await gate.baseline()  # the base model's rounds 0–1
    assert gate.kick.is_set() and await gate.sample_ahead() == 0
    assert sampler.calls == [(None, 0), (None, 1)]

    sampler.calls.clear()
    await _train(engine, s, 1)
    events = await gate.evaluate_version(1)
    assert [e.type for e in events] == ["AdapterEvaluated", "AdapterPromoted"]
    used = len(events[0].payload.sequential.rounds)
    assert [c for c in sampler.calls if c[0] is None] == [(None, r) for r in range(2, used)]

    # v1 is production now: its next round is being sampled ahead when v2's evaluation
    # starts. The evaluation samples its own round 1, but its first latency probe waits
    # for the round in flight (a probe beside production's other attempts would charge
    # production for them), and that round is never sampled a second time.
    sampler.calls.clear()
    sampler.hold = 1
    ahead = asyncio.create_task(gate.sample_ahead())
    await asyncio.wait_for(sampler.held.wait(), 10)
    await _train(engine, s, 2)
    evaluation = asyncio.create_task(gate.evaluate_version(2))
    for _ in range(200):
        if (2, 0) in sampler.calls:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    assert (2, 0) in sampler.calls and (2, 1) not in sampler.calls and not evaluation.done()
    sampler.release.set()
    second = (await asyncio.wait_for(evaluation, 30))[0].payload
    await asyncio.wait_for(ahead, 30)
    deeper = len(second.sequential.rounds)
    assert deeper > used  # it reached the round that was being sampled ahead
    production = [c for c in sampler.calls if c[0] == 1]
    assert sorted(production) == sorted(set(production))  # no round sampled twice
    assert (1, used) in production
    assert sorted(c for c in sampler.calls if c[0] == 2) == [(2, r) for r in range(deeper)]
    timed = {t.round: t.cached for t in second.rounds if t.side == "production"}
    assert all(timed[r] for r in range(used + 1))  # its own, or sampled ahead

    # v2 was turned down; production is still v1: what is left of its first 6 rounds is
    # sampled ahead now, without the gate's state leaving `idle` (rollouts need not yield).
    sampler.calls.clear()
    assert await gate.sample_ahead() == max(0, 6 - deeper) and await gate.sample_ahead() == 0
    assert sampler.calls == [(1, r) for r in range(deeper, 6)]
    async with engine.connect() as conn:
        status = await registry.gate_activity(conn, s.policy)
    assert status is not None and status["state"] == "idle"
