"""Cores follow the work: a process alone at work gets every core, busy ones share them, and
marks of processes that are gone or idle count for nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from flywheel.policy.cores import CoreShare


def test_share_follows_who_is_busy(tmp_path: Path) -> None:
    gate = CoreShare(tmp_path, "gate", cores=4)
    trainer = CoreShare(tmp_path, "trainer", cores=4)
    assert gate.share() == 4  # alone at work: every core
    with trainer.busy() as threads:
        assert threads == 4
        assert gate.share() == 2  # the trainer is busy: half each
        with gate.busy() as mine:
            assert mine == 2
            assert CoreShare(tmp_path, "rollout", cores=4).share() == 1  # 4 // 3
    assert gate.share() == 4 and not list(tmp_path.glob("*.busy"))  # marks removed


def test_marks_of_dead_processes_are_ignored(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    (tmp_path / f"trainer.{gone.stdout.strip()}.busy").touch()
    (tmp_path / f"rollout.{os.getppid()}.busy").touch()  # a live one
    assert CoreShare(tmp_path, "gate", cores=2).share() == 1
    (tmp_path / f"rollout.{os.getppid()}.busy").unlink()
    assert CoreShare(tmp_path, "gate", cores=2).share() == 2


def test_no_directory_means_every_core() -> None:
    share = CoreShare(None, "gate", cores=3)
    with share.busy() as threads:
        assert threads == 3


async def test_heavy_work_runs_on_one_thread_whatever_the_default_pool_holds() -> None:
    """Steps sent to `asyncio.to_thread` rotate over the pool's idle threads, and glibc
    keeps a step's peak in each thread's arena (21 GB after 5 SFT steps on 6 threads):
    a `ComputeThread` runs every call on the same thread, never the event loop's."""
    import asyncio
    import threading
    import time

    from flywheel.policy.cores import ComputeThread

    compute = ComputeThread("test-compute")
    try:
        await asyncio.gather(*(asyncio.to_thread(time.sleep, 0.05) for _ in range(6)))
        ours = {await compute.run(threading.get_ident) for _ in range(10)}
        ours |= set(await asyncio.gather(*(compute.run(threading.get_ident)
                                           for _ in range(6))))
        assert len(ours) == 1 and threading.get_ident() not in ours
        assert await compute.run(lambda a, b=0: a + b, 2, b=3) == 5
    finally:
        compute.close()
