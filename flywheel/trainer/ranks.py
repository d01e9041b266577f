"""The trainer's process group: which rank it is, its device, its share of a batch, and the
collectives a data-parallel step needs (see `flywheel.trainer.distributed`).

Import this module lazily: it imports torch.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def rank_device(setting: str, local_rank: int) -> torch.device:
    """This rank's device: with `auto` or `cuda`, the GPU numbered by the local rank."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(setting)


def balance(costs: Sequence[int], size: int) -> list[list[int]]:
    """Indices of `costs` per rank, so the ranks' summed costs are close (largest first,
    each onto the least loaded rank). Deterministic: every rank computes the same split."""
    loads = [0] * size
    parts: list[list[int]] = [[] for _ in range(size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(size), key=lambda r: (loads[r], r))
        parts[r].append(i)
        loads[r] += costs[i]
    return [sorted(p) for p in parts]


@dataclass(frozen=True)
class Ranks:
    """The trainer's view of the process group: its share of a batch, summed gradients."""

    rank: int
    size: int
    device: torch.device

    def share(self, costs: Sequence[int]) -> list[int]:
        return balance(costs, self.size)[self.rank]

    def sum_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Every rank's gradients summed into every rank's `.grad` (one flat all-reduce; a
        rank whose share touched no parameter contributes zeros)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def sum_values(self, values: dict[str, float]) -> dict[str, float]:
        """Per key, the sum over ranks (keys missing on a rank count 0)."""
        gathered: list[dict[str, float] | None] = [None] * self.size
        dist.all_gather_object(gathered, values)
        keys = sorted({k for g in gathered if g for k in g})
        return {k: sum((g or {}).get(k, 0.0) for g in gathered) for k in keys}

    def check_replicas(self, params: Sequence[torch.Tensor]) -> None:
        """Raise unless every rank holds bit-identical trainable weights."""
        digest = hashlib.sha256()
        for p in params:
            digest.update(p.detach().float().cpu().numpy().tobytes())
        gathered: list[str | None] = [None] * self.size
        dist.all_gather_object(gathered, digest.hexdigest())
        if len(set(gathered)) != 1:
            raise RuntimeError(
                "data-parallel replicas diverged: rank weight digests "
                f"{[str(g)[:12] for g in gathered]}; refusing to publish (the job restarts "
                "from the last published version)")


def init(device: str, timeout_s: float) -> Ranks:
    """Join the torchrun process group: NCCL when the ranks use GPUs, else gloo."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda:"):
        raise ValueError(f"trainer.device={device!r} would put every rank on one GPU: under "
                         "torchrun use auto or cuda (each rank takes the GPU of its "
                         "LOCAL_RANK; choose GPUs with CUDA_VISIBLE_DEVICES)")
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = rank_device(device, local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                            timeout=timedelta(seconds=timeout_s))
    return Ranks(rank, size, dev)


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
