"""The trainer service's logic: batching, staleness, steps, atomic publication, heartbeat.

Durability: Kafka offsets are committed only up to groups whose effect is durable — trained
into a published, registered version, dropped as stale (recorded), or parked (a record that
is no event, a step that fails for good: `dead_letters`, consumer `trainer`) — never past a
group still waiting in the in-memory batch. A crash therefore resumes from the last published
version (weights and optimizer state) and re-reads exactly the groups it had not published;
groups already in a version are recognised in Postgres and skipped, so none is trained twice.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from aiokafka import TopicPartition
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import registry, retention
from flywheel.adapters.lifecycle import project
from flywheel.config import Settings
from flywheel.db import deadletters
from flywheel.db.deadletters import Parked
from flywheel.db.outbox import append_events
from flywheel.errors import InvalidRecord, failure_of, is_transient
from flywheel.events import AdapterTrained, AdapterTrainedPayload, GroupScored
from flywheel.policy.cores import ComputeThread, CoreShare, run_shared
from flywheel.runtime.commits import OrderedCommits, Positioned
from flywheel.runtime.consume import RetryPolicy, read_event, rewind, transiently
from flywheel.trainer import store
from flywheel.trainer.baseline_wait import wait_for_baseline
from flywheel.trainer.grpo import GRPOConfig

if TYPE_CHECKING:  # torch stays lazy: these import it
    from aiokafka import AIOKafkaConsumer, ConsumerRecord

    from flywheel.events import GroupScoredPayload
    from flywheel.mining.demos import Demonstration
    from flywheel.trainer.ranks import Ranks

log = logging.getLogger("flywheel.trainer")
T = TypeVar("T")


class Trainer(Protocol):
    """What the service drives: this process's `LoRATrainer`, or under torchrun the
    `distributed.Leader` that runs each operation on every rank."""

    @property
    def steps(self) -> int: ...

    def step(self, groups: Sequence[GroupScoredPayload]) -> dict[str, float]: ...

    def sft_step(self, demos: Sequence[Demonstration], *,
                 lr: float | None = None) -> dict[str, float]: ...

    def reset_optimizer(self) -> None: ...

    def save(self, directory: Path) -> None: ...


@dataclass
class _Pending:
    tp: TopicPartition
    offset: int
    group: GroupScoredPayload

    @property
    def topic(self) -> str:
        return str(self.tp.topic)

    @property
    def partition(self) -> int:
        return int(self.tp.partition)


@dataclass
class TrainerState:
    state: str = "starting"
    detail: str | None = None
    last_group_at: float = field(default_factory=time.monotonic)
    step_started_at: float | None = None
    stale_dropped: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    note: str | None = None
    """A decision the status keeps showing (e.g. why there was no SFT warm start)."""


def grpo_config(settings: Settings) -> GRPOConfig:
    t = settings.trainer
    return GRPOConfig(eps_low=t.eps_low, eps_high=t.eps_high, kl_coef=t.kl_coef,
                      scale_std=t.scale_std, loss_norm=t.loss_norm)


class TrainerService:
    def __init__(self, settings: Settings, engine: AsyncEngine,
                 ranks: Ranks | None = None) -> None:
        """`ranks` (`flywheel.trainer.ranks.Ranks`): this is rank 0 of a torchrun job,
        and every step is shared with the follower ranks."""
        from flywheel.adapters.factory import artifact_store

        self.settings, self.engine, self.ranks = settings, engine, ranks
        self.compute = ComputeThread("flywheel-trainer")
        """Every step, save and model build runs on this one thread (`ComputeThread`)."""
        self.cores = CoreShare(settings.stack.cores_dir, "trainer")
        """SFT steps take this share of the cores (every core when not shared), and so do
        GRPO steps when the stack shares them (else the fixed split of the launch)."""
        self.policy = settings.policy
        self.store = artifact_store(settings)
        self.version: int | None = None
        self.trainer: Trainer | None = None
        self.batch: list[_Pending] = []       # received, waiting for a full batch
        self.trained: list[_Pending] = []     # trained since the last publication
        self.stale: list[_Pending] = []       # dropped as stale since the last publication
        self.commits = OrderedCommits(logger=log)
        """Every fetched record is open until its effect is durable: parked, refused, already
        trained, dropped as stale (at once) or trained into a published version."""
        self.steps_since_publish = 0
        self.stale_since_publish = 0
        self.groups_since_candidate = 0
        self.status = TrainerState()
        self.retry = RetryPolicy.of(settings.retry)

    @property
    def started(self) -> Trainer:
        """The trainer `start` built (an error before it ran)."""
        if self.trainer is None:
            raise RuntimeError("the trainer service is not started: call start() first")
        return self.trainer

    async def start(self) -> None:
        """Resume from the newest registered version (its weights and optimizer state)."""
        from flywheel.policy.model_cache import resolve_model_dir
        from flywheel.trainer.engine import LoRASpec, LoRATrainer

        async with self.engine.connect() as conn:
            self.version = await registry.newest_version(conn, self.policy)
            self.groups_since_candidate = await store.groups_since_candidate(conn, self.policy)
        # Storage calls run off the event loop (S3: listings, downloads, hashing), so the
        # heartbeat keeps reporting meanwhile.
        published = await asyncio.to_thread(self.store.versions, self.policy)
        for orphan in [v for v in published if self.version is None or v > self.version]:
            # Published but never registered (a crash in between): not a version anyone saw.
            await asyncio.to_thread(self._discard, orphan)
        resume = None
        if self.version is not None:
            # Refuses a corrupted artifact.
            ref, _ = await asyncio.to_thread(self.store.load, self.policy, self.version)
            resume = ref.path
        t = self.settings.trainer
        self.model_dir = resolve_model_dir(self.settings.rollout.model_dir)
        self.trainer = await self.compute.run(
            LoRATrainer, self.model_dir, lora=LoRASpec(r=t.lora_r, alpha=t.lora_alpha),
            grpo=grpo_config(self.settings), lr=t.lr, grad_clip=t.grad_clip,
            micro_batch=t.micro_batch, resume_from=resume, precision=t.precision,
            gradient_checkpointing=t.gradient_checkpointing,
            device=t.device if self.ranks is None else str(self.ranks.device),
            chat_template=self.settings.rollout.chat_template)
        if self.ranks is not None:
            from flywheel.trainer.distributed import Leader

            # The followers build the same replica and receive these weights and moments.
            self.trainer = await self.compute.run(Leader, self.trainer, self.ranks)
        if self.version is None and self.settings.trainer.stages == "sft_then_grpo":
            await self.warm_start()
        self.status.state, self.status.detail = "waiting", None
        self.status.last_group_at = time.monotonic()
        log.info("trainer ready at %s", f"{self.policy}@v{self.version}" if self.version
                 else "the base model")

    async def warm_start(self) -> int | None:
        """Baseline first, then SFT if the baseline says so: publishes the SFT version (the
        parent of every GRPO version) and returns it; None when GRPO starts from the base."""
        from flywheel.mining.demos import load_demonstrations

        t = self.settings.trainer
        self.status.state = "warm_start"
        baseline = await self._wait_for_baseline()
        if baseline is None:
            self._decided(f"no baseline after {t.baseline_wait_s:.0f}s and none in progress "
                          "(is the gate running, is an eval set frozen?): GRPO starts from "
                          "the base model, without the SFT warm start", loud=True)
            return None
        log.info("baseline recommends %s: %s", baseline["recommendation"], baseline["reason"])
        if baseline["recommendation"] != "sft":
            self._decided(f"no SFT warm start: the baseline recommends "
                          f"{baseline['recommendation']} ({baseline['reason']})")
            return None
        async with self.engine.connect() as conn:
            demos = await load_demonstrations(conn, limit=t.sft_max_demos,
                                              holdout_fraction=self.settings.miner.holdout_fraction,
                                              reserve_share=t.sft_reserve_share,
                                              envs=self.settings.rollout.envs)
        if not demos:
            self._decided("SFT recommended but there are no demonstrations (successful or "
                          "corrected trajectories) yet: GRPO starts from the base model",
                          loud=True)
            return None
        # Sampling is held while the warm start runs (see the scheduler) and the gate is
        # idle once the baseline is in: the trainer may use every core meanwhile.
        await self._sft(demos)
        # GRPO starts with fresh optimizer moments, resumed or not (the state is published).
        await self.compute.run(self.started.reset_optimizer)
        return await self.publish(None, stage="sft", demos=len(demos))

    async def _wait_for_baseline(self) -> dict[str, Any] | None:
        def report(detail: str) -> None:
            self.status.detail = detail

        return await wait_for_baseline(self.engine, self.policy,
                                       self.settings.trainer.baseline_wait_s, report)

    def _decided(self, note: str, *, loud: bool = False) -> None:
        """A warm-start decision, in the log and kept in the status."""
        (log.warning if loud else log.info)("%s", note)
        self.status.note, self.status.detail = note, None

    async def _sft(self, demos: list[Demonstration]) -> None:
        from flywheel.trainer.sft import sft_batches, sft_step_count, sft_stratum

        t = self.settings.trainer
        steps = sft_step_count(t, len(demos))
        for step, batch in enumerate(sft_batches(demos, steps, t.sft_batch,
                                                 stratum=sft_stratum(t))):
            self.status.detail = f"SFT step {step + 1}/{steps} on {len(demos)} demos"
            metrics = await self.compute.run(run_shared, self.cores, self.started.sft_step,
                                              batch, lr=t.sft_lr)
            self.status.metrics = {f"sft_{k}": v for k, v in metrics.items()}
            log.info("SFT step %d/%d: loss %.4f", step + 1, steps, metrics["loss"])

    def _discard(self, version: int) -> None:
        self.store.discard(self.policy, version)
        log.warning("discarded unregistered adapter %s@v%d left by a crash", self.policy, version)

    async def on_records(self, records: Sequence[ConsumerRecord[bytes, bytes]],
                         consumer: AIOKafkaConsumer) -> None:
        """Take a fetch of `GroupScored` records; train and publish as batches fill.

        A transient failure while taking the fetch rewinds to it (fetched again, never
        skipped); one during a step keeps its groups for the next fetch. Either way, what
        is settled is committed as far as the order allows."""
        self.commits.open(records)
        settled: list[Positioned] = []  # nothing left to do for these once this fetch ends
        try:
            await self._take(records, settled)
        except Exception:
            rewind(consumer, records)
            raise
        try:
            b = self.settings.rollout.train_batch_groups
            while len(self.batch) >= b:
                chunk, self.batch = self.batch[:b], self.batch[b:]
                try:
                    await self._step(chunk)
                except Exception as err:
                    if is_transient(err):
                        self.batch = chunk + self.batch  # retried with the next fetch
                        raise
                    await self._park_step(chunk, err)
                    settled += chunk
                    continue
                if self.steps_since_publish >= self.settings.trainer.publish_every:
                    await self.publish(consumer, gate=await self._propose())
            if self.stale:
                settled += await self._record_stale()
        finally:
            await self.commits.settled(consumer, settled)

    async def _take(self, records: Sequence[ConsumerRecord[bytes, bytes]],
                    settled: list[Positioned]) -> None:
        """Read a fetch: park what cannot be read, skip groups already trained or of
        validation tasks (those settle now), and put the rest in the batch or the stale
        list."""
        items, unreadable, unreadable_records = [], [], []
        for r in records:
            try:
                event = read_event(r)
            except InvalidRecord as err:  # parked below: it cannot hold up the groups after it
                unreadable.append(Parked("trainer", r.topic, r.partition, r.offset, r.key,
                                         r.value or b"", failure_of(err)))
                unreadable_records.append(r)
                continue
            if isinstance(event, GroupScored) and event.payload.trainable:
                items.append(_Pending(TopicPartition(r.topic, r.partition), r.offset,
                                      event.payload))
            else:
                settled.append(r)  # not a group to train on
        if unreadable:
            await self._park(unreadable)
            settled += unreadable_records
        if items:
            self.status.last_group_at = time.monotonic()
        done = await self._already_consumed([p.group.group_id for p in items])
        refused = await self._refuse_validation(items)
        current = self.version or 0
        for p in items:
            if p.group.group_id in done or p.group.task_id in refused:
                settled.append(p)  # trained into a published version before a crash; or
                continue           # a validation task's group, refused (recorded above)
            if current - (p.group.adapter_version or 0) > self.settings.rollout.max_staleness:
                self.stale.append(p)
            else:
                self.batch.append(p)

    async def _park(self, parked: list[Parked]) -> None:
        """Durably record messages this trainer cannot use; their offsets may then move."""
        async def write() -> None:
            async with self.engine.begin() as conn:
                await deadletters.park(conn, parked, self.settings.topics)

        await transiently(write, self.retry, what=f"parking {len(parked)} records",
                          logger=log)
        log.error("parked %d records the trainer cannot read: %s", len(parked),
                  parked[0].failure.error)

    async def _park_step(self, chunk: list[_Pending], err: Exception) -> None:
        """A step that fails for good (not an outage) parks its groups, loudly, instead of
        failing every later step: which group broke it is in the error."""
        failure = failure_of(err)
        self.status.state = "waiting"
        log.error("a training step failed (%s); parking its %d groups", failure.error,
                  len(chunk), exc_info=err)
        await self._park([Parked("trainer", p.tp.topic, p.tp.partition, p.offset,
                                 str(p.group.group_id).encode(),
                                 p.group.model_dump_json().encode(), failure) for p in chunk])

    async def _already_consumed(self, ids: list[uuid.UUID]) -> set[uuid.UUID]:
        if not ids:
            return set()
        async with self.engine.connect() as conn:
            return await store.already_trained(conn, ids)

    async def _refuse_validation(self, items: list[_Pending]) -> set[uuid.UUID]:
        """Validation tasks are never trained on (the scheduler never requests them; a
        group of one that reaches the trainer anyway is refused, recorded and logged)."""
        if not items:
            return set()
        async with self.engine.begin() as conn:
            tasks = await store.validation_tasks_among(conn, [p.group.task_id for p in items])
            bad = [p.group.group_id for p in items if p.group.task_id in tasks]
            if bad:
                await store.mark_refused(conn, bad)
        if bad:
            log.error("refused %d groups of validation tasks: the trainer never updates on "
                      "them", len(bad))
        return tasks

    async def _step(self, chunk: list[_Pending]) -> None:
        self.status.state, self.status.step_started_at = "training", time.monotonic()
        try:
            metrics = await self.compute.run(
                run_shared, self.cores if self.settings.stack.cores_dir else None,
                self.started.step, [p.group for p in chunk])
        finally:
            self.status.step_started_at = None
        self.trained += chunk
        self.steps_since_publish += 1
        self.status.metrics = metrics
        self.status.state = "waiting"
        log.info("step %d: loss %.4f reward %.3f clip %.3f tokens/s %.0f", self.started.steps,
                 metrics.get("loss", 0.0), metrics.get("reward_mean", 0.0),
                 metrics.get("clip_frac", 0.0), metrics.get("tokens_per_s", 0.0))

    async def _propose(self) -> bool:
        """Whether the next GRPO version goes to the gate at publication: never while
        there is a validation split (the validation pass chooses candidates then); else
        (`propose_min_groups`) enough new training since the last candidate, and no
        earlier candidate still waiting."""
        need = self.settings.trainer.propose_min_groups
        async with self.engine.connect() as conn:
            if await store.validation_selects(conn, self.settings.validation,
                                              self.settings.rollout.envs):
                return False  # the validation pass proposes (flywheel.validation.scoring)
        if need == 0:
            return True
        if self.groups_since_candidate + len(self.trained) < need:
            return False
        async with self.engine.connect() as conn:
            return await registry.candidates_waiting(conn, self.policy) == 0

    async def _record_stale(self) -> list[_Pending]:
        """Dropped groups are recorded (and counted) at once; their offsets can then move."""
        async with self.engine.begin() as conn:
            await store.mark_stale(conn, [p.group.group_id for p in self.stale])
        self.status.stale_dropped += len(self.stale)
        self.stale_since_publish += len(self.stale)
        log.warning("dropped %d stale groups (older than %d versions)", len(self.stale),
                    self.settings.rollout.max_staleness)
        dropped, self.stale = self.stale, []
        return dropped

    async def publish(self, consumer: AIOKafkaConsumer | None, *,
                      stage: Literal["sft", "grpo"] = "grpo", demos: int = 0,
                      gate: bool = True) -> int:
        """Write the adapter atomically, register it, emit AdapterTrained, then commit.
        `gate` False: a snapshot for sampling, not proposed to the gate. `consumer` None
        only for the warm start, which runs before any group is fetched (none to commit)."""
        assert consumer is not None or not self.trained, "trained groups need their commit"
        version = (self.version or 0) + 1
        self.store.staging_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".staging-v{version}-",
                                        dir=self.store.staging_dir))
        try:
            await self.compute.run(self.started.save, staging)
            ids = [str(p.group.group_id) for p in self.trained]
            ref = await asyncio.to_thread(
                self.store.publish, self.policy, version, staging,
                base_model=str(self.model_dir), parent_version=self.version,
                steps=self.started.steps, groups_consumed=ids, stage=stage,
                extra={"demonstrations": demos} if stage == "sft" else None)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        payload = AdapterTrainedPayload(
            policy=self.policy, version=version, parent_version=self.version,
            path=str(ref.path), stage=stage, steps=self.started.steps, groups=len(ids),
            stale_dropped=self.stale_since_publish, metrics=self.status.metrics, gate=gate)
        event = AdapterTrained(aggregate_id=f"{self.policy}@v{version}", payload=payload)
        async with self.engine.begin() as conn:
            await project(conn, event)  # registers the version (a projection of the event)
            await store.mark_trained(conn, [p.group.group_id for p in self.trained], version)
            await append_events(conn, [event], self.settings.topics)
        published, self.trained = self.trained, []
        self.version, self.steps_since_publish = version, 0
        self.stale_since_publish = 0
        self.groups_since_candidate = 0 if gate else self.groups_since_candidate + len(ids)
        if consumer is not None:
            await self.commits.settled(consumer, published)
        await self._retain()
        log.info("published %s@v%d (%s, %d groups%s)", self.policy, version, stage, len(ids),
                 "" if gate else "; a snapshot for sampling, not proposed to the gate")
        return version

    async def _retain(self) -> None:
        await retention.retain(self.engine, self.store, self.policy,
                               keep=self.settings.trainer.keep_versions,
                               rollout=self.settings.rollout)

    def keepalive(self) -> None:
        """Under torchrun: an idle trainer still talks to its followers within the process
        group's timeout (see `flywheel.trainer.distributed`)."""
        keepalive = getattr(self.trainer, "keepalive", None)
        if keepalive is not None:
            keepalive()

    def stop_followers(self) -> None:
        """Under torchrun: the follower ranks leave with rank 0 (ready or not)."""
        if self.ranks is None:
            return
        from flywheel.trainer.distributed import stop_followers

        stop_followers()

    def watch(self) -> tuple[str, str | None]:
        """The state to report: a long step is `stalled`, a long silence is `starved`."""
        now, t = time.monotonic(), self.settings.trainer
        s = self.status
        if s.step_started_at is not None and now - s.step_started_at > t.stalled_after_s:
            return "stalled", f"step running for {now - s.step_started_at:.0f}s"
        if s.state == "waiting" and now - s.last_group_at > t.starved_after_s:
            return ("starved", f"no scored groups for {now - s.last_group_at:.0f}s "
                    f"({len(self.batch)} of {self.settings.rollout.train_batch_groups} "
                    "waiting): are rollout workers running?")
        return s.state, s.detail or s.note

    async def heartbeat(self) -> None:
        state, detail = self.watch()
        async with self.engine.begin() as conn:
            if state in ("waiting", "starved"):  # idle because validation paused sampling?
                paused = await store.overfitting(conn, self.policy)
                if paused is not None:
                    state, detail = "overfitting", paused
            await store.write_status(
                conn, self.policy, state=state, detail=detail, version=self.version,
                steps=self.trainer.steps if self.trainer else 0,
                stale_dropped=self.status.stale_dropped, metrics=self.status.metrics)
