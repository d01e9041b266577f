"""The shared failure policy (pure, fast): the retry classifier, settle (retry transient,
narrow down and park the rest), and offsets that never pass an unsettled record."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import pytest
from aiokafka import TopicPartition
from aiokafka import errors as kafka_errors
from sqlalchemy import exc as sa_exc

from flywheel.adapters.lifecycle import LifecycleError
from flywheel.adapters.resolver import UnknownAdapter
from flywheel.environments import UnknownEnvironment
from flywheel.errors import (
    Failure,
    InvalidRecord,
    PermanentError,
    TransientError,
    failure_of,
    is_transient,
)
from flywheel.gate.evaluate import NoEvalSet
from flywheel.policy.base import PolicyError
from flywheel.runtime.commits import commit
from flywheel.runtime.consume import RetryPolicy, handle, settle

FAST = RetryPolicy(initial_s=0.001, max_s=0.004, bug_attempts=3)


def _raised_from(outer: BaseException, cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise outer from inner
    except BaseException as err:
        return err


def _sqlalchemy_wrapping(orig: BaseException) -> BaseException:
    return sa_exc.DBAPIError.instance("SELECT 1", {}, orig, Exception)


TRANSIENT: list[BaseException] = [
    TimeoutError(), ConnectionRefusedError(), ConnectionResetError(), BrokenPipeError(),
    socket.gaierror(-2, "Name or service not known"),
    OSError("Multiple exceptions: [Errno 111] Connect call failed"),
    OSError(errno.ENOSPC, "No space left on device"),
    sa_exc.OperationalError("SELECT 1", {}, Exception("server closed the connection")),
    sa_exc.TimeoutError("QueuePool limit reached"),
    asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed"),
    asyncpg.exceptions.DeadlockDetectedError("deadlock detected"),
    asyncpg.exceptions.SerializationError("could not serialize access"),
    asyncpg.exceptions.AdminShutdownError("terminating connection"),
    asyncpg.exceptions.QueryCanceledError("canceling statement due to statement timeout"),
    asyncpg.exceptions.TooManyConnectionsError("too many clients"),
    asyncpg.exceptions.CannotConnectNowError("the database system is starting up"),
    asyncpg.exceptions.UndefinedTableError('relation "tasks" does not exist'),
    _sqlalchemy_wrapping(asyncpg.exceptions.DeadlockDetectedError("deadlock")),
    kafka_errors.KafkaConnectionError(), kafka_errors.NodeNotReadyError(),
    kafka_errors.KafkaTimeoutError(), kafka_errors.RequestTimedOutError(),
    kafka_errors.NotLeaderForPartitionError(), kafka_errors.NoBrokersAvailable(),
    httpx.ConnectError("refused"), httpx.ReadTimeout("slow"),
    httpx.HTTPStatusError("503", request=httpx.Request("GET", "http://x"),
                          response=httpx.Response(503)),
    httpx.HTTPStatusError("429", request=httpx.Request("GET", "http://x"),
                          response=httpx.Response(429)),
    _raised_from(PolicyError("sampling failed on every replica"), httpx.ConnectError("down")),
    NoEvalSet("no eval set is frozen yet"), TransientError("not ready"),
]
NOT_TRANSIENT: list[BaseException] = [
    ValueError("bad"), TypeError("'int' object is not iterable"), KeyError("x"),
    UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"),
    OverflowError("date value out of range"), AssertionError(), RecursionError(),
    FileNotFoundError(2, "No such file"), PermissionError(13, "denied"),
    asyncpg.exceptions.DataError("invalid input"),
    asyncpg.exceptions.UniqueViolationError("duplicate key"),
    asyncpg.exceptions.UntranslatableCharacterError("unsupported Unicode escape"),
    _sqlalchemy_wrapping(asyncpg.exceptions.DataError("value out of range")),
    sa_exc.IntegrityError("INSERT", {}, Exception("violates check constraint")),
    kafka_errors.CommitFailedError(), kafka_errors.MessageSizeTooLargeError(),
    httpx.HTTPStatusError("404", request=httpx.Request("GET", "http://x"),
                          response=httpx.Response(404)),
    PolicyError("SamplingParams.n must be >= 1"),
    # Our own families decide before their cause: a refused record stays refused.
    _raised_from(InvalidRecord("not an event"), ConnectionResetError()),
    UnknownAdapter("adapter policy@v9 is not registered"), UnknownEnvironment("nope"),
    LifecycleError("v3 is production already"), PermanentError("broken invariant"),
]


@pytest.mark.parametrize("err", TRANSIENT, ids=[type(e).__name__ for e in TRANSIENT])
def test_transient_errors(err: BaseException) -> None:
    assert is_transient(err)


@pytest.mark.parametrize("err", NOT_TRANSIENT, ids=[type(e).__name__ for e in NOT_TRANSIENT])
def test_errors_that_retrying_cannot_fix(err: BaseException) -> None:
    assert not is_transient(err)


def test_a_bug_is_reported_with_where_it_was_raised() -> None:
    def request_key() -> None:
        "x\ud800".encode()

    try:
        request_key()
    except UnicodeEncodeError as err:
        failure = failure_of(err)
    assert failure.kind == "bug"
    assert failure.error.startswith("UnicodeEncodeError: 'utf-8' codec can't encode")
    assert "(at test_runtime_consume.py:" in failure.error and "in request_key" in failure.error
    assert failure_of(InvalidRecord("t[0]@3 is not a flywheel event")) == Failure(
        "permanent", "InvalidRecord: t[0]@3 is not a flywheel event")


@dataclass
class Run:
    """A fake consumer's work: which items failed how, and every call made."""

    fail: dict[int, list[BaseException]]
    calls: list[list[int]]
    done: list[int]
    parked: list[tuple[int, Failure]]

    async def process(self, items: Sequence[int]) -> None:
        self.calls.append(list(items))
        for i in items:  # all or nothing, like a transaction
            queue = self.fail.get(i)
            if queue:
                raise queue.pop(0) if len(queue) > 1 else queue[0]
        self.done.extend(items)

    async def park(self, item: int, failure: Failure) -> None:
        self.parked.append((item, failure))


