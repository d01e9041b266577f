"""Requests that arrive together, run together: the local engine's admission of concurrent calls.

The gate submits every task of a round at once and a rollout worker keeps several groups in
flight; on one model those calls would only queue. Here they wait in one list while the
engine is busy, and the next job takes every waiting request that can share a forward pass
with the oldest one — the same adapter (a batch runs under one set of weights) and the same
decoding rules (temperature, top-p, token limit, stop strings) — so a round of thirty tasks
becomes a few batched forwards instead of thirty. The oldest request always goes next, so
another adapter's requests wait at most one job. Each request keeps its own seed: the engine
draws its rows from its own generator (`flywheel.policy.sampling.sample_rows`), so what it
samples does not depend on what it shared a batch with.

Pure asyncio; no torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flywheel.policy.base import Completion, SamplingParams

Messages = Sequence[Mapping[str, Any]]
Tools = Sequence[Mapping[str, Any]] | None


@dataclass
class Job:
    """One caller's request: `params.n` completions for each of its prompts."""

    prompts: list[Messages]
    params: SamplingParams
    tools: Tools
    adapter: str | None
    done: asyncio.Future[list[Completion]] = field(repr=False)


def batch_key(job: Job) -> tuple[Any, ...]:
    """Jobs with equal keys can share a forward pass."""
    p = job.params
    return (job.adapter, p.temperature, p.top_p, p.max_tokens, tuple(p.stop))


Results = list[list[Completion] | BaseException]


def settle(job: Job, result: list[Completion] | BaseException) -> None:
    """Hand a job its completions (or error) unless its caller is gone or it has them."""
    if job.done.done():
        return
    if isinstance(result, BaseException):
        job.done.set_exception(result)
    else:
        job.done.set_result(result)


def early_settler(jobs: list[Job]) -> Callable[[int, list[Completion] | BaseException], None]:
    """For a runner on another thread: `settle(jobs[i], result)` on the jobs' event loop as
    soon as job i is finished, so its caller goes on (a gate task counted done, a group
    scored) while the rest of the batch still runs; the batch's final results change
    nothing for a job settled this way."""
    loop = asyncio.get_running_loop()

    def done(i: int, result: list[Completion] | BaseException) -> None:
        loop.call_soon_threadsafe(settle, jobs[i], result)
    return done
Runner = Callable[[list[Job]], Awaitable[Results]]
"""Runs a batch of compatible jobs on the engine: each job's completions, or its error."""


class Batcher:
    """Collects concurrent jobs and hands them to `run` in compatible batches, one at a time."""

    def __init__(self, run: Runner, max_jobs: int = 256) -> None:
        self._run, self.max_jobs = run, max_jobs
        self._waiting: list[Job] = []
        self._drain: asyncio.Task[None] | None = None
        self.batches = 0
        """Batches run so far (benchmarks and tests read it)."""

    async def submit(self, prompts: list[Messages], params: SamplingParams, tools: Tools,
                     adapter: str | None) -> list[Completion]:
        job = Job(prompts, params, tools, adapter, asyncio.get_running_loop().create_future())
        self._waiting.append(job)
        if self._drain is None or self._drain.done():
            self._drain = asyncio.create_task(self._drain_all())
        return await job.done

    def _next_batch(self) -> list[Job]:
        self._waiting = [j for j in self._waiting if not j.done.done()]  # callers gone
        if not self._waiting:
            return []
        key = batch_key(self._waiting[0])
        batch = [j for j in self._waiting if batch_key(j) == key][:self.max_jobs]
        taken = {id(j) for j in batch}
        self._waiting = [j for j in self._waiting if id(j) not in taken]
        return batch

    async def _drain_all(self) -> None:
        while batch := self._next_batch():
            self.batches += 1
            try:
                results = await self._run(batch)
            except asyncio.CancelledError:
                for job in batch:
                    job.done.cancel()
                raise
            except Exception as err:  # the engine failed: every caller of the batch hears it
                for job in batch:
                    if not job.done.done():
                        job.done.set_exception(err)
                continue
            for job, result in zip(batch, results, strict=True):
                settle(job, result)
