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