def run(fail: dict[int, list[BaseException]]) -> Run:
    return Run(fail, [], [], [])


async def go(r: Run, items: list[int]) -> int:
    return await settle(items, r.process, r.park, FAST, name=str)


async def test_transient_failures_are_retried_until_they_pass_never_parked() -> None:
    r = run({})
    outage = [ConnectionResetError() for _ in range(5)]  # five failed tries, then it is back

    async def process(items: Sequence[int]) -> None:
        if outage:
            outage.pop()
            raise ConnectionResetError("database restarting")
        r.done.extend(items)

    assert await settle(list(range(10)), process, r.park, FAST, name=str) == 0
    assert r.done == list(range(10)) and r.parked == []


async def test_a_permanent_failure_is_parked_at_once_and_the_rest_goes_through() -> None:
    r = run({6: [InvalidRecord("not a trajectory")]})
    assert await go(r, list(range(16))) == 1
    assert sorted(r.done) == [i for i in range(16) if i != 6]
    assert len(r.done) == 15  # nothing processed twice
    assert r.parked == [(6, Failure("permanent", "InvalidRecord: not a trajectory"))]
    assert sum(1 for c in r.calls if c == [6]) == 1  # one try: retrying cannot help
    assert len(r.calls) <= 2 * 4 + 1  # halving: about 2 log2(n) calls, not n


async def test_a_bug_gets_its_tries_then_is_parked_with_its_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    r = run({})
    flaky = [KeyError("flaky"), KeyError("flaky")]  # item 9 fails twice, then works

    async def process(items: Sequence[int]) -> None:
        r.calls.append(list(items))
        if 2 in items:
            raise TypeError("'int' object is not iterable")
        if 9 in items and flaky:
            flaky.pop()
            raise KeyError("flaky")
        r.done.extend(items)

    assert await settle(list(range(12)), process, r.park, FAST, name=str) == 1
    assert sorted(r.done) == [i for i in range(12) if i != 2]
    ((item, failure),) = r.parked
    assert item == 2 and failure.kind == "bug"
    assert failure.error.startswith("TypeError: 'int' object is not iterable (at ")
    assert "in process" in failure.error
    assert r.calls.count([2]) == FAST.bug_attempts
    assert "parked after 3 tries, a bug" in caplog.text and "Traceback" in caplog.text


async def test_every_item_poisoned_parks_every_item_once() -> None:
    r = run({i: [ValueError(f"bad {i}")] for i in range(5)})
    assert await go(r, list(range(5))) == 5
    assert sorted(i for i, _ in r.parked) == list(range(5)) and r.done == []


async def test_a_failing_park_escapes_instead_of_dropping_the_record() -> None:
    r = run({1: [InvalidRecord("bad")]})

    async def park(item: int, failure: Failure) -> None:
        raise RuntimeError("dead_letters is gone")

    with pytest.raises(RuntimeError, match="dead_letters is gone"):
        await settle([0, 1, 2], r.process, park, FAST, name=str)


@dataclass
class FakeRecord:
    topic: str
    partition: int
    offset: int
    key: bytes | None = None
    value: bytes = b"{}"


class FakeConsumer:
    def __init__(self) -> None:
        self.commits: list[dict[TopicPartition, int]] = []
        self.seeks: list[tuple[TopicPartition, int]] = []

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(offsets)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))


BATCH = [FakeRecord("t", 0, 5), FakeRecord("t", 1, 9), FakeRecord("t", 0, 6),
         FakeRecord("t", 1, 10)]


async def test_handle_commits_just_past_what_it_settled_parked_included() -> None:
    consumer, parked = FakeConsumer(), []

    async def process(records: Sequence[Any]) -> None:
        if any(r.offset == 9 for r in records):
            raise InvalidRecord("bad")

    async def park(record: Any, failure: Failure) -> None:
        parked.append(record.offset)

    n = await handle(BATCH, consumer, process, park, FAST)  # type: ignore[arg-type]
    assert n == 1 and parked == [9]
    assert consumer.commits == [{TopicPartition("t", 0): 7, TopicPartition("t", 1): 11}]
    assert consumer.seeks == []


async def test_handle_rewinds_every_partition_when_something_escapes() -> None:
    consumer = FakeConsumer()

    async def process(records: Sequence[Any]) -> None:
        raise asyncio.CancelledError

    async def park(record: Any, failure: Failure) -> None:
        raise AssertionError("not reached")

    with pytest.raises(asyncio.CancelledError):
        await handle(BATCH, consumer, process, park, FAST)  # type: ignore[arg-type]
    assert consumer.commits == []
    assert sorted(consumer.seeks) == [(TopicPartition("t", 0), 5), (TopicPartition("t", 1), 9)]


async def test_a_commit_lost_in_a_rebalance_is_not_an_error() -> None:
    class Moved(FakeConsumer):
        async def commit(self, offsets: dict[TopicPartition, int]) -> None:
            raise kafka_errors.CommitFailedError("rebalanced")

    await commit(Moved(), BATCH)  # type: ignore[arg-type]
