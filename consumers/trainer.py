"""Trainer: continual GRPO on a LoRA adapter from scored groups.

Subscribes: `<prefix>.rollouts` (`GroupScored`, trainable groups), group `trainer.group_id`.
Writes:     the adapter store (atomic, checksummed versions), `adapter_versions`,
            `rollout_groups.trained_at/consumed_as`, `trainer_status` (heartbeat),
            `events` + `outbox`.
Publishes (through the outbox): `AdapterTrained` → `<prefix>.adapters`; `RecordParked` →
            `<prefix>.parked` for a record that is no event or a step that fails for good.

Before the first training of a policy (`trainer.stages = sft_then_grpo`) it waits for the
gate's baseline and, when that recommends SFT, publishes an SFT warm start from
demonstrations (successes and corrected failures, never holdout) as version 1.
Batches B groups per step; drops groups sampled more than `max_staleness` versions ago
(recorded and counted); publishes a version every `publish_every` steps; commits offsets
only once their groups' effect is durable. Reports `starved`/`stalled` instead of hanging.

Several GPUs: `torchrun --standalone --nproc_per_node=N -m consumers.trainer`. Rank 0 is
this service; the other ranks follow it and share every step (data parallel, see
`flywheel.trainer.distributed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from faststream import FastStream
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.runtime.consume import records_of, subscribe_batch
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url
from flywheel.runtime.entrypoint import LOG_FORMAT, cancel_all, run_faststream
from flywheel.trainer.learner import TrainerService

if TYPE_CHECKING:
    from flywheel.trainer.ranks import Ranks

log = logging.getLogger("flywheel.trainer")
HEARTBEAT_S = 2.0


def build_app(settings: Settings, ranks: Ranks | None = None) -> FastStream:
    """`ranks`: this process is rank 0 of a torchrun job (`flywheel.trainer.distributed`)."""
    broker = KafkaBroker(resolve_bootstrap(settings), logger=log)
    engine = make_engine(resolve_db_url(settings), pool_size=2)
    service = TrainerService(settings, engine, ranks)
    tasks: list[asyncio.Task[None]] = []

    # A CPU step can take minutes. Offsets: the service commits what is durable.
    @subscribe_batch(broker, settings.topics.rollouts, settings, settings.trainer.group_id,
                     max_records=settings.rollout.train_batch_groups * 4, slow=True)
    async def train(batch: Any, msg: KafkaMessage) -> None:
        await service.on_records(records_of(batch), msg.consumer)

    app = FastStream(broker, logger=log)

    @app.on_startup
    async def _load() -> None:
        async def beat() -> None:
            pinged = time.monotonic()
            while True:
                try:
                    await service.heartbeat()
                    if time.monotonic() - pinged > settings.trainer.dist_timeout_s / 6:
                        pinged = time.monotonic()
                        await asyncio.to_thread(service.keepalive)
                except Exception as err:  # a missed heartbeat must not stop training
                    log.warning("heartbeat failed: %s", err)
                await asyncio.sleep(HEARTBEAT_S)

        # The heartbeat runs from the start: loading, the baseline wait and the SFT warm
        # start are visible in status too.
        tasks.append(asyncio.create_task(beat()))
        await service.start()

    @app.after_shutdown
    async def _close() -> None:
        await cancel_all(tasks)
        await asyncio.to_thread(service.stop_followers)
        service.status.state = "stopped"
        with contextlib.suppress(Exception):
            await service.heartbeat()
        await engine.dispose()

    return app


def main() -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        run_faststream(build_app)
        return
    from flywheel.trainer import distributed
    from flywheel.trainer import ranks as process_group

    settings = Settings()
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(name)s "
                        "%(message)s" if rank else LOG_FORMAT)
    ranks = process_group.init(settings.trainer.device, settings.trainer.dist_timeout_s)
    try:
        if ranks.rank == 0:
            run_faststream(lambda s: build_app(s, ranks))
        else:
            distributed.follow(ranks)
    finally:
        process_group.close()


if __name__ == "__main__":
    main()
