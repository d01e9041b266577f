"""What the intake routes share: reading a capped request body, and the Kafka producer.

The gateway (`POST /v1/trajectories`), feedback (`POST /v1/feedback`) and OTLP traces
(`POST /v1/traces`) all read their body through `read_body` (413 past
`api.max_request_bytes`) and publish through `publish_or_503` on the one producer that
`gateway_lifespan` keeps on `app.state.gateway_publisher` (acks=all; 503 with Retry-After
when the broker does not take the records).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError, KafkaError
from fastapi import FastAPI, HTTPException, Request, status

from flywheel.config import Settings
from flywheel.runtime.endpoints import resolve_bootstrap
from flywheel.runtime.kafka import is_bundled, send_all
from flywheel.web.app import settings_of
from flywheel.web.health import add_probe

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
"""What 503 answers tell clients to wait before retrying."""
PUBLISH_TIMEOUT_MS = 10_000
"""Longest wait for broker metadata or an ack: beyond it the client gets 503, not a hang."""
RESEND_WITHIN_S = 3.0
"""How long a request resends what the broker failed to store before answering 503."""
# Kafka's record framing (key, headers, batch header) on top of the value: the producer's
# request limit must leave room for it so a value at exactly the payload limit still fits.
_FRAMING_BYTES = 64 * 1024


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` bytes.

    Content-Length is checked up front, and the bytes actually received are counted too:
    chunked bodies have no Content-Length and a client's header may lie.
    """
    advice = f"the limit is {limit} bytes (api.max_request_bytes); split the batch"
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise HTTPException(400, f"invalid Content-Length header {declared!r}")
        if int(declared) > limit:
            raise HTTPException(413, f"request body is {declared} bytes; {advice}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"request body is over {limit} bytes; {advice}")
        chunks.append(chunk)
    return b"".join(chunks)


class Publisher:
    """The gateway's Kafka producer, started at app startup and again on demand.

    If the broker is down when the app starts, the app still serves (answering 503) and the
    next request tries again, so gateway and broker may start in any order.
    """

    def __init__(self, settings: Settings) -> None:
        self.bootstrap = resolve_bootstrap(settings)
        self._max_request_size = max(1_048_576, settings.ingest.max_payload_bytes + _FRAMING_BYTES)
        self._producer: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()
        self._admin: AIOKafkaAdminClient | None = None
        self._durable = False
        """Set once the broker said it is not the bundled one: its instance is not checked."""

    async def producer(self) -> AIOKafkaProducer:
        async with self._lock:
            if self._producer is None:
                # A fresh client per attempt: an aiokafka producer that failed to start is not
                # restartable.
                producer = AIOKafkaProducer(
                    bootstrap_servers=self.bootstrap, acks="all",
                    enable_idempotence=False,  # the local broker does not support it
                    request_timeout_ms=PUBLISH_TIMEOUT_MS,
                    max_request_size=self._max_request_size)
                try:
                    await producer.start()
                except BaseException:
                    await producer.stop()
                    raise
                self._producer = producer
            return self._producer

    async def publish(self, topic: str, records: list[tuple[bytes, bytes]]) -> None:
        """Send every (key, value), then wait for all acks; what the broker fails to store
        is sent again for a few seconds (`send_all`), then KafkaError is raised.

        On the bundled broker (memory only, replaced by the supervisor when it dies) every
        record must have been acknowledged by one and the same instance: its cluster id is
        read before the sends and after the last ack, and when they differ ALL the records
        are sent again. The producer retries a batch the dead instance failed on the new
        one by itself, so the sends all succeed while the records the dead one acknowledged
        first are gone with it: a 202 for such a request said "accepted" of records that
        were lost (tests/test_runtime_heal.py saw 18 and 26 of 5,000 that way). What one
        instance acknowledged in full and then lost is the bundled broker's limit: counted
        by the supervisor's loss accounting, README "Durability"."""
        producer = await self.producer()
        deadline = time.monotonic() + RESEND_WITHIN_S
        while True:
            before = None if self._durable else await self.instance()
            await send_all(producer, topic, records,
                           deadline_s=max(0.5, deadline - time.monotonic()))
            if before is None or not is_bundled(before):
                self._durable = before is not None
                return
            after = await self.instance()
            if after == before:
                return
            if time.monotonic() >= deadline:
                raise KafkaConnectionError(f"the broker was replaced ({before} → {after}) "
                                           "while the records were sent")
            log.warning("gateway: the broker was replaced (%s → %s) while %d records were "
                        "sent: sending all of them again", before, after, len(records))

    async def instance(self) -> str | None:
        """The broker's cluster id, read now (a fresh admin client after any failure)."""
        wait_s = PUBLISH_TIMEOUT_MS / 1000
        if self._admin is None:
            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap,
                                        request_timeout_ms=PUBLISH_TIMEOUT_MS)
            try:
                await asyncio.wait_for(admin.start(), wait_s)
            except BaseException:
                await _close_quietly(admin, wait_s)
                raise
            self._admin = admin
        try:
            described = await asyncio.wait_for(self._admin.describe_cluster(), wait_s)
        except BaseException:
            admin, self._admin = self._admin, None
            if admin is not None:
                await _close_quietly(admin, wait_s)
            raise
        cluster = described.get("cluster_id")
        return str(cluster) if cluster is not None else None

    async def probe(self) -> None:
        """Raises unless the broker answers a metadata request now (for `/readyz`)."""
        producer = await self.producer()
        await producer.client.fetch_all_metadata()

    async def stop(self) -> None:
        async with self._lock:
            if self._producer is not None:
                await self._producer.stop()
                self._producer = None
            admin, self._admin = self._admin, None
            if admin is not None:
                await _close_quietly(admin, PUBLISH_TIMEOUT_MS / 1000)


async def _close_quietly(admin: AIOKafkaAdminClient, wait_s: float) -> None:
    try:
        await asyncio.wait_for(admin.close(), wait_s)
    except Exception:  # a client that lost its broker is discarded anyway
        pass


@asynccontextmanager
async def gateway_lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Lifespan hook: the Kafka producer lives on `app.state.gateway_publisher`."""
    publisher = Publisher(settings_of(app))
    try:
        await publisher.producer()
    except (KafkaError, OSError) as err:
        log.warning("gateway: broker at %s not reachable at startup (%s); will retry on the"
                    " first request", publisher.bootstrap, err)
    app.state.gateway_publisher = publisher
    add_probe(app, "kafka", publisher.probe)
    try:
        yield
    finally:
        await publisher.stop()


def publisher_of(request: Request) -> Publisher:
    publisher: Publisher | None = getattr(request.app.state, "gateway_publisher", None)
    if publisher is None:
        raise RuntimeError("the gateway's producer is not running: create the app with"
                           " lifespan_hooks=[gateway_lifespan] and run its lifespan")
    return publisher


async def publish_or_503(request: Request, topic: str, records: list[tuple[bytes, bytes]], *,
                         what: str, dedupe: str) -> None:
    """Publish, or answer 503 with Retry-After when the broker does not take them."""
    try:
        await publisher_of(request).publish(topic, records)
    except (KafkaError, OSError, TimeoutError) as err:
        log.warning("gateway: publishing %d %s to %s failed: %r", len(records), what, topic,
                    err)
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            f"the broker did not accept the {what} ({type(err).__name__}: {err}); retry the"
            f" same request in {RETRY_AFTER_S}s (re-sending is safe: {dedupe})",
            headers={"Retry-After": str(RETRY_AFTER_S)}) from None
