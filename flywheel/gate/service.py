"""The gate's work on one candidate: evaluate both sides on the frozen holdout, decide, record.

Idempotent: a candidate that is no longer `candidate` (already evaluated, decided) is
skipped, so a redelivered `AdapterTrained` is a no-op. The evaluations themselves are cached
per (version, eval set, gate settings), so production is sampled once for many candidates.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import lifecycle, registry
from flywheel.adapters.resolver import AdapterResolver
from flywheel.config import Settings
from flywheel.events import AdapterEvaluatedPayload, AdapterTrainedPayload, Event
from flywheel.gate.decision import EvalRun, decide
from flywheel.gate.evaluate import (
    Holdout,
    cached_run,
    evaluate,
    load_holdout,
    run_key,
    store_run,
)
from flywheel.policy.base import Policy

log = logging.getLogger("flywheel.gate")


class GateService:
    def __init__(self, settings: Settings, engine: AsyncEngine, policy: Policy) -> None:
        self.settings, self.engine, self.policy = settings, engine, policy
        self.name = settings.policy
        self.adapters = AdapterResolver(engine, settings)

    async def run_for(self, version: int | None, holdout: Holdout) -> EvalRun:
        """The holdout run of `version` (None = base model), from the cache or sampled."""
        # A thread: the vLLM engine loads its tokenizer on first use.
        fmt = await asyncio.to_thread(lambda: self.policy.chat_format.version)
        key = run_key(self.settings, version, holdout, fmt)
        async with self.engine.connect() as conn:
            cached = await cached_run(conn, key)
        if cached is not None:
            return cached
        adapter = await self.adapters(version)
        if adapter is not None:
            await self.policy.ensure_adapter(adapter)
        log.info("evaluating %s on %d holdout tasks (eval set v%d, k=%d)",
                 lifecycle.version_label(version),
                 len(holdout.tasks), holdout.eval_set_version, self.settings.gate.samples_per_task)
        run = await evaluate(self.policy, holdout, adapter, self.settings)
        async with self.engine.begin() as conn:
            await store_run(conn, key, self.name, holdout, run)
        return run

    async def baseline(self, *, force: bool = False) -> dict[str, Any] | None:
        """Measure the base model (and production) on the newest eval set and record the
        recommended next stage; without `force`, only when that eval set has none yet."""
        from flywheel.gate.baseline import store_baseline
        from flywheel.gate.decision import metrics

        async with self.engine.connect() as conn:
            holdout = await load_holdout(conn, self.settings.gate.max_tasks,
                                         self.settings.rollout.envs)
            if not force and await registry.latest_baseline(conn, self.name,
                                                            holdout.eval_set_version):
                return None
            production = await registry.production_version(conn, self.name)
        base = metrics(await self.run_for(None, holdout))
        prod = metrics(await self.run_for(production, holdout)) if production else None
        async with self.engine.begin() as conn:
            record = await store_baseline(conn, self.name, holdout.eval_set_version, base, prod,
                                          self.settings.gate)
        log.info("baseline on eval set v%d: base success %.2f, invalid %.2f → %s (%s)",
                 holdout.eval_set_version, base.success_rate, base.invalid_rate,
                 record["recommendation"], record["reason"])
        return record

    async def _status(self, version: int) -> tuple[str | None, int | None]:
        async with self.engine.connect() as conn:
            status = await registry.version_status(conn, self.name, version)
            newest = await registry.newest_version(conn, self.name)
        return status, newest

    async def on_trained(self, trained: AdapterTrainedPayload) -> list[Event]:
        """Gate one published candidate (called for every `AdapterTrained`)."""
        if trained.policy != self.name:
            return []
        status, newest = await self._status(trained.version)
        if status != "candidate":
            return []  # already evaluated or decided (a redelivery)
        if self.settings.gate.skip_superseded and newest is not None \
                and newest > trained.version:
            async with self.engine.begin() as conn:
                event = await lifecycle.reject_unevaluated(
                    conn, self.name, trained.version, actor="gate",
                    reason=f"superseded by v{newest} before the gate evaluated it",
                    topics=self.settings.topics)
            return [event]
        return await self.evaluate_version(trained.version)

    async def evaluate_version(self, version: int) -> list[Event]:
        """Evaluate `version` against current production and record (and in auto mode carry
        out) the decision. Also how an operator re-evaluates a rolled-back version."""
        async with self.engine.connect() as conn:
            holdout = await load_holdout(conn, self.settings.gate.max_tasks,
                                         self.settings.rollout.envs)
        for _ in range(3):
            async with self.engine.connect() as conn:
                production = await registry.production_version(conn, self.name)
            if production == version:
                raise lifecycle.LifecycleError(f"v{version} is production already")
            candidate = await self.run_for(version, holdout)
            baseline = await self.run_for(production, holdout)
            payload = decision_payload(self.settings, version, production,
                                       holdout.eval_set_version, candidate, baseline)
            try:
                async with self.engine.begin() as conn:
                    events = await lifecycle.record_evaluation(
                        conn, payload, self.settings.topics)
            except lifecycle.Conflict as err:
                log.warning("%s; evaluating again against the new production", err)
                continue
            log.info("v%d: %s", version, " ".join(payload.reasons))
            return events
        raise lifecycle.Conflict(f"production kept moving while v{version} was evaluated")


def decision_payload(settings: Settings, version: int, production: int | None,
                     eval_set_version: int, candidate: EvalRun, baseline: EvalRun
                     ) -> AdapterEvaluatedPayload:
    """The decision record of `candidate` against `baseline` under the configured rule."""
    return AdapterEvaluatedPayload(
        **dict(decide(candidate, baseline, settings.gate)), evaluation_id=uuid.uuid4(),
        policy=settings.policy, version=version, baseline_version=production,
        eval_set_version=eval_set_version, mode=settings.gate.mode)


def describe(events: list[Any]) -> str:
    return ", ".join(e.type for e in events) or "nothing to do"
