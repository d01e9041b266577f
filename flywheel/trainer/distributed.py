"""Data-parallel training under `torchrun`: N ranks (one per GPU), one trainer.

Rank 0 is the trainer service: it alone consumes Kafka, reads and writes Postgres, publishes
versions and commits offsets. Ranks 1..N-1 are followers: each holds a replica of the model
and optimizer and runs exactly the operations rank 0 sends it, in the same order
(`Leader` → `follow`):

- `init`: the LoRA shape, optimizer settings and base model of rank 0's trainer (fresh or
  resumed from a published version); then rank 0's adapter weights, optimizer moments and
  step count are broadcast to every replica, as DDP broadcasts module state at start.
- `step` / `sft`: the same batch goes to every rank; each runs the forward/backward of its
  own share (whole prompts, balanced by tokens, so the shared-prompt reuse of
  `flywheel.trainer.prefix` still applies), weighted by the *global* token or sample count;
  the gradients are summed in one flat all-reduce, and every rank clips and steps the same
  AdamW on the same gradient, so the replicas stay identical and the step equals the
  single-process step over the whole batch.
- `check` (before every publication): the replicas' weights are hashed and compared, and a
  divergence fails the publication loudly instead of publishing one rank's weights.
- `ping` (while idle) keeps the collectives inside the process-group timeout, and `stop`
  ends the followers when the service shuts down.

Why not `torch.nn.parallel.DistributedDataParallel`: one step here is many forwards and
backwards (a shared prefix, each prompt once, its completions on the cached keys/values,
then the prompt's backward), and the trainable parameters are a few MB of LoRA weights. One
explicit all-reduce per step after all of them is simpler and exact, where DDP's hooks would
fire on every partial backward (`no_sync` everywhere but a last backward that need not touch
every parameter).

One node: every rank reads the base model from rank 0's path. A follower crash or a rank 0
crash ends the collective; torchrun stops the job, and the restarted job resumes from the
last published version like a single-process trainer (no group lost or trained twice).

Import this module lazily: it imports torch.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist

from flywheel.trainer.ranks import Ranks

if TYPE_CHECKING:
    from flywheel.events import GroupScoredPayload
    from flywheel.mining.demos import Demonstration
    from flywheel.trainer.engine import LoRATrainer

log = logging.getLogger("flywheel.trainer")
T = TypeVar("T")


def _broadcast(obj: Any = None) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sync_state(trainer: LoRATrainer, rank: int) -> None:
    """Rank 0's adapter weights, optimizer moments and step count onto every replica."""
    with torch.no_grad():
        for p in trainer.trainable():
            dist.broadcast(p.data, src=0)
    state = None
    if rank == 0:
        opt = trainer.optimizer.state_dict()
        state = {"steps": trainer.steps, "optimizer": {
            "param_groups": opt["param_groups"],
            "state": {k: {n: t.cpu() if isinstance(t, torch.Tensor) else t
                          for n, t in s.items()} for k, s in opt["state"].items()}}}
    state = _broadcast(state)
    if rank != 0:
        trainer.optimizer.load_state_dict(state["optimizer"])  # moves moments to the device
        trainer.steps = int(state["steps"])


