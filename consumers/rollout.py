"""Rollout worker: samples and scores groups of attempts at tasks.

Subscribes: `<prefix>.rollout.requests` (`RolloutRequested`), group `rollout.group_id`;
            workers are members of one group, so a dead worker's partitions (and its
            unacknowledged requests) move to the others.
Writes:     `rollout_groups`, `task_stats`, `rollout_requests.status`, `dead_letters`
            (consumer `rollout`), `events` + `outbox`.
Publishes (through the outbox): `GroupScored` → `<prefix>.rollouts`, trainable groups only;
            `RecordParked` → `<prefix>.parked`.
Validation: also subscribes to `<prefix>.adapters` (`AdapterTrained`), group
            `validation.group_id`, and scores each published version on the validation tasks
            (`flywheel.validation.scoring`: writes `validation_runs`, `validation_status`;
            publishes `ValidationScored`, `CandidateProposed`, `OverfittingDetected`).

A worker keeps `rollout.max_inflight_groups` groups sampling at once (the engine batches
them; `flywheel.runtime.inflight`). Before sampling, each waits while the untrained backlog,
this worker's admitted groups included, is at max_staleness × B groups (admission control).
A request's offset is committed only after its group is recorded, and never past a request
still in flight.
A request that cannot be served (an unknown adapter or environment, a malformed message, a
bug) is parked and its request marked failed; an engine or database outage is retried with
backoff (`flywheel.runtime.consume`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from aiokafka import ConsumerRecord
from faststream import FastStream
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from flywheel.adapters.resolver import AdapterResolver
from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.errors import Failure, InvalidRecord
from flywheel.events import AdapterTrained, RolloutRequested
from flywheel.policy.base import Policy
from flywheel.policy.factory import make_policy
from flywheel.rollout.worker import Admission, handle_request, mark_failed, worker_name
from flywheel.runtime.consume import (
    Park,
    Process,
    RetryPolicy,
    handle,
    parker,
    read_event,
    records_of,
    subscribe,
)
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url
from flywheel.runtime.entrypoint import run_faststream
from flywheel.runtime.inflight import InFlight
from flywheel.tools.registry import registry_catalog
from flywheel.tools.runtime import use_catalog
from flywheel.validation.scoring import ValidationPass

log = logging.getLogger("flywheel.rollout")


def rollout_handlers(settings: Settings, engine: AsyncEngine, policy: Policy,
                     adapters: AdapterResolver, worker: str) -> tuple[Process, Park]:
    """A worker's work on a request, and how it parks one: the request is marked failed in
    the same transaction, so it stops holding admission budget (`build_app` wires them)."""
    async def fail(conn: AsyncConnection, record: ConsumerRecord[bytes, bytes],
                   failure: Failure) -> None:
        try:
            event = read_event(record)
        except InvalidRecord:
            return  # no request id to fail
        if isinstance(event, RolloutRequested):
            await mark_failed(conn, event.payload.request_id)

    admission = Admission()

    async def serve(records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        for record in records:
            event = read_event(record)
            if not isinstance(event, RolloutRequested):
                continue
            outcome = await handle_request(event.payload, engine=engine, policy=policy,
                                           settings=settings, worker=worker,
                                           adapters=adapters, admission=admission)
            if outcome is not None:
                log.info("group %s: %d scored, mean reward %s, trainable %s",
                         event.payload.request_id, len(outcome.scored), outcome.reward_mean,
                         outcome.trainable)

    return serve, parker(engine, "rollout", settings.topics, also=fail)


def build_app(settings: Settings) -> FastStream:
    broker = KafkaBroker(resolve_bootstrap(settings), logger=log)
    engine = make_engine(resolve_db_url(settings), pool_size=2)
    policy = make_policy(settings)
    # Toolset episodes find their registered toolsets (and share one bound per toolset).
    toolsets = registry_catalog(engine, settings.tools.registry_refresh_s)
    use_catalog(toolsets)
    retry = RetryPolicy.of(settings.retry)
    serve, park = rollout_handlers(settings, engine, policy, AdapterResolver(engine, settings),
                                   worker_name())

    inflight = InFlight(settings.rollout.max_inflight_groups, serve, park, retry, logger=log)

    # A group on CPU can take minutes; admission may hold a request longer still.
    @subscribe(broker, settings.topics.rollout_requests, settings, settings.rollout.group_id,
               slow=True)
    async def rollout(body: Any, msg: KafkaMessage) -> None:
        await inflight.submit(records_of(body), msg.consumer)

    validation = ValidationPass(settings, engine, policy)

    async def validate_each(records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        for record in records:
            event = read_event(record)
            if isinstance(event, AdapterTrained):
                done = await validation.on_trained(event.payload)
                log.info("validation of %s: %s", event.aggregate_id,
                         ", ".join(e.type for e in done) or "no validation split yet")

    # One worker of the group scores each published version, on this worker's engine.
    @subscribe(broker, settings.topics.adapters, settings, settings.validation.group_id,
               slow=True)
    async def validate(body: Any, msg: KafkaMessage) -> None:
        await handle(records_of(body), msg.consumer, validate_each,
                     parker(engine, "validation", settings.topics), retry, logger=log)

    app = FastStream(broker, logger=log)

    @app.on_shutdown
    async def _stop_groups() -> None:  # before the consumer closes; they are redelivered
        await inflight.close()

    @app.after_shutdown
    async def _close() -> None:
        await policy.close()
        await toolsets.aclose()
        await engine.dispose()

    return app


def main() -> None:
    run_faststream(build_app)


if __name__ == "__main__":
    main()
