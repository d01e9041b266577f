"""Agent SDK: publishes trajectories to `<prefix>.trajectories`, spooling to disk in outages.

Owns: validating and serialising trajectories (key = trajectory_id; v1, Chat Completions
transcripts and request/response pairs; `agent=` names those that name no agent), batching
them onto the topic, and the spool under `spool_dir` (feedback: `producers.feedback_client`).
While the broker is unreachable records go to an append-only spool file; a background task
reconnects every `retry_interval_s`, replays the spool in order, and only then sends from
memory again. The next client that opens the same
spool (another process, after a crash) replays what is left. A record leaves the spool only
once the broker has acked it: delivery is at least once, ingest dedupes on trajectory_id.

On a local stack's bundled broker (memory-only; it says so by its cluster id) a record
counts as delivered only once `confirm_group` has stored it (`producers.confirm`), however
the client was built: `flush` waits for that, what the broker acknowledged is held until
then, sent again if the instance that acknowledged it is replaced, and put back in the spool
by `close`. `confirm` (`kafka.confirm_stored`) forces it on or off for any broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors
from pydantic import BaseModel
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_fixed

from flywheel.config import IngestSettings, Settings
from flywheel.errors import is_transient
from flywheel.formats import ParseContext
from flywheel.ingest.wire import check_trajectory, validate_record
from flywheel.runtime.endpoints import resolve_bootstrap
from flywheel.trajectory import Trajectory
from producers.confirm import StoreConfirmer
from producers.spool import Record, Spool, encode

log = logging.getLogger(__name__)

State = Literal["connected", "spooling"]

MAX_RECORD_BYTES = 1_000_000
"""Largest key + value `log` accepts: below Kafka's default broker limit (message.max.bytes)."""
_BATCH_BYTES = 512 * 1024  # per-partition request batch; aiokafka's 16 KiB costs a round trip each

# Beyond what is transient for everyone (flywheel.errors.is_transient): a producer closed
# under a send, or a send cancelled with it, is retried from the spool too; so is a broker's
# UNKNOWN_SERVER_ERROR (-1, "an unexpected error processing the request"): a broker-side
# failure, not a verdict on the record (a restarted broker answers it until its topics exist),
# and the spool holds the records meanwhile. Stopping delivery on it would stall the publisher.
_ALSO_RETRIED = (kafka_errors.ProducerClosed, asyncio.CancelledError, kafka_errors.UnknownError)
_REFUSED = (
    kafka_errors.MessageSizeTooLargeError, kafka_errors.RecordTooLargeError,
    kafka_errors.RecordListTooLargeError, kafka_errors.CorruptRecordException,
    kafka_errors.InvalidTimestampError,
)


def is_retryable(exc: BaseException) -> bool:
    """Transient (broker unreachable, slow, electing a leader): the same send can succeed later."""
    return isinstance(exc, _ALSO_RETRIED) or is_transient(exc)


def serialize(trajectory: Trajectory | dict[str, Any], *, agent: str | None = None
              ) -> tuple[Trajectory, bytes]:
    """The trajectory and the exact bytes to publish, judged by ingest's own boundary
    (`flywheel.ingest.wire`): `ValueError` for anything ingest would dead-letter, whatever
    the input (a dict of any shape, or a `Trajectory` holding an unstorable value). `agent`
    names the agent of a dict that names none (the publisher's default)."""
    if isinstance(trajectory, Trajectory):
        problem = check_trajectory(trajectory)
        traj = trajectory
    else:
        context = ParseContext(publisher_agent=agent) if agent is not None else None
        result = validate_record(trajectory, context=context)
        if isinstance(result, tuple):
            raise ValueError(f"invalid trajectory: {result[1]}")
        traj, problem = result, None
    return traj, checked_json(traj, problem, "trajectory")


def checked_json(record: BaseModel, problem: str | None, what: str) -> bytes:
    """The bytes to publish of a validated `record`, or `ValueError("invalid <what>: …")`
    for the `problem` the reader's boundary found, or for a value with no JSON form."""
    if problem is not None:
        raise ValueError(f"invalid {what}: {problem}")
    try:
        return record.model_dump_json(exclude_none=True).encode()
    except Exception as exc:  # e.g. a Python object in metadata with no JSON form
        raise ValueError(f"invalid {what}: it cannot be serialized ({exc})") from exc


