"""The error vocabulary every consumer shares: permanent vs transient, and one classifier.

* `PermanentError`: retrying cannot help (bad input, a broken invariant). The record is
  parked at once with the error, and the consumer moves on.
* `TransientError`: the same work can succeed later (a dependency is down or not ready yet).
  Retried with backoff, never parked.
* Anything else is a plain bug in our code (or a library error nobody classified yet): it
  gets a few attempts, then is parked with its traceback summary and logged loudly.

`is_transient` also knows the libraries' own errors (Postgres, Kafka, HTTP, S3, sockets). It
matches them by class name along the MRO instead of importing the libraries, so importing
the vocabulary stays cheap and a library that is not installed is simply never matched.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePath
from typing import Literal


class FlywheelError(Exception):
    """Base of the errors Flywheel raises on purpose."""


class PermanentError(FlywheelError):
    """Retrying cannot help: bad input or a broken invariant (the message says which)."""


class TransientError(FlywheelError):
    """The same call can succeed later: something is down, busy or not there yet."""


class InvalidRecord(PermanentError, ValueError):
    """A consumed message that cannot be read as what its topic carries."""


# `<root package>.<class name>` of every library error that is transient by nature.
_TRANSIENT_TYPES = frozenset({
    "builtins.TimeoutError", "builtins.ConnectionError", "socket.gaierror",
    # SQLAlchemy: connection-level failures, pool exhaustion.
    "sqlalchemy.OperationalError", "sqlalchemy.TimeoutError", "sqlalchemy.DisconnectionError",
    # asyncpg (the COPY path raises them unwrapped): connection lost, serialization
    # failure or deadlock, admin shutdown / statement timeout, too many connections, and
    # its client-side InterfaceError ("connection is closed").
    "asyncpg.PostgresConnectionError", "asyncpg.TransactionRollbackError",
    "asyncpg.OperatorInterventionError", "asyncpg.InsufficientResourcesError",
    "asyncpg.InterfaceError",
    # A database not migrated yet (or mid-migration) heals when `flywheel migrate` runs; it
    # must not park every message that meets it.
    "asyncpg.UndefinedTableError", "asyncpg.UndefinedColumnError",
    # aiokafka marks most of its transient errors `retriable`; a client timeout is not.
    "aiokafka.KafkaTimeoutError",
    "httpx.TransportError",
    "botocore.ConnectionError", "botocore.HTTPClientError",
})
# OSErrors that describe the file system, not the network: retrying cannot fix them.
_PERMANENT_OS_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError,
                        NotADirectoryError, PermissionError)
_CHAIN_LIMIT = 8


def _names(exc: BaseException) -> set[str]:
    return {f"{c.__module__.split('.')[0]}.{c.__name__}" for c in type(exc).__mro__}


def _http_status(exc: BaseException) -> int | None:
    """An HTTP status the error carries (vLLM, httpx, botocore), if any."""
    for value in (getattr(exc, "status", None), getattr(exc, "status_code", None),
                  getattr(getattr(exc, "response", None), "status_code", None)):
        if isinstance(value, int) and 100 <= value <= 599:
            return value
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore.ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status if isinstance(status, int) else None
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The error and what it was explicitly raised from (`raise … from`, a driver's `orig`);
    not the implicit `__context__`: a bug raised while handling an outage is still a bug."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < _CHAIN_LIMIT:
        seen.add(id(current))
        yield current
        orig = getattr(current, "orig", None)
        current = current.__cause__ or (orig if isinstance(orig, BaseException) else None)


def _transient_by_kind(exc: BaseException) -> bool | None:
    """True/False when this one error decides; None to look at its cause."""
    if isinstance(exc, TransientError):
        return True
    if isinstance(exc, (PermanentError, *_PERMANENT_OS_ERRORS)):
        return False
    names = _names(exc)
    if names & _TRANSIENT_TYPES:
        return True
    if "sqlalchemy.DBAPIError" in names and getattr(exc, "connection_invalidated", False):
        return True
    if "aiokafka.KafkaError" in names:
        return bool(getattr(exc, "retriable", False))
    if isinstance(exc, OSError):  # e.g. asyncpg's "Multiple exceptions: Connect call failed"
        return True
    status = _http_status(exc)
    if status is not None:
        return status == 429 or status >= 500
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether the same work may succeed if retried later: the one retry classifier.

    Our own families decide first; then the libraries' connection, timeout, deadlock and
    HTTP 5xx/429 errors; an error raised `from` one of those (e.g. `PolicyError` after a
    replica's `httpx.ConnectError`) is transient too.
    """
    for link in _chain(exc):
        verdict = _transient_by_kind(link)
        if verdict is not None:
            return verdict
    return False


