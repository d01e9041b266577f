"""The validation pass: every published version scored on the validation tasks, and acted on.

Run by the rollout workers (consumer group `validation.group_id` on the adapters topic, one
worker per version), on the policy engine they already hold for rollouts: the pass costs
`tasks × validation.samples` attempts per version (at the gate's temperature by default),
taken from rollout sampling, and never touches the gate's engine or its holdout tasks.
Scoring reuses the gate's round machinery (`flywheel.gate.evaluate.evaluate`: same prompts,
seeds per task, decoding and verifiers) and caches each pass under a key of everything that
determines it, as the gate caches rounds, so production is scored once per validation set.

After a GRPO version is scored: the best version since the last proposal is proposed to the
gate (`CandidateProposed`) when it beats production on the same validation tasks
(`flywheel.validation.select`), and a training reward that rises while validation does not
raises the overfitting alarm (`OverfittingDetected`, state `overfitting`), which pauses
sampling until the miner adds tasks (docs/VALIDATION.md says why this policy).
"""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import lifecycle, registry
from flywheel.adapters.resolver import AdapterResolver
from flywheel.config import Settings
from flywheel.db.outbox import append_events
from flywheel.events import (
    AdapterTrainedPayload,
    CandidateProposed,
    CandidateProposedPayload,
    Event,
    OverfittingDetected,
    OverfittingDetectedPayload,
    ValidationScored,
    ValidationScoredPayload,
    derived_event_id,
)
from flywheel.gate.decision import EvalRun
from flywheel.gate.evaluate import Holdout, evaluate, run_key
from flywheel.policy.base import Policy
from flywheel.validation import select, split, store

log = logging.getLogger("flywheel.validation")
GATE_POLL_S = 2.0
"""How often a validation pass that yields to the gate looks again."""


def validation_settings(settings: Settings) -> Settings:
    """`settings` with the gate's sampling knobs set to the validation pass's, so the
    gate's `evaluate` and `run_key` serve it unchanged."""
    v = settings.validation
    temperature = settings.gate.temperature if v.temperature is None else v.temperature
    gate = settings.gate.model_copy(update={"round_samples": v.samples if temperature else 1,
                                            "temperature": temperature, "seed": v.seed})
    return settings.model_copy(update={"gate": gate})