class FlywheelClient:
    """Publishes trajectories. `log` never waits on the network, only on a full buffer.

    Records flow in one order: memory buffer → in-flight batch → broker, or, once a send
    fails transiently, → spool → broker. Counting records in that order is what lets
    `flush` know when everything logged before it has been acknowledged.
    """

    def __init__(self, bootstrap: str, topic: str, *, spool_dir: Path, agent: str | None = None,
                 max_buffered: int = 10_000, linger_ms: int = 20, max_batch: int = 500,
                 retry_interval_s: float = 1.0, request_timeout_ms: int = 5000,
                 confirm: bool | None = None, confirm_group: str = IngestSettings().group_id,
                 confirm_interval_s: float = 0.1) -> None:
        """`agent`: names the agent of records that name none (else `unknown`).
        `confirm`: whether a record is delivered only once `confirm_group` (the consumer
        group that stores the topic) committed past it, rather than once the broker
        acknowledged it; None follows the broker: on for a bundled one, off for any other."""
        self._bootstrap, self._topic, self._spool_dir = bootstrap, topic, spool_dir
        self._agent = agent
        self._max_buffered, self._max_batch = max_buffered, max_batch
        self._linger, self._retry_interval = linger_ms / 1000, retry_interval_s
        self._request_timeout_ms = request_timeout_ms
        self._state: State = "spooling"
        self._buf: deque[Record] = deque()
        self._inflight: list[Record] = []
        self._producer: Any = None
        self._spool: Spool | None = None
        self._task: asyncio.Task[None] | None = None
        self._sync_timer: asyncio.TimerHandle | None = None
        self._logged = self._acked = self._rejected = 0
        self._closing = False
        self._closing_event = asyncio.Event()
        self._data = asyncio.Event()
        self._space = asyncio.Event()
        self._progress = asyncio.Event()
        self._confirm = None if confirm is False else StoreConfirmer(
            bootstrap, topic, confirm_group, require=confirm,
            request_timeout_ms=request_timeout_ms)
        self._confirm_interval = confirm_interval_s
        self._confirm_task: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(cls, settings: Settings, **kw: Any) -> FlywheelClient:
        kw.setdefault("confirm", settings.kafka.confirm_stored)
        kw.setdefault("confirm_group", settings.ingest.group_id)
        return cls(resolve_bootstrap(settings), settings.topics.trajectories,
                   spool_dir=settings.home / "spool", **kw)

    @property
    def spool_path(self) -> Path | None:
        return self._spool.path if self._spool else None

    @property
    def stats(self) -> dict[str, Any]:
        spool = self._spool
        return {"sent": self._acked - self._rejected, "rejected": self._rejected,
                "spooled": spool.count if spool else 0, "pending": self._logged - self._acked,
                "unconfirmed": self._confirm.count if self._confirm else 0,
                "confirming": self._confirm.confirming if self._confirm else False,
                "resent": self._confirm.resent if self._confirm else 0,
                "spool_bytes": spool.size if spool else 0, "state": self._state}

    async def __aenter__(self) -> FlywheelClient:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the spool and connect; an unreachable broker means spooling, not an error."""
        if self._spool is not None:
            raise RuntimeError("FlywheelClient.start() was already called")
        self._spool = spool = Spool(self._spool_dir, self._topic)
        self._logged = spool.count  # an earlier run's records count as logged by this one
        if spool.count:
            log.info("%s holds %d undelivered records from an earlier run; they go first",
                     spool.path, spool.count)
        try:
            self._producer = await self._connect()
        except Exception as exc:
            if not is_retryable(exc):
                spool.close()
                self._spool = None
                raise
            log.warning("Kafka at %s is unreachable (%r): spooling to %s until it answers",
                        self._bootstrap, exc, spool.path)
        self._state = "connected" if self._producer is not None and not spool.count else "spooling"
        if self._confirm is not None:
            await self._confirm.start()
            self._confirm_task = asyncio.create_task(self._confirm_loop(),
                                                     name=f"flywheel-sdk-confirm:{self._topic}")
        self._task = asyncio.create_task(self._run(), name=f"flywheel-sdk:{self._topic}")

    async def log(self, trajectory: Trajectory | dict[str, Any]) -> uuid.UUID:
        """Validate and enqueue one trajectory; returns its id. Raises ValueError if invalid
        (for any record ingest would dead-letter: the same decision, see `serialize`)."""
        traj, value = serialize(trajectory, agent=self._agent)
        await self._enqueue(str(traj.trajectory_id).encode(), value)
        return traj.trajectory_id

    async def log_raw(self, value: bytes, key: bytes | None = None) -> None:
        """Enqueue pre-serialized JSON as is (replays); ingest validates it."""
        await self._enqueue(key, value)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until the broker has acked (with `confirm_group`: Flywheel has stored)
        everything logged before this call."""
        target = self._logged
        try:
            async with asyncio.timeout(timeout):
                while self._acked < target:
                    self._raise_if_unusable(closed_ok=self._task is not None
                                            and not self._task.done())
                    await self._progress.wait()
        except TimeoutError:
            if self._spool is not None:
                self._spool.sync()
            raise TimeoutError(
                f"{target - self._acked} trajectories not acknowledged by Kafka at"
                f" {self._bootstrap} after {timeout}s (state: {self._state}); they are kept"
                f" in memory or in {self.spool_path} and are sent once the broker answers"
            ) from None

    async def close(self, timeout: float | None = 30.0) -> None:
        """Deliver what can be within `timeout`; whatever is left stays in the spool."""
        if self._spool is None or self._closing:
            return
        self._closing = True
        for event in (self._closing_event, self._data, self._space):
            event.set()
        self._notify_progress()  # a sender held back by unconfirmed records sees the close
        task = self._task
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            if task is not None:
                done, _ = await asyncio.wait({task}, timeout=timeout)
                if not done:
                    log.warning("close: gave up delivering after %ss; the rest stays in %s",
                                timeout, self._spool.path)
                    task.cancel()
                    await asyncio.wait({task})
                elif not task.cancelled():
                    task.exception()  # a failure was logged by _run and is raised by flush()
            await self._await_confirmed(deadline)
        finally:
            await self._stop_confirming()
            self._spill()
            if self._sync_timer is not None:
                self._sync_timer.cancel()
            await self._drop_producer()
            self._spool.close()
            self._notify_progress()

    def _raise_if_unusable(self, *, closed_ok: bool = False) -> None:
        if self._spool is None:
            raise RuntimeError("FlywheelClient is not started: `await client.start()` first,"
                               " or use `async with client:`")
        task = self._task
        if task is not None and task.done() and not task.cancelled() and task.exception():
            raise RuntimeError(f"delivery to {self._topic} stopped on a permanent error;"
                               f" undelivered records are kept in {self._spool.path}"
                               ) from task.exception()
        if self._closing and not closed_ok:
            raise RuntimeError("FlywheelClient is closed")

    async def _enqueue(self, key: bytes | None, value: bytes) -> None:
        self._raise_if_unusable()
        size = len(value) + len(key or b"")
        if size > MAX_RECORD_BYTES:
            raise ValueError(f"trajectory is {size} bytes serialized; the limit is"
                             f" {MAX_RECORD_BYTES}: trim large tool outputs or content")
        while self._state == "connected" and len(self._buf) >= self._max_buffered:
            self._space.clear()
            await self._space.wait()  # backpressure; a switch to spooling also wakes us
            self._raise_if_unusable()
        self._logged += 1
        if self._state == "connected":
            self._buf.append((key, value))
            self._data.set()
            return
        assert self._spool is not None
        # Written now (a process crash loses nothing); fsync'd once per linger window.
        self._spool.append([(key, value)], sync=False)
        if self._sync_timer is None:
            self._sync_timer = asyncio.get_running_loop().call_later(self._linger, self._sync)

    def _sync(self) -> None:
        self._sync_timer = None
        if self._spool is not None and not self._closing:
            self._spool.sync()

    def _notify_progress(self) -> None:
        event, self._progress = self._progress, asyncio.Event()
        event.set()

    def _acknowledge(self, n: int) -> None:
        if n:
            self._acked += n
            self._notify_progress()

    async def _run(self) -> None:
        try:
            while True:
                if self._state == "spooling":
                    if not await self._recover():
                        return
                    continue
                batch = await self._next_batch()
                if not batch:
                    return
                await self._deliver(batch)
        except Exception:
            log.exception("delivery to %s stopped; records are kept in the spool", self._topic)
            raise
        finally:
            self._spill()  # whatever stopped us (close, cancel, bug), memory goes to disk
            self._notify_progress()

    async def _next_batch(self) -> list[Record]:
        # Unconfirmed records are held in memory too: sending waits while too many are.
        while (self._confirm is not None and not self._closing
               and self._confirm.count >= self._max_buffered):
            await self._progress.wait()
        while not self._buf:
            if self._closing:
                return []
            self._data.clear()
            await self._data.wait()
        if len(self._buf) < self._max_batch and not self._closing:
            await asyncio.sleep(self._linger)  # let a burst fill the batch: fewer requests
        n = min(len(self._buf), self._max_batch)
        self._inflight = [self._buf.popleft() for _ in range(n)]
        self._space.set()
        return self._inflight

    async def _deliver(self, batch: list[Record]) -> None:
        done, error = self._settle(batch, *await self._send(batch))
        self._inflight = batch[done:]
        if error is None:
            return
        if not is_retryable(error):
            raise error
        log.warning("Kafka at %s failed (%r): spooling %d records to %s until it answers",
                    self._bootstrap, error, len(self._inflight) + len(self._buf),
                    self.spool_path)
        self._spill()
        await self._drop_producer()  # it may never recover its connections: start afresh

    def _spill(self) -> None:
        """Move what memory holds to the spool, oldest first; later records follow it there."""
        records = [*self._inflight, *self._buf]
        if not records or self._spool is None:
            return
        self._inflight, self._state = [], "spooling"
        self._buf.clear()
        self._spool.append(records, sync=True)
        self._space.set()

    async def _send(self, records: list[Record]) -> tuple[list[Any], str | None]:
        """Queue every record on the producer, then await all acks: one round trip a batch.
        Also returns the broker instance known before the send (`producers.confirm`)."""
        instance = await self._confirm.before_send() if self._confirm is not None else None
        futures, failure = [], None
        for key, value in records:
            try:
                futures.append(await self._producer.send(self._topic, value, key=key))
            except Exception as exc:
                failure = exc
                break
        results = await asyncio.gather(*futures, return_exceptions=True)
        return ([*results, failure] if failure is not None else results), instance

    def _settle(self, records: list[Record], outcome: list[Any],
                instance: str | None = None) -> tuple[int, BaseException | None]:
        """How many leading records are done (acked or refused for good), and what stopped
        the rest; counts them delivered (or, with a confirmer, holds the acked ones until
        stored, judged against `instance`: the broker known before the send). Later records
        that did get through are re-sent: duplicates, never gaps."""
        acked: list[tuple[int, int, Record]] = []
        done, error = len(outcome), None
        for i, (record, result) in enumerate(zip(records, outcome, strict=False)):
            if not isinstance(result, BaseException):  # RecordMetadata (None from a fake)
                acked.append((getattr(result, "partition", -1), getattr(result, "offset", -1),
                              record))
                continue
            exc = result
            if not isinstance(exc, _REFUSED):
                done, error = i, exc
                break
            # Retrying cannot help, and holding it would block every record behind it.
            rejected = self._spool_dir / f"{self._topic}.rejected"
            with open(rejected, "ab") as f:
                f.write(encode(*record))
                os.fsync(f.fileno())
            self._rejected += 1
            log.error("Kafka refused trajectory %r for good (%r); kept in %s",
                      record[0], exc, rejected)
            self._acknowledge(1)
        if self._confirm is not None and self._confirm.holds(instance):
            self._confirm.add(acked, instance)
        else:
            self._acknowledge(len(acked))
        return done, error

    async def _recover(self) -> bool:
        """Reconnect and replay the spool; True once sending from memory again."""
        if self._closing and self._producer is None:
            return False
        retrying = AsyncRetrying(
            retry=retry_if_exception(is_retryable), wait=wait_fixed(self._retry_interval),
            stop=lambda _: self._closing, sleep=self._nap, before_sleep=self._log_retry,
            reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    await self._replay()
        except Exception as exc:
            if self._closing and is_retryable(exc):
                return False
            raise
        return True

    async def _replay(self) -> None:
        spool = self._spool
        assert spool is not None
        if self._producer is None:
            self._producer = await self._connect()
        try:
            while entries := spool.read(self._max_batch):
                records = [record for record, _ in entries]
                done, error = self._settle(records, *await self._send(records))
                if done:
                    spool.ack(entries[done - 1][1], done)
                if error is not None:
                    raise error
        except Exception:
            await self._drop_producer()
            raise
        # No await since read() came back empty, so no record can sneak in between.
        replayed = spool.size
        spool.clear()
        self._state = "connected"
        log.info("Kafka at %s answers: spool replayed (%d bytes), sending directly again",
                 self._bootstrap, replayed)

    async def _confirm_loop(self) -> None:
        """Poll what the storing group has committed; hand back what a replaced broker lost."""
        confirm = self._confirm
        assert confirm is not None
        while True:
            try:
                stored, resend = await confirm.poll()
            except Exception as exc:
                if not is_retryable(exc):
                    raise
                log.debug("cannot read what %s stored yet (%r)", self._topic, exc)
                await asyncio.sleep(self._retry_interval)
                continue
            self._acknowledge(stored)
            if resend:
                log.warning("the broker at %s was replaced: sending again %d records it had "
                            "acknowledged but Flywheel had not stored", self._bootstrap,
                            len(resend))
                self._requeue(resend)
            await asyncio.sleep(self._confirm_interval)

    def _requeue(self, records: list[Record]) -> None:
        if self._state == "connected" and not self._closing:
            self._buf.extendleft(reversed(records))
            self._data.set()
        elif self._spool is not None:
            self._spool.append(records, sync=True)
        # They left the unconfirmed count: a sender held back by `max_buffered` may go on.
        self._notify_progress()

    async def _await_confirmed(self, deadline: float | None) -> None:
        """Closing: wait (until `deadline`) for what the broker acked to be stored."""
        loop = asyncio.get_running_loop()
        while self._confirm is not None and self._confirm.count and (
                self._confirm_task is not None and not self._confirm_task.done()):
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                log.warning("close: %d records acknowledged but not yet stored; kept in %s",
                            self._confirm.count, self.spool_path)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), left)

    async def _stop_confirming(self) -> None:
        task, self._confirm_task = self._confirm_task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        if self._confirm is not None:
            self._inflight = [*self._confirm.take_all(), *self._inflight]
            await self._confirm.close()

    async def _nap(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing_event.wait(), seconds)

    def _log_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.debug("Kafka at %s still unreachable (%r); %d records spooled, retrying",
                  self._bootstrap, exc, self._spool.count if self._spool else 0)

    async def _connect(self) -> Any:
        producer = AIOKafkaProducer(
            bootstrap_servers=self._bootstrap, acks="all", enable_idempotence=False,
            request_timeout_ms=self._request_timeout_ms, max_batch_size=_BATCH_BYTES,
            max_request_size=MAX_RECORD_BYTES + 64 * 1024, linger_ms=0)
        try:
            # start() can hang on an unreachable address instead of failing
            await asyncio.wait_for(producer.start(), self._request_timeout_ms / 1000)
        except BaseException:
            await _stop_quietly(producer, self._request_timeout_ms / 1000)
            raise
        if self._confirm is not None:
            self._confirm.forget()  # maybe another instance: read it before the first send
        return producer

    async def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await _stop_quietly(producer, self._request_timeout_ms / 1000)


async def _stop_quietly(producer: Any, wait_s: float) -> None:
    """A producer that lost its broker may fail or hang in stop(); it is discarded anyway."""
    try:
        await asyncio.wait_for(producer.stop(), wait_s)
    except Exception as exc:
        log.debug("discarding a Kafka producer whose stop() failed: %r", exc)
