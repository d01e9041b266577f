"""What stands between any request and a 500: the body-size limit, id ranges, and the last
resort handlers. `create_app` installs them on every app, so every route gets them.

* `BodyLimit` (ASGI middleware): a declared `Content-Length` over `api.max_request_bytes` is
  answered 413 before the route runs; a body without one (chunked) is counted as it arrives
  and refused with 413 the moment it passes the limit, so no route ever holds more.
* `existing_version` / `StorableText`: ids outside their column's range cannot exist (404);
  text Postgres cannot store (NUL, lone surrogates) is refused with 422, not a driver error.
* A dependency that is down (Postgres refusing connections, …) answers 503 with
  `Retry-After`; anything else unexpected is logged with an id and answered with a JSON 500
  that names the id and nothing of the internals.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flywheel.errors import unavailable

log = logging.getLogger("flywheel.api")

INT32_MAX = 2**31 - 1
"""Adapter versions and eval-set versions are Postgres `integer` columns."""
RETRY_AFTER_S = 5


class BodyTooLarge(HTTPException):
    """Raised from `receive` when the body passes the limit. An HTTPException, so FastAPI's
    body parsing and the routes that read the stream themselves pass it on as a 413."""

    def __init__(self, limit: int, declared: int | None = None) -> None:
        size = f"is {declared} bytes" if declared is not None else f"is over {limit} bytes"
        super().__init__(413,
                         f"the request body {size}; the limit is {limit} bytes"
                         " (api.max_request_bytes): split the request, or raise"
                         " FLYWHEEL_API__MAX_REQUEST_BYTES")


class Guard:
    """The body limit and the last resort around the whole app (see the module docstring).

    Exceptions that no route or handler turned into a response end here: a dependency that
    is down becomes a 503, anything else a JSON 500 logged once with its id (nothing is
    re-raised to the server, which would log the same traceback a second time)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared == -1:
            await _json(send, 400, shaped(scope, 400, "invalid Content-Length header: send the "
                                          "body's size in bytes, or no Content-Length (chunked)"))
            return
        if declared is not None and declared > self.limit:
            await _json(send, 413, shaped(scope, 413,
                                          str(BodyTooLarge(self.limit, declared).detail)))
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except Exception as exc:
            if started:
                raise
            code, body, headers = last_resort(scope, exc)
            if is_openai(scope):
                body = openai_body(code, body["detail"],
                                   code="service_unavailable" if code == 503 else None)
            await _json(send, code, body, headers)


def last_resort(scope: Scope, exc: Exception
                ) -> tuple[int, dict[str, str], dict[str, str]]:
    """(status, JSON body, headers) for an exception nothing else handled; logs it."""
    where = f"{scope.get('method', '?')} {scope.get('path', '?')}"
    if isinstance(exc, BodyTooLarge):
        return exc.status_code, {"detail": str(exc.detail)}, {}
    dependency = unavailable(exc)
    if dependency is not None:
        log.warning("%s: %s is unavailable: %r", where, dependency, exc)
        return (503, {"detail": f"{dependency} is unavailable ({type(exc).__name__}); retry "
                                f"in {RETRY_AFTER_S}s (GET /readyz says what is down)",
                      "unavailable": dependency},
                {"Retry-After": str(RETRY_AFTER_S)})
    error_id = uuid.uuid4().hex[:12]
    log.error("%s failed (error id %s)", where, error_id, exc_info=exc)
    return 500, {"detail": f"internal error (id {error_id}); the server log has the details",
                 "error_id": error_id}, {}


OPENAI_PATHS = ("/v1/chat/completions", "/v1/models", "/v1/responses")
"""Routes OpenAI clients call: every error there has OpenAI's error shape."""
_OPENAI_CODES = {400: "invalid_request", 401: "invalid_api_key",
                 403: "insufficient_permissions", 404: "not_found", 405: "method_not_allowed",
                 413: "request_too_large", 429: "rate_limit_exceeded",
                 500: "internal_error", 503: "service_unavailable"}


def is_openai(scope: Scope) -> bool:
    path = str(scope.get("path", ""))
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PATHS)


def openai_body(status: int, message: str, *, param: str | None = None,
                code: str | None = None) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`, as OpenAI's API answers."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": code or _OPENAI_CODES.get(status)}}


def shaped(scope: Scope, status: int, message: str) -> dict[str, Any]:
    """An error body in the shape the route's clients read: OpenAI's, or `{"detail"}`."""
    return openai_body(status, message) if is_openai(scope) else {"detail": message}


def _content_length(scope: Scope) -> int | None:
    """The declared body size, None when absent, -1 when it is not a number."""
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() else -1
    return None


async def _json(send: Send, code: int, content: dict[str, Any],
                headers: dict[str, str] | None = None) -> None:
    body = JSONResponse(content).body
    # Connection: close: a refused body may still be arriving; the server drops it.
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"connection", b"close"),
           *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())]
    await send({"type": "http.response.start", "status": code, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def existing_version(version: int, *, what: str = "adapter version") -> int:
    """`version` if a row could hold it, else 404: the column is a positive `integer`."""
    if not 1 <= version <= INT32_MAX:
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            f"no {what} {version} (versions are 1 … {INT32_MAX})")
    return version


def _storable(value: str) -> str:
    if "\x00" in value:
        raise ValueError("contains a NUL character (\\u0000), which Postgres cannot store")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains a lone surrogate (e.g. \\ud800), which is not text; send "
                         "valid UTF-16 pairs or the character itself") from None
    return value


StorableText = Annotated[str, AfterValidator(_storable)]
"""A string Postgres `text`/`jsonb` can hold (for reasons, names and filters)."""


def storable_or_422(value: str, where: str) -> str:
    """`_storable` for a header or query value: 422 naming `where` when it cannot be kept."""
    try:
        return _storable(value)
    except ValueError as err:
        raise HTTPException(422, f"{where} {err}") from None


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a lone surrogate in the echoed input of a 422 cannot be
    encoded as UTF-8, and would turn the 422 into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    if is_openai(request.scope):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return AsciiJSONResponse(openai_body(422, f"{where}: {first.get('msg', 'invalid')}",
                                             param=where or None), status_code=422)
    return AsciiJSONResponse({"detail": jsonable_encoder(exc.errors())}, status_code=422)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (404 for no route, 405 for a wrong method) in the shape the
    path's clients read."""
    assert isinstance(exc, StarletteHTTPException)
    if not is_openai(request.scope):
        return await http_exception_handler(request, exc)
    return JSONResponse(openai_body(exc.status_code, str(exc.detail)),
                        status_code=exc.status_code, headers=dict(exc.headers or {}))


def install(app: FastAPI, max_request_bytes: int) -> None:
    """The guard around `app` (add it last: it must be the outermost user middleware)."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(Guard, limit=max_request_bytes)