class ValidationPass:
    def __init__(self, settings: Settings, engine: AsyncEngine, policy: Policy) -> None:
        self.settings, self.engine, self.policy = settings, engine, policy
        self.name = settings.policy
        self.vsettings = validation_settings(settings)
        self.adapters = AdapterResolver(engine, settings)

    async def score(self, version: int | None, tasks: Holdout) -> tuple[EvalRun, float]:
        """`version` (None = the base model) on the validation tasks, from the cache or
        sampled now; and the seconds it took (0 from the cache)."""
        fmt = await asyncio.to_thread(lambda: self.policy.chat_format.version)
        key = "validation/" + run_key(self.vsettings, version, tasks, fmt)
        async with self.engine.connect() as conn:
            found = await store.cached(conn, key)
        if found is not None:
            return found, 0.0
        await self._yield_to_gate(version)
        adapter = await self.adapters(version)
        if adapter is not None:
            await self.policy.ensure_adapter(adapter)
        started = time.perf_counter()
        run = await evaluate(self.policy, tasks, adapter, self.vsettings, 0)
        seconds = time.perf_counter() - started
        async with self.engine.begin() as conn:
            await store.store_run(conn, key, self.name, run, seconds)
        log.info("validation: %s scored on %d tasks (%d attempts) in %.1fs",
                 lifecycle.version_label(version), len(tasks.tasks),
                 len(run.attempts) + run.not_run, seconds)
        return run, seconds

    async def _yield_to_gate(self, version: int | None) -> None:
        """With `rollout.yield_to_gate`: wait while the gate evaluates a candidate (its
        heartbeat live; a stopped gate holds nothing), at most
        `validation.max_wait_for_gate_s`, so that the decision has the cores. On the demo
        (seed 1) before this, v1's one gate round took 137 s beside v1's validation pass;
        an earlier run of it alone took 63 s."""
        if not self.settings.rollout.yield_to_gate:
            return
        deadline = time.monotonic() + self.settings.validation.max_wait_for_gate_s
        told = False
        while time.monotonic() < deadline:
            async with self.engine.connect() as conn:
                candidate = await registry.gate_evaluating(conn, self.name)
            if candidate is None:
                return
            if not told:
                told = True
                log.info("validation of %s waits for the gate's evaluation of v%d",
                         lifecycle.version_label(version), candidate)
            await asyncio.sleep(GATE_POLL_S)
        log.warning("validation of %s: the gate is still evaluating after %.0fs; scoring now",
                    lifecycle.version_label(version),
                    self.settings.validation.max_wait_for_gate_s)

    async def on_trained(self, trained: AdapterTrainedPayload) -> list[Event]:
        """Score a published version; for a GRPO version, propose and alarm."""
        v = self.settings.validation
        if trained.policy != self.name:
            return []
        async with self.engine.connect() as conn:
            tasks = Holdout(0, await split.load_tasks(conn, self.settings.rollout.envs))
        if len(tasks.tasks) < v.min_tasks:
            return []  # no validation split yet: the trainer proposes by propose_min_groups
        run, seconds = await self.score(trained.version, tasks)
        async with self.engine.connect() as conn:
            rewards = await store.train_rewards(conn, [trained.version])
        train = rewards.get(trained.version) if trained.stage == "grpo" else None
        mine = store.score_of(run, train)
        scored = ValidationScored(
            event_id=derived_event_id("validation-scored", self.name, trained.version,
                                      len(tasks.tasks)),
            aggregate_id=lifecycle.adapter_key(self.name, trained.version),
            payload=ValidationScoredPayload(
                policy=self.name, version=trained.version, tasks=len(tasks.tasks),
                samples=len(run.attempts) + run.not_run, success_rate=mine.rate,
                reward_mean=sum(a.reward for a in run.attempts) / max(1, len(run.attempts)),
                train_reward=train, seconds=seconds))
        events: list[Event] = [scored]
        if trained.stage == "grpo":
            events += await self._judge(tasks)
        async with self.engine.begin() as conn:
            await append_events(conn, events, self.settings.topics)
            for e in events:
                await lifecycle.project(conn, e)
        return events

    async def _judge(self, tasks: Holdout) -> list[Event]:
        v = self.settings.validation
        async with self.engine.connect() as conn:
            production = await registry.production_version(conn, self.name)
        prod_run, _ = await self.score(production, tasks)
        async with self.engine.connect() as conn:
            st = await store.status(conn, self.name)
            curve = await store.grpo_curve(conn, self.name)
            last = await registry.newest_candidate(conn, self.name)
            waiting = await registry.candidates_waiting(conn, self.name)
            pool = await store.train_task_count(conn)
        out = select.judge(curve, store.score_of(prod_run), last_proposed=last,
                           margin=v.margin, alpha=v.alpha, window=v.overfit_versions,
                           rise=v.overfit_train_rise,
                           alarm_after=st["after_version"] if st else None)
        alarm = out.overfitting
        events: list[Event] = []
        if out.proposal is not None and waiting == 0:
            p = out.proposal
            log.info("validation proposes v%d to the gate: %s", p.version, p.reason)
            events.append(CandidateProposed(
                event_id=derived_event_id("candidate-proposed", self.name, p.version),
                aggregate_id=lifecycle.adapter_key(self.name, p.version),
                payload=CandidateProposedPayload(
                    policy=self.name, version=p.version, production_version=production,
                    tasks=p.paired.tasks, candidate_success=p.paired.candidate,
                    production_success=p.paired.production, gain=p.paired.gain,
                    p_value=p.paired.p_value, margin=v.margin, alpha=v.alpha,
                    considered=p.considered, reason=p.reason)))
        elif out.proposal is not None:
            log.info("validation would propose v%d; a candidate still waits for the gate",
                     out.proposal.version)
        else:
            log.info("validation proposes nothing: %s", out.why_not)
        async with self.engine.begin() as conn:
            if alarm is not None and (st is None or st["state"] != "overfitting"):
                w = out.window
                events.append(OverfittingDetected(
                    aggregate_id=f"{self.name}/validation",
                    payload=OverfittingDetectedPayload(
                        policy=self.name, versions=[s.version or 0 for s in w],
                        train_reward=[s.train_reward or 0.0 for s in w],
                        validation_success=[s.rate for s in w], best_version=out.best,
                        action="pause_for_tasks",
                        detail=f"{alarm}; sampling paused until {v.resume_new_tasks} more "
                               f"training tasks are mined (best by validation: "
                               f"v{out.best})")))
                log.warning("overfitting: %s", alarm)
                await store.set_status(conn, self.name, "overfitting",
                                       events[-1].payload.detail,  # type: ignore[union-attr]
                                       train_tasks=pool)
            elif st is None or st["state"] != "overfitting":
                await store.set_status(conn, self.name, "ok", out.why_not or (
                    out.proposal.reason if out.proposal else None), train_tasks=pool)
        return events