class _Channel:
    """Rank 0's side of the process group: one operation at a time (rank 0 calls from worker
    threads and from its heartbeat), so every rank sees the same order; none after `stop`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopped = False
        self.broken: BaseException | None = None

    def run(self, cmd: tuple[Any, ...], local: Callable[[], T], *, exit_on_failure: bool,
            blocking: bool = True) -> T | None:
        """Send `cmd`, then run `local` here (None: not blocking and the channel was busy).

        Any failure (a rank died, out of memory, diverged replicas) leaves the ranks out of
        step for good: rank 0 exits at once (status 70) and torchrun stops the job;
        restarted, it resumes from the last published version, like a single trainer after a
        crash (`exit_on_failure=False`: raise instead)."""
        if not self.lock.acquire(blocking=blocking):
            return None
        try:
            if self.stopped:
                raise RuntimeError("the follower ranks were stopped: rank 0 is shutting down")
            if self.broken is not None:
                raise RuntimeError(f"the process group failed earlier: {self.broken}")
            try:
                _broadcast(cmd)
                result = local()
            except Exception as err:
                self.broken = err
                if exit_on_failure:
                    log.critical("data-parallel %s failed (%s: %s); exiting so torchrun "
                                 "restarts the job from the last published version",
                                 cmd[0], type(err).__name__, err)
                    logging.shutdown()
                    os._exit(70)
                raise
            self.stopped = cmd[0] == "stop"
            return result
        finally:
            self.lock.release()


_channel = _Channel()


class Leader:
    """Rank 0's handle on the trainer (what `TrainerService` calls): each operation is sent
    to the followers first, then run here; they all run it together."""

    def __init__(self, trainer: LoRATrainer, ranks: Ranks) -> None:
        self.trainer, self.ranks = trainer, ranks
        trainer.ranks = ranks
        self._run(("init", trainer.spec(), trainer.grpo, trainer.lr, trainer.grad_clip,
                   trainer.micro_batch, str(trainer.model_dir), trainer.chat_template,
                   trainer.precision, trainer.gradient_checkpointing,
                   [(n, tuple(p.shape)) for n, p in trainer.named_trainable()]),
                  lambda: _sync_state(trainer, 0))
        log.info("data-parallel trainer: %d ranks, %s on rank 0", ranks.size, ranks.device)

    def _run(self, cmd: tuple[Any, ...], local: Callable[[], T]) -> T:
        return cast(T, _channel.run(cmd, local, exit_on_failure=True))

    @property
    def steps(self) -> int:
        return self.trainer.steps

    def step(self, groups: Sequence[GroupScoredPayload]) -> dict[str, float]:
        metrics = self._run(("step", list(groups)), lambda: self.trainer.step(groups))
        return {**metrics, "ranks": float(self.ranks.size)}

    def sft_step(self, demos: Sequence[Demonstration], *,
                 lr: float | None = None) -> dict[str, float]:
        return self._run(("sft", list(demos), lr), lambda: self.trainer.sft_step(demos, lr=lr))

    def reset_optimizer(self) -> None:
        self._run(("reset",), self.trainer.reset_optimizer)

    def save(self, directory: Path) -> None:
        """Every replica must hold the same weights; rank 0's are written (a local error
        writing them is an ordinary publication failure, not a broken group)."""
        self._run(("check",), lambda: self.ranks.check_replicas(self.trainer.trainable()))
        self.trainer.save(directory)

    def keepalive(self) -> None:
        """While idle, a no-op collective (a busy trainer is alive anyway)."""
        if not (_channel.stopped or _channel.broken):
            _channel.run(("ping",), lambda: None, exit_on_failure=True, blocking=False)


def stop_followers() -> None:
    """Rank 0 is shutting down: the followers leave, whether its trainer is ready or not;
    later operations fail instead of waiting for ranks that are gone."""
    if _channel.stopped or _channel.broken:
        return  # nobody listens any more
    try:
        _channel.run(("stop",), lambda: None, exit_on_failure=False)
    except Exception as err:
        log.warning("could not stop the follower ranks (%s); torchrun ends them", err)


def follow(ranks: Ranks) -> None:
    """A follower rank's whole life: build the replica rank 0 describes, then run what it
    sends until `stop`. SIGTERM/SIGINT are ignored: torchrun forwards them to every rank, and
    a follower leaves when rank 0 has shut down cleanly and says `stop` (or is killed)."""
    from flywheel.trainer.engine import LoRATrainer

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    first = _broadcast()
    if first[0] == "stop":  # rank 0 shut down before its trainer was ready
        return
    if first[0] != "init":
        raise RuntimeError(f"rank {ranks.rank}: expected init from rank 0, got {first[0]!r}")
    (_, spec, grpo, lr, grad_clip, micro_batch, model_dir, chat_template, precision,
     checkpointing, shapes) = first
    trainer = LoRATrainer(Path(model_dir), lora=spec, grpo=grpo, lr=lr, grad_clip=grad_clip,
                          micro_batch=micro_batch, device=str(ranks.device),
                          precision=precision, gradient_checkpointing=checkpointing,
                          chat_template=chat_template)
    mine = [(n, tuple(p.shape)) for n, p in trainer.named_trainable()]
    if mine != shapes:
        raise RuntimeError(f"rank {ranks.rank}: the replica's LoRA parameters differ from "
                           "rank 0's")
    trainer.ranks = ranks
    _sync_state(trainer, ranks.rank)
    log.info("rank %d following rank 0 on %s", ranks.rank, ranks.device)
    while True:
        cmd = _broadcast()
        if cmd[0] == "step":
            trainer.step(cmd[1])
        elif cmd[0] == "sft":
            trainer.sft_step(cmd[1], lr=cmd[2])
        elif cmd[0] == "reset":
            trainer.reset_optimizer()
        elif cmd[0] == "check":
            ranks.check_replicas(trainer.trainable())
        elif cmd[0] == "stop":
            log.info("rank %d: stop after %d steps", ranks.rank, trainer.steps)
            return
        elif cmd[0] != "ping":
            raise RuntimeError(f"unknown command from rank 0: {cmd[0]!r}")
