"""Gate: every new adapter version is evaluated against production before it can serve.

Subscribes: `<prefix>.adapters` (`AdapterTrained` proposed to the gate; snapshots, with
            `gate` false, are skipped), group `gate.group_id`.
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
committed; a redelivered `AdapterTrained` finds the version decided and does nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from faststream import AckPolicy, FastStream
from faststream.kafka import KafkaBroker
from faststream.message import StreamMessage

from flywheel.adapters.lifecycle import LifecycleError
from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.events import AdapterTrained, parse_event
from flywheel.gate.evaluate import NoEvalSet
from flywheel.gate.service import GateService, describe
from flywheel.policy.factory import make_policy
from flywheel.runtime.endpoints import resolve_bootstrap, resolve_db_url
from flywheel.runtime.service import cancel_all, run_faststream

log = logging.getLogger("flywheel.gate")
RETRY_BACKOFF_S = 5.0
NO_EVAL_SET_POLL_S = 10.0


async def _raw(msg: StreamMessage[Any]) -> Any:
    return msg.body


def build_app(settings: Settings) -> FastStream:
    broker = KafkaBroker(resolve_bootstrap(settings), logger=log)
    engine = make_engine(resolve_db_url(settings), pool_size=2)
    policy = make_policy(settings)
    gate = GateService(settings, engine, policy)

    @broker.subscriber(
        settings.topics.adapters,
        group_id=settings.gate.group_id,
        ack_policy=AckPolicy.NACK_ON_ERROR,
        auto_offset_reset="earliest",
        session_timeout_ms=settings.kafka.session_timeout_ms,
        heartbeat_interval_ms=settings.kafka.heartbeat_interval_ms,
        max_poll_interval_ms=60 * 60 * 1000,  # a CPU holdout evaluation takes minutes
        decoder=_raw,
    )
    async def on_adapter(body: Any) -> None:
        event = parse_event(body)
        if not isinstance(event, AdapterTrained):
            return
        while True:
            try:
                events = await gate.on_trained(event.payload)
                break
            except NoEvalSet as err:
                # Nothing to compare on yet: wait (visibly) rather than decide blind.
                log.warning("%s@v%d waits for an eval set: %s", event.payload.policy,
                            event.payload.version, err)
                await asyncio.sleep(NO_EVAL_SET_POLL_S)
            except LifecycleError as err:
                log.error("%s@v%d not gated: %s", event.payload.policy,
                          event.payload.version, err)
                return
            except Exception as err:
                log.warning("gating %s@v%d will be retried: %s", event.payload.policy,
                            event.payload.version, err)
                await asyncio.sleep(RETRY_BACKOFF_S)
                raise
        log.info("%s@v%d: %s", event.payload.policy, event.payload.version, describe(events))

    app = FastStream(broker, logger=log)
    tasks: list[asyncio.Task[None]] = []

    async def baseline_when_ready() -> None:
        """Baseline first: once an eval set is frozen, measure the base model on it."""
        while True:
            try:
                await gate.baseline()
                return
            except NoEvalSet:
                await asyncio.sleep(NO_EVAL_SET_POLL_S / 5)
            except Exception as err:
                log.warning("baseline will be retried: %s", err)
                await asyncio.sleep(RETRY_BACKOFF_S)

    @app.on_startup
    async def _baseline() -> None:
        tasks.append(asyncio.create_task(baseline_when_ready()))

    @app.after_shutdown
    async def _close() -> None:
        await cancel_all(tasks)
        await policy.close()
        await engine.dispose()

    return app


def main() -> None:
    run_faststream(build_app)


if __name__ == "__main__":
    main()