_DOWN_TYPES = frozenset({
    "sqlalchemy.OperationalError", "sqlalchemy.InterfaceError",
    "asyncpg.PostgresConnectionError", "asyncpg.InterfaceError",
    "asyncpg.CannotConnectNowError", "asyncpg.TooManyConnectionsError",
})
_DOWN_SQLSTATES = ("08", "57P01", "57P02", "57P03", "53300")
"""Connection exceptions, admin/crash shutdown, cannot connect now, too many connections."""


def unavailable(exc: BaseException) -> str | None:
    """Which dependency an exception says is down ('postgres'), or None for anything else
    (a bug, bad input: those stay 4xx/500 in the API, and are shown, not hidden, by
    `flywheel status`). Follows the cause chain and the driver's `orig`: SQLAlchemy wraps
    the driver's errors."""
    todo: list[BaseException] = [exc]
    for _ in range(_CHAIN_LIMIT):
        if not todo:
            return None
        seen = todo.pop(0)
        names = _names(seen)
        invalidated = getattr(seen, "connection_invalidated", False)
        if names & _DOWN_TYPES or ("sqlalchemy.DBAPIError" in names and invalidated):
            return "postgres"
        state = getattr(seen, "sqlstate", None)
        if isinstance(state, str) and state.startswith(_DOWN_SQLSTATES):
            return "postgres"
        if isinstance(seen, ConnectionError | TimeoutError):
            return "postgres"  # raw socket errors come from the pool (asyncpg connecting)
        todo += [e for e in (getattr(seen, "orig", None), seen.__cause__)
                 if isinstance(e, BaseException)]
    return None


Kind = Literal["permanent", "bug"]


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a record is parked: the kind and one readable line (for a bug, with where)."""

    kind: Kind
    error: str


def failure_of(exc: BaseException) -> Failure:
    """A non-transient error as a parking reason: `PermanentError`s say what was wrong;
    anything else is a bug, reported with its type and the last frames of its traceback."""
    message = describe(exc)
    if isinstance(exc, PermanentError):
        return Failure("permanent", message)
    return Failure("bug", f"{message} (at {where(exc)})" if exc.__traceback__ else message)


def where(exc: BaseException, frames: int = 3) -> str:
    """`flywheel/mining/build.py:63 in request_key ← …`: the innermost frames, innermost first."""
    summary = traceback.extract_tb(exc.__traceback__)[-frames:]
    return " ← ".join(f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in reversed(summary))


def _short(filename: str) -> str:
    parts = PurePath(filename).parts
    for anchor in ("flywheel", "consumers", "producers", "site-packages"):
        if anchor in parts:
            i = len(parts) - 1 - parts[::-1].index(anchor)
            return "/".join(parts[i + (anchor == "site-packages"):])
    return PurePath(filename).name


def describe(exc: BaseException) -> str:
    """`TypeName: message`, for logs that must not dump a whole traceback per retry."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


__all__ = ["Failure", "FlywheelError", "InvalidRecord", "PermanentError", "TransientError",
           "describe", "failure_of", "is_transient", "unavailable", "where"]
