"""The gate's work on one candidate: evaluate both sides round by round, decide, record.

Idempotent: a candidate that is no longer `candidate` (already evaluated, decided) is
skipped, so a redelivered `AdapterTrained` is a no-op. Every round of every side is cached
per (version, eval set, gate settings, round), so production is sampled once per sample
index for many candidates, and a restarted gate resumes an evaluation where it stopped.
The sequential test looks after every round and stops at a clear outcome — or at a round
the infrastructure could not complete, which ends the evaluation `incomplete`; the candidate
is tested at its level in production's lifetime budget (`flywheel.gate.lifetime`). Progress
goes to `gate_status` (`flywheel.gate.progress`) for status, metrics, the dashboard and the
trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
import uuid
from typing import Any, Literal

from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import lifecycle, registry
from flywheel.adapters.resolver import AdapterResolver
from flywheel.config import GateSettings, Settings
from flywheel.environments import load_environment
from flywheel.events import (
    AdapterEvaluatedPayload,
    AdapterTrainedPayload,
    CandidateProposedPayload,
    Event,
    GateCanaries,
    LatencyProbe,
    RoundTiming,
)
from flywheel.gate import canaries, lifetime, sequential
from flywheel.gate.accounting import complete_rounds, rounds_seen
from flywheel.gate.decision import EvalRun, latency_probe, round_counts
from flywheel.gate.evaluate import (
    Holdout,
    NoEvalSet,
    cached_run,
    evaluate,
    load_holdout,
    load_train_tasks,
    probe_latency,
    round_key,
    run_key,
    store_run,
)
from flywheel.gate.hacking import review
from flywheel.gate.progress import Progress, eval_set_power
from flywheel.policy.base import AdapterRef, Policy

log = logging.getLogger("flywheel.gate")


class GateService:
    def __init__(self, settings: Settings, engine: AsyncEngine, policy: Policy) -> None:
        self.settings, self.engine, self.policy = settings, engine, policy
        self.name = settings.policy
        self.adapters = AdapterResolver(engine, settings)
        self.progress = Progress(engine, self.name)
        # One activity at a time (a baseline, an evaluation): they share the policy engine
        # and the one status row.
        self.busy = asyncio.Lock()
        # Production's rounds being sampled ahead (`gate.prefetch_rounds`), by round key: an
        # evaluation that needs one waits for it instead of sampling it again.
        self._ahead: dict[str, asyncio.Task[EvalRun]] = {}
        self.kick = asyncio.Event()
        """Set when production or the eval set may have changed: look for rounds to sample
        ahead (`ahead_forever`)."""

    async def _adapter(self, version: int | None) -> AdapterRef | None:
        adapter = await self.adapters(version)
        if adapter is not None:
            await self.adapters.protect_production(self.policy)
            await self.policy.ensure_adapter(adapter)
        return adapter

    async def round_for(self, version: int | None, adapter: AdapterRef | None,
                        holdout: Holdout, round_: int,
                        timings: list[RoundTiming] | None = None,
                        side: Literal["candidate", "production"] = "candidate") -> EvalRun:
        """Round `round_` of `version` (None = base model), from the cache or sampled; its
        seconds and samples/s appended to `timings`."""
        started = time.monotonic()
        # A thread: the vLLM engine loads its tokenizer on first use.
        fmt = await asyncio.to_thread(lambda: self.policy.chat_format.version)
        key = round_key(run_key(self.settings, version, holdout, fmt), round_)
        async with self.engine.connect() as conn:
            run = await cached_run(conn, key)
        if run is None and (ahead := self._ahead.get(key)) is not None:
            # Being sampled ahead (`sample_ahead`): the very attempts this would sample.
            log.info("%s round %d: waiting for it to be sampled ahead",
                     lifecycle.version_label(version), round_ + 1)
            try:
                run = await asyncio.shield(ahead)
            except Exception as err:
                log.warning("%s round %d: sampling it ahead failed (%s); sampling it now",
                            lifecycle.version_label(version), round_ + 1, err)
        cached = run is not None
        if run is None:
            run = await evaluate(self.policy, holdout, adapter, self.settings, round_,
                                 on_task=self.progress.task_done)
            async with self.engine.begin() as conn:
                await store_run(conn, key, self.name, holdout, run)
        else:
            self.progress.task_done(len(run.attempts) + run.not_run)
        if timings is not None:
            seconds = time.monotonic() - started
            samples = len(run.attempts) + run.not_run
            timings.append(RoundTiming(
                round=round_, side=side, seconds=round(seconds, 3), samples=samples,
                samples_per_s=round(samples / seconds, 3) if seconds > 0 else None,
                cached=cached))
            if not cached:
                log.info("%s round %d: %d samples in %.1fs (%.2f samples/s)",
                         lifecycle.version_label(version), round_ + 1, samples, seconds,
                         samples / max(seconds, 1e-9))
        return run

    async def sample_ahead(self) -> int:
        """Production's first `gate.prefetch_rounds` rounds on the newest eval set that are
        not cached yet, one after another, while no evaluation or baseline runs (one that
        starts meanwhile takes over: no further round is started, and the one in flight is
        waited for by whoever needs it). Only once the eval set has its baseline, and only
        for an adapter version: the base model's first rounds are the baseline's (in the
        demo a first candidate is decided after one round, so more of the base model's
        would be sampled for nothing while SFT trains). The same
        `evaluate` call, key and seeds as an evaluation's production side, so decisions are
        unchanged. Returns the rounds sampled."""
        g = self.settings.gate
        if g.prefetch_rounds == 0 or self.busy.locked():
            return 0
        async with self.engine.connect() as conn:
            try:
                holdout = await load_holdout(conn, g.max_tasks, self.settings.rollout.envs)
            except NoEvalSet:
                return 0
            if not holdout.tasks or not await registry.latest_baseline(
                    conn, self.name, holdout.eval_set_version):
                return 0
            production = await registry.production_version(conn, self.name)
        if production is None:
            return 0  # the base model: its first rounds are the baseline's, sampled already
        adapter = await self._adapter(production)
        fmt = await asyncio.to_thread(lambda: self.policy.chat_format.version)
        label, sampled = lifecycle.version_label(production), 0
        run_of = run_key(self.settings, production, holdout, fmt)
        for r in range(min(g.prefetch_rounds, g.max_rounds)):
            key = round_key(run_of, r)
            async with self.engine.connect() as conn:
                if await cached_run(conn, key) is not None:
                    continue
            if self.busy.locked() or key in self._ahead:
                break  # an evaluation or a baseline has the engine: it samples what it needs
            started = time.monotonic()
            task = asyncio.create_task(self._sample_round(production, adapter, holdout, r, key))
            self._ahead[key] = task
            task.add_done_callback(functools.partial(self._ahead_done, key))
            run = await asyncio.shield(task)
            sampled += 1
            seconds = time.monotonic() - started
            log.info("%s round %d sampled ahead on eval set v%d: %d samples in %.1fs "
                     "(%.2f samples/s)", label, r + 1, holdout.eval_set_version,
                     len(run.attempts) + run.not_run, seconds,
                     (len(run.attempts) + run.not_run) / max(seconds, 1e-9))
        return sampled

    def _ahead_done(self, key: str, _: asyncio.Task[EvalRun]) -> None:
        self._ahead.pop(key, None)

    async def _sample_round(self, version: int | None, adapter: AdapterRef | None,
                            holdout: Holdout, round_: int, key: str) -> EvalRun:
        run = await evaluate(self.policy, holdout, adapter, self.settings, round_)
        async with self.engine.begin() as conn:
            await store_run(conn, key, self.name, holdout, run)
        return run

    async def ahead_forever(self, every_s: float = 30.0) -> None:
        """`sample_ahead` whenever kicked (after a baseline or an evaluation) and every
        `every_s` (an operator's rollback, a new eval set). A failure is logged and tried
        again at the next look: sampling ahead is never worth stopping the gate for."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.kick.wait(), every_s)
            self.kick.clear()
            try:
                await self.sample_ahead()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("sampling production's rounds ahead failed (tried again later): "
                            "%s", err)

    async def run_for(self, version: int | None, holdout: Holdout, rounds: int) -> EvalRun:
        """The first `rounds` rounds of `version` as one run."""
        adapter = await self._adapter(version)
        return EvalRun.combine([await self.round_for(version, adapter, holdout, r)
                                for r in range(rounds)])

    async def baseline(self, *, force: bool = False) -> dict[str, Any] | None:
        """Measure the base model (and production) on the newest eval set and record the
        recommended next stage; without `force`, only when that eval set has none yet."""
        from flywheel.gate.baseline import store_baseline
        from flywheel.gate.decision import metrics

        g = self.settings.gate
        async with self.engine.connect() as conn:
            holdout = await load_holdout(conn, g.max_tasks, self.settings.rollout.envs)
            done = await registry.latest_baseline(conn, self.name, holdout.eval_set_version)
            production = await registry.production_version(conn, self.name)
        if done and not force:
            await self.refresh_power(holdout)
            return None
        rounds = min(g.max_rounds, math.ceil(g.baseline_samples_per_task / g.round_samples))
        sides = 1 + (production is not None)
        async with self.busy, self.progress.activity(
                "baseline", eval_set_version=holdout.eval_set_version, rounds_planned=rounds,
                samples_planned=rounds * g.round_samples * len(holdout.tasks) * sides,
                detail=f"measuring the base model on eval set v{holdout.eval_set_version} "
                       "(the trainer waits for it)"):
            base = metrics(await self.run_for(None, holdout, rounds))
            prod = metrics(await self.run_for(production, holdout, rounds)) \
                if production else None
        async with self.engine.begin() as conn:
            record = await store_baseline(conn, self.name, holdout.eval_set_version, base, prod,
                                          g)
        log.info("baseline on eval set v%d: base success %.2f, invalid %.2f → %s (%s)",
                 holdout.eval_set_version, base.success_rate, base.invalid_rate,
                 record["recommendation"], record["reason"])
        await self.refresh_power(holdout)
        self.kick.set()
        return record

    async def refresh_power(self, holdout: Holdout) -> None:
        """Recompute what the eval set can see from production's cached samples on it.
        A failure here is logged, never raised: reporting must not hold up a decision."""
        try:
            async with self.engine.connect() as conn:
                found = await eval_set_power(conn, self.settings, holdout)
            await self.progress.power(found)
        except Exception as err:
            log.warning("could not update the eval set's power record: %s", err)

    async def _status(self, version: int) -> tuple[str | None, int | None]:
        async with self.engine.connect() as conn:
            status = await registry.version_status(conn, self.name, version)
            newest = await registry.newest_candidate(conn, self.name)
        return status, newest

    async def on_trained(self, trained: AdapterTrainedPayload) -> list[Event]:
        """Gate one published candidate (called for every `AdapterTrained`)."""
        if trained.policy != self.name or not trained.gate:
            return []  # another policy's, or a sampling snapshot the trainer did not propose
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

    async def on_proposed(self, proposed: CandidateProposedPayload) -> list[Event]:
        """Gate a snapshot the validation pass proposed (`CandidateProposed`)."""
        if proposed.policy != self.name:
            return []
        status, _ = await self._status(proposed.version)
        return await self.evaluate_version(proposed.version) if status == "candidate" else []

    async def evaluate_version(self, version: int) -> list[Event]:
        """Evaluate `version` against current production and record (and in auto mode carry
        out) the decision. Also how an operator re-evaluates a rolled-back version."""
        async with self.engine.connect() as conn:
            holdout = await load_holdout(conn, self.settings.gate.max_tasks,
                                         self.settings.rollout.envs)
        found = await asyncio.to_thread(canaries.run, holdout.tasks,
                                        self.settings.gate.canary_tasks, load_environment)
        async with self.engine.connect() as conn:
            how = await registry.selected_by(conn, self.name, version)
        # The train-vs-holdout check samples the candidate alongside its first round: the
        # same adapter and decoding, so the engine runs them in shared forwards (before, on
        # the demo: its 32 samples ran alone, within the 37 s between a proposal and the
        # start of round 1).
        train_task = asyncio.create_task(self._train_run(version, holdout.eval_set_version))
        try:
            return await self._decide(version, holdout, found, how, train_task)
        finally:
            if not train_task.done():
                train_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await train_task

    async def _decide(self, version: int, holdout: Holdout, found: GateCanaries | None,
                      how: str, train_task: asyncio.Task[EvalRun | None]) -> list[Event]:
        for _ in range(3):
            async with self.engine.connect() as conn:
                production = await registry.production_version(conn, self.name)
                k = await lifetime.candidate_number(conn, self.name, production)
            if production == version:
                raise lifecycle.LifecycleError(f"v{version} is production already")
            rule = lifetime.rule_for(self.settings.gate, k)
            timings: list[RoundTiming] = []
            candidate, baseline, probe = await self._rounds(version, production, holdout, rule,
                                                            timings, beside=train_task)
            train = await train_task
            payload = decision_payload(self.settings, version, production,
                                       holdout.eval_set_version, candidate, baseline, probe,
                                       found, train, candidate_number=k, rounds=timings)
            payload = payload.model_copy(update={"selected_by": how})
            try:
                async with self.engine.begin() as conn:
                    events = await lifecycle.record_evaluation(
                        conn, payload, self.settings.topics)
            except lifecycle.Conflict as err:
                log.warning("%s; evaluating again against the new production", err)
                continue
            self.kick.set()  # production may have changed: its rounds can be sampled ahead
            log.info("v%d: %s", version, " ".join(payload.reasons))
            if payload.power is not None and payload.power.warning:
                log.warning("v%d's evaluation: %s", version, payload.power.warning)
            await self.refresh_power(holdout)
            return events
        raise lifecycle.Conflict(f"production kept moving while v{version} was evaluated")

    async def _train_run(self, version: int, eval_set_version: int) -> EvalRun | None:
        """One round of the candidate on a sample of its own training tasks (not cached:
        the cache holds holdout runs only), for the train-vs-holdout gap; run beside the
        evaluation's first round (`evaluate_version`), which holds `busy`."""
        n = self.settings.gate.train_check_tasks
        if n == 0:
            return None
        async with self.engine.connect() as conn:
            tasks = await load_train_tasks(conn, version, n, self.settings.rollout.envs)
        if not tasks:
            return None
        adapter = await self._adapter(version)
        return await evaluate(self.policy, Holdout(eval_set_version, tasks), adapter,
                              self.settings)

    async def _rounds(self, version: int, production: int | None, holdout: Holdout,
                      rule: GateSettings, timings: list[RoundTiming] | None = None,
                      beside: asyncio.Task[Any] | None = None
                      ) -> tuple[EvalRun, EvalRun, LatencyProbe | None]:
        """Sample both sides round by round until the sequential test (at `rule`, this
        candidate's level) stops, a round cannot be completed, or the budget is spent (the
        fixed tests always spend it), probing latency each round; each round's seconds and
        samples/s into `timings`. Each probe waits for the gate's other sampling (`_quiet`):
        `beside`, the train-vs-holdout check sampled alongside round 1 (its outcome is the
        caller's to read), and production's rounds still being sampled ahead."""
        g = self.settings.gate
        cand_ref, prod_ref = await self._adapter(version), await self._adapter(production)
        n, vs = len(holdout.tasks), lifecycle.version_label(production)
        log.info("evaluating v%d against %s on %d holdout tasks (eval set v%d): rounds of %d "
                 "per task, budget k = %d", version, vs, n, holdout.eval_set_version,
                 g.round_samples, g.max_rounds * g.round_samples)
        cand: list[EvalRun] = []
        base: list[EvalRun] = []
        probes: list[tuple[list[float], list[float]]] = []
        async with self.busy, self.progress.activity(
                "evaluating", version=version, baseline_version=production,
                eval_set_version=holdout.eval_set_version, rounds_planned=g.max_rounds,
                samples_planned=2 * g.max_rounds * g.round_samples * n,  # both sides
                detail=f"v{version} against {vs}"):
            for r in range(g.max_rounds):
                cand.append(await self.round_for(version, cand_ref, holdout, r, timings))
                base.append(await self.round_for(production, prod_ref, holdout, r, timings,
                                                 "production"))
                await self._quiet(beside)
                if n:
                    probes.append(await probe_latency(self.policy, holdout.tasks[r % n],
                                                      cand_ref, prod_ref, self.settings, r))
                stop, detail = self._look(cand, base, r, rule)
                log.info("v%d round %d/%d: %s", version, r + 1, g.max_rounds, detail)
                await self.progress.round_done(r + 1, detail)
                if stop:
                    break
        return EvalRun.combine(cand), EvalRun.combine(base), latency_probe(probes)

    async def _quiet(self, beside: asyncio.Task[Any] | None) -> None:
        """Until nothing else the gate samples is in flight (`beside`, rounds sampled ahead):
        a latency probe's two sides, decoded back to back, must not share the engine with
        one side's other attempts — the train check runs the candidate's adapter, a round
        sampled ahead production's — and with a probe or two, the p95 is about one probe."""
        pending = [t for t in (beside, *self._ahead.values()) if t is not None and not t.done()]
        if pending:
            await asyncio.wait(pending)

    def _look(self, cand: list[EvalRun], base: list[EvalRun], r: int, g: GateSettings
              ) -> tuple[bool, str]:
        """(stop now?, progress in words) after round `r`."""
        c, b = EvalRun.combine(cand), EvalRun.combine(base)
        counts = round_counts(c, b, g.round_samples)
        if complete_rounds(c, b, g.round_samples) < max(r + 1, rounds_seen(c, b, g.round_samples)):
            return True, (f"round {r + 1} could not be completed after the retries "
                          f"({c.not_run} candidate and {b.not_run} production attempts not "
                          "run) → incomplete")
        if g.test != "sequential":
            pairs = sum(c.pairs for c in counts)
            return False, f"{pairs} pairs (fixed design: all {g.max_rounds} rounds)"
        out = sequential.run(counts, g)
        if not out.rounds:
            return False, "no paired attempts yet"
        last = out.rounds[-1]
        return out.stop is not None, (
            f"{last.pairs} pairs, gain {last.gain:+.3f}, e-value {last.e_value:.3g} "
            f"(promote at {1 / g.alpha:g}), futility {last.e_futility:.3g}"
            + (f" → {out.stop}" if out.stop else ""))


def decision_payload(settings: Settings, version: int, production: int | None,
                     eval_set_version: int, candidate: EvalRun, baseline: EvalRun,
                     probe: LatencyProbe | None = None, found: GateCanaries | None = None,
                     train: EvalRun | None = None, *, candidate_number: int = 1,
                     rounds: list[RoundTiming] | None = None) -> AdapterEvaluatedPayload:
    """The decision record of `candidate` against `baseline` under the configured rule, for
    the `candidate_number`-th candidate against this production, with its reward-hacking
    checks (`flywheel.gate.hacking`) and each round's timing."""
    return AdapterEvaluatedPayload(
        **dict(review(candidate, baseline, settings.gate, probe, found, train,
                      candidate_number=candidate_number)),
        evaluation_id=uuid.uuid4(),
        policy=settings.policy, version=version, baseline_version=production,
        eval_set_version=eval_set_version, mode=settings.gate.mode, rounds=rounds or [])


def describe(events: list[Any]) -> str:
    return ", ".join(e.type for e in events) or "nothing to do"
