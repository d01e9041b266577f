"""Run by `torchrun` from tests/test_trainer.py: rank 0 resumes a checkpoint and drives the
followers through SFT and GRPO steps (`flywheel.trainer.distributed`), then saves.

    torchrun --standalone --nproc_per_node=2 tests/support/dist_trainer_worker.py DATA OUT [DEVICE]

DEVICE: `cpu` (gloo, the default) or `cuda` (NCCL, one GPU per rank).
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flywheel.trainer import distributed
from flywheel.trainer import ranks as process_group
from flywheel.trainer.engine import LoRASpec, LoRATrainer
from flywheel.trainer.grpo import GRPOConfig


def run_ops(trainer: Any, ops: Sequence[tuple[str, Any]]) -> None:
    """The steps both sides take: ("sft", demos) or ("grpo", groups)."""
    for kind, batch in ops:
        if kind == "sft":
            trainer.sft_step(batch, lr=1e-3)
        else:
            trainer.step(batch)


def main() -> None:
    data = pickle.loads(Path(sys.argv[1]).read_bytes())
    ranks = process_group.init(sys.argv[3] if len(sys.argv) > 3 else "cpu", 300)
    try:
        if ranks.rank:
            distributed.follow(ranks)
            return
        trainer = LoRATrainer(data["model_dir"], lora=LoRASpec(r=4), grpo=GRPOConfig(),
                              lr=1e-3, micro_batch=2, resume_from=data["resume"])
        leader = distributed.Leader(trainer, ranks)
        run_ops(leader, data["ops"])
        leader.save(Path(sys.argv[2]))
        distributed.stop_followers()
    finally:
        process_group.close()


if __name__ == "__main__":
    main()
