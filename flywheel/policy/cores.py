"""Cores follow the work: torch services on one machine share its cores by who is busy now.

The rollout worker, the trainer and the gate each hold a model. A fixed split (one thread
each on 2 cores) leaves a core idle whenever only one of them works — the baseline, a gate
round while rollouts wait on admission, an SFT step — and giving each every core
oversubscribes the machine when they all work, which OpenMP's spin-waiting punishes hard
(measured here: one process on 4 groups took 152 s and 147 s with 2 threads against 28 s and
25 s with 1, on 2 cores other work was using — docs/BENCHMARKS.md). So each one announces its heavy
operations in a shared directory (one file per busy process, removed when the operation
ends; a dead process's file is ignored) and sizes torch's intra-op pool, at the start of
every operation, to its share of the cores among the processes busy at that moment:
`cores // busy`. A process alone at work gets every core; two busy ones get half each.

Why files and not a shared engine: one inference service for everyone would also share one
copy of the model, but it puts every call (the trainer's scoring, the gate, serving) behind
one more network hop and one more process to supervise; a lease is ten lines of bookkeeping
each process already runs in its own thread, and needs nothing running. The share is set per
operation (a batched generate, a trainer step), so a process that becomes busy mid-way is
accounted for at the next one: at most one operation's worth of overlap.

Opt-in (`stack.cores_dir`): the marks count only this stack's torch services, not other work
on the machine, and OpenMP threads that share a core with anything else spin-wait: on the
shared 2-core development machine (load 2–4 from other work) one process alone sampling
with 2 threads took 147–152 s for 4 groups against 25–28 s with 1 (docs/BENCHMARKS.md). On
a machine the stack has to itself it gives a lone busy service every core.

Pure Python (torch is imported only to set the pool, in the thread that computes).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
STALE_S = 3600.0
"""A busy mark older than this is ignored even if its process lives (a hung operation)."""


def machine_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CoreShare:
    """One process's view of the busy marks in `directory` (None = no sharing: every core)."""

    def __init__(self, directory: Path | None, name: str, cores: int | None = None) -> None:
        self.directory, self.cores = directory, cores or machine_cores()
        self._mark = None if directory is None else directory / f"{name}.{os.getpid()}.busy"
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def busy_others(self) -> int:
        """Other live processes busy now."""
        if self.directory is None:
            return 0
        now, count = time.time(), 0
        for mark in self.directory.glob("*.busy"):
            if mark == self._mark:
                continue
            try:
                pid = int(mark.name.rsplit(".", 2)[-2])
                fresh = now - mark.stat().st_mtime < STALE_S
            except (ValueError, OSError):
                continue
            if fresh and _alive(pid):
                count += 1
        return count

    def share(self) -> int:
        """Threads for an operation starting now: this process's share of the cores."""
        return max(1, self.cores // (1 + self.busy_others()))

    @contextlib.contextmanager
    def busy(self) -> Iterator[int]:
        """Marked busy for the block; yields the threads to use (`share`)."""
        if self._mark is None:
            yield self.cores
            return
        self._mark.touch()
        try:
            yield self.share()
        finally:
            with contextlib.suppress(FileNotFoundError):
                self._mark.unlink()


def run_shared(share: CoreShare | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args)` marked busy, with torch's intra-op pool at this process's share, restored
    after (torch keeps the count per thread: call this in the thread that computes)."""
    if share is None:
        return fn(*args, **kwargs)
    import torch

    before = torch.get_num_threads()
    with share.busy() as threads:
        torch.set_num_threads(threads)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)


class ComputeThread:
    """The one thread a process runs its heavy torch work on (a trainer's steps, its saves).

    glibc gives every thread that allocates its own malloc arena and keeps in it what was
    freed there. Steps sent to `asyncio.to_thread` land on whichever pool thread is idle,
    so each pool thread comes to hold a step's peak: measured with SFT steps on the
    helpdesk's episode demonstrations (1,350-2,100 tokens), 5.9 GB after the first step and
    21 GB after the fifth once the pool had 6 threads, against 5.9 GB throughout on one
    thread. (The local engine has its own worker thread for the same reason.)"""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
