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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from fastapi import FastAPI, HTTPException, Request, status

from flywheel.config import Settings
from flywheel.runtime.endpoints import resolve_bootstrap
from flywheel.runtime.kafka import send_all
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
        is sent again for a few seconds (`send_all`), then KafkaError is raised."""
        producer = await self.producer()
        await send_all(producer, topic, records, deadline_s=RESEND_WITHIN_S)

    async def probe(self) -> None:
        """Raises unless the broker answers a metadata request now (for `/readyz`)."""
        producer = await self.producer()
        await producer.client.fetch_all_metadata()

    async def stop(self) -> None:
        async with self._lock:
            if self._producer is not None:
                await self._producer.stop()
                self._producer = None


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
