"""Gate: every new adapter version is evaluated against production before it can serve.

Subscribes: `<prefix>.adapters` (`AdapterTrained` proposed to the gate; snapshots, with
            `gate` false, are skipped unless the validation pass proposes one:
            `CandidateProposed`), group `gate.group_id`.
Writes:     `baselines` (the base model on each new eval set, once: the trainer reads the
            recommended first stage), `eval_runs` (every round of every side, cached),
            `gate_status` (what it is doing, samples done / planned, the eval set's MDE),
            the lifecycle projections (`evaluations`, `adapter_versions.status`,
            `production`), `events` + `outbox`.
Publishes (through the outbox): `AdapterEvaluated`, then in `auto` mode `AdapterPromoted` or
            `AdapterRejected` → `<prefix>.adapters`.

Candidate and production sample the frozen holdout tasks of the newest eval set in rounds,
with the same task, sample index and seed on both sides; after every round the sequential
test (flywheel.gate.sequential) decides whether to stop, and the decision rule
(flywheel.gate.decision) promotes only on a clear gain of at least min_gain with no guard
metric or task group regressing. The offset is acknowledged after the decision is
committed; a redelivered `AdapterTrained` finds the version decided and does nothing (an
interrupted evaluation resumes from its cached rounds). With `gate.prefetch_rounds`, the
gate samples production's first rounds on the newest eval set while it has nothing else to
do (`GateService.sample_ahead`), so a candidate's evaluation samples only its own side there.
Waiting for an eval set and outages are retried with backoff; a message that cannot be gated
(malformed, a broken lifecycle invariant, a bug) is parked (`dead_letters`, consumer `gate`,
`RecordParked` → `<prefix>.parked`) and the version stays a candidate.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from aiokafka import ConsumerRecord
from faststream import FastStream
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage

from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.events import AdapterTrained, CandidateProposed
from flywheel.gate.baseline import measure_when_ready
from flywheel.gate.candidate import GateService
from flywheel.gate.candidate import describe as describe_events
from flywheel.policy.factory import make_policy
from flywheel.runtime.consume import (
    RetryPolicy,
    handle,
    parker,
    read_event,
    records_of,
    subscribe,
)
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url
from flywheel.runtime.entrypoint import cancel_all, run_faststream
from flywheel.tools.registry import registry_catalog
from flywheel.tools.runtime import use_catalog

log = logging.getLogger("flywheel.gate")


def build_app(settings: Settings) -> FastStream:
    broker = KafkaBroker(resolve_bootstrap(settings), logger=log)
    engine = make_engine(resolve_db_url(settings), pool_size=2)
    policy = make_policy(settings)
    # Toolset episodes find their registered toolsets (and share one bound per toolset).
    toolsets = registry_catalog(engine, settings.tools.registry_refresh_s)
    use_catalog(toolsets)
    gate = GateService(settings, engine, policy)
    retry = RetryPolicy.of(settings.retry)
    park = parker(engine, "gate", settings.topics)

    async def gate_each(records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        # No eval set yet (NoEvalSet) is transient: the candidate waits, visibly, rather
        # than being decided blind. A broken lifecycle invariant is permanent: parked.
        for record in records:
            event = read_event(record)
            if isinstance(event, CandidateProposed):  # a snapshot validation chose
                events = await gate.on_proposed(event.payload)
            elif isinstance(event, AdapterTrained):
                events = await gate.on_trained(event.payload)
            else:
                continue
            log.info("%s@v%d: %s", event.payload.policy, event.payload.version,
                     describe_events(events))

    # A CPU holdout evaluation takes minutes.
    @subscribe(broker, settings.topics.adapters, settings, settings.gate.group_id, slow=True)
    async def on_adapter(body: Any, msg: KafkaMessage) -> None:
        await handle(records_of(body), msg.consumer, gate_each, park, retry, logger=log)

    app = FastStream(broker, logger=log)
    tasks: list[asyncio.Task[None]] = []

    @app.on_startup
    async def _baseline() -> None:
        # Baseline first: once an eval set is frozen, measure the base model on it.
        tasks.append(asyncio.create_task(measure_when_ready(gate.baseline, retry, logger=log)))
        if settings.gate.prefetch_rounds:  # production's rounds sampled in idle time
            tasks.append(asyncio.create_task(gate.ahead_forever()))

    @app.after_shutdown
    async def _close() -> None:
        await cancel_all(tasks)
        await policy.close()
        await toolsets.aclose()
        await engine.dispose()

    return app


def main() -> None:
    run_faststream(build_app)


if __name__ == "__main__":
    main()
