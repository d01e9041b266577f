"""Rollout worker: samples and scores groups of attempts at tasks.

Subscribes: `<prefix>.rollout.requests` (`RolloutRequested`), group `rollout.group_id`;
            workers are members of one group, so a dead worker's partitions (and its
            unacknowledged requests) move to the others.
Writes:     `rollout_groups`, `task_stats`, `rollout_requests.status`, `events` + `outbox`.
Publishes (through the outbox): `GroupScored` → `<prefix>.rollouts`, trainable groups only.

Before sampling, a worker waits while the untrained backlog is at max_staleness × B groups
(admission control). The request's offset is committed only after its group is recorded.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from faststream import AckPolicy, FastStream
from faststream.kafka import KafkaBroker
from faststream.message import StreamMessage

from flywheel.adapters.resolver import AdapterResolver
from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.events import RolloutRequested, parse_event
from flywheel.policy.factory import make_policy
from flywheel.rollout.service import fail_request, handle_request, worker_name
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url
from flywheel.runtime.service import run_faststream

log = logging.getLogger("flywheel.rollout")
RETRY_BACKOFF_S = 5.0


async def _raw(msg: StreamMessage[Any]) -> Any:
    return msg.body


def build_app(settings: Settings) -> FastStream:
    broker = KafkaBroker(resolve_bootstrap(settings), logger=log)
    engine = make_engine(resolve_db_url(settings), pool_size=2)
    policy = make_policy(settings)
    worker = worker_name()
    adapters = AdapterResolver(engine, settings)

    @broker.subscriber(
        settings.topics.rollout_requests,
        group_id=settings.rollout.group_id,
        ack_policy=AckPolicy.NACK_ON_ERROR,
        auto_offset_reset="earliest",
        session_timeout_ms=settings.kafka.session_timeout_ms,
        heartbeat_interval_ms=settings.kafka.heartbeat_interval_ms,
        # A group on CPU can take minutes; admission may hold a request longer still.
        max_poll_interval_ms=60 * 60 * 1000,
        decoder=_raw,
    )
    async def rollout(body: Any) -> None:
        event = parse_event(body)
        if not isinstance(event, RolloutRequested):
            return
        try:
            outcome = await handle_request(event.payload, engine=engine, policy=policy,
                                           settings=settings, worker=worker,
                                           adapters=adapters)
        except (LookupError, ValueError) as err:
            # Permanent (unknown adapter or environment, bad task): fail it, move on.
            log.error("rollout request %s failed: %s", event.payload.request_id, err)
            await fail_request(engine, event.payload.request_id, str(err))
            return
        except Exception as err:
            # Transient (engine or database down): back off before the redelivery.
            log.warning("rollout request %s will be retried: %s", event.payload.request_id,
                        err)
            await asyncio.sleep(RETRY_BACKOFF_S)
            raise
        if outcome is not None:
            log.info("group %s: %d scored, mean reward %s, trainable %s",
                     event.payload.request_id, len(outcome.scored), outcome.reward_mean,
                     outcome.trainable)

    app = FastStream(broker, logger=log)

    @app.after_shutdown
    async def _close() -> None:
        await policy.close()
        await engine.dispose()

    return app


def main() -> None:
    run_faststream(build_app)


if __name__ == "__main__":
    main()
