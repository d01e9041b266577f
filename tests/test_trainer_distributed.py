"""Data-parallel pieces without a process group: the batch split and the torchrun command.
(The ranks themselves run in tests/test_trainer.py, under torchrun on CPU ranks.)"""

from __future__ import annotations

import random
import sys

import torch

from flywheel.config import Settings, TrainerSettings
from flywheel.stack.supervisor import service_argv
from flywheel.trainer.ranks import balance, rank_device


def test_balance_gives_every_item_to_exactly_one_rank_and_evens_the_load() -> None:
    rng = random.Random(7)
    for size in (1, 2, 3, 8):
        costs = [rng.randint(1, 500) for _ in range(rng.randint(0, 40))]
        parts = balance(costs, size)
        assert len(parts) == size
        assert sorted(i for p in parts for i in p) == list(range(len(costs)))
        assert parts == balance(costs, size)  # every rank computes the same split
        loads = [sum(costs[i] for i in p) for p in parts]
        if costs:  # greedy largest-first: no rank exceeds the mean by more than one item
            assert max(loads) - min(loads) <= max(costs)
    assert balance([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    assert balance([1], 3) == [[0], [], []]  # an idle rank still joins the all-reduce


def test_rank_device_follows_the_local_rank() -> None:
    assert rank_device("cpu", 3) == torch.device("cpu")
    assert rank_device("cuda", 2) == torch.device("cuda", 2)
    want = torch.device("cuda", 1) if torch.cuda.is_available() else torch.device("cpu")
    assert rank_device("auto", 1) == want


def test_up_starts_the_trainer_under_torchrun_only_with_several_ranks() -> None:
    assert service_argv(Settings(), "trainer") == [sys.executable, "-m", "consumers.trainer"]
    s = Settings(trainer=TrainerSettings(ranks=4))
    assert service_argv(s, "trainer") == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
        "-m", "consumers.trainer"]
    assert service_argv(s, "gate") == [sys.executable, "-m", "consumers.gate"]
