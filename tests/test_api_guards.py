"""The guard every app gets (body limit, last resort, dependency errors) and `/readyz`, on a
tiny app: no services needed."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest
from fastapi import APIRouter, Request
from sqlalchemy.exc import DBAPIError, OperationalError

from flywheel.config import ApiSettings, Settings
from flywheel.errors import unavailable
from flywheel.web.app import create_app
from flywheel.web.guards import INT32_MAX, existing_version
from flywheel.web.health import add_probe

LIMIT = 1000


def _router() -> APIRouter:
    router = APIRouter()

    @router.post("/echo")
    async def echo(body: dict[str, str]) -> dict[str, int]:
        return {"keys": len(body)}

    @router.post("/raw")
    async def raw(request: Request) -> dict[str, int]:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
        return {"size": size}

    @router.get("/boom")
    async def boom() -> None:
        raise ValueError("secret internals: password=hunter2")

    @router.get("/v1/models/boom")
    async def openai_boom() -> None:
        raise ValueError("secret internals")

    @router.get("/db-down")
    async def db_down() -> None:
        raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5433)")

    return router


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(Settings(api=ApiSettings(max_request_bytes=LIMIT)), routers=[_router()])
    ok = {"up": True}

    async def probe() -> None:
        if not ok["up"]:
            raise OSError("connection refused")

    add_probe(app, "postgres", probe)
    app.state.flip = ok
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        c.app = app  # type: ignore[attr-defined]
        yield c


async def test_a_declared_body_over_the_limit_is_413_before_the_route_runs(
        client: httpx.AsyncClient) -> None:
    r = await client.post("/echo", content=b"{" + b" " * LIMIT + b"}",
                          headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert "api.max_request_bytes" in r.json()["detail"] and str(LIMIT) in r.json()["detail"]
    # The same size on a route that never reads its body: refused all the same.
    r = await client.request("GET", "/healthz", content=b"x" * (LIMIT + 1))
    assert r.status_code == 413


async def test_a_chunked_body_is_counted_as_it_arrives(client: httpx.AsyncClient) -> None:
    sent: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(50):
            sent.append(1)
            yield b"y" * 100

    r = await client.post("/raw", content=chunks())
    assert r.status_code == 413, r.text
    assert "over 1000 bytes" in r.json()["detail"]
    assert len(sent) < 50  # refused while the body was still arriving
    # Under the limit it goes through, for a parsed body and a streamed one.
    assert (await client.post("/echo", json={"a": "b"})).json() == {"keys": 1}
    assert (await client.post("/raw", content=b"z" * LIMIT)).json() == {"size": LIMIT}


async def test_an_invalid_content_length_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/raw", content=b"abc", headers={"Content-Length": "3x"})
    assert r.status_code == 400 and "Content-Length" in r.json()["detail"]


async def test_an_unexpected_error_is_a_json_500_that_leaks_nothing(
        client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    r = await client.get("/boom")
    assert r.status_code == 500
    body = r.json()
    assert "hunter2" not in r.text and "ValueError" not in r.text
    assert body["detail"].startswith("internal error (id ") and len(body["error_id"]) == 12
    assert body["error_id"] in caplog.text and "hunter2" in caplog.text  # logged, not served


async def test_a_dependency_that_is_down_is_503_with_retry_after(
        client: httpx.AsyncClient) -> None:
    r = await client.get("/db-down")
    assert r.status_code == 503
    assert r.headers["Retry-After"] == "5" and "postgres is unavailable" in r.json()["detail"]


async def test_readyz_names_what_is_down_and_healthz_stays_200(
        client: httpx.AsyncClient) -> None:
    r = await client.get("/readyz")
    assert r.status_code == 200 and r.json()["down"] == []
    client.app.state.flip["up"] = False  # type: ignore[attr-defined]
    client.app.state.probe_cache = None  # type: ignore[attr-defined]
    r = await client.get("/readyz")
    assert r.status_code == 503
    assert r.json()["down"] == ["postgres"]
    assert "postgres is down (OSError: connection refused)" in r.json()["detail"]
    assert (await client.get("/healthz")).status_code == 200


def test_versions_outside_the_integer_column_cannot_exist() -> None:
    assert existing_version(1) == 1 and existing_version(INT32_MAX) == INT32_MAX
    for bad in (0, -1, INT32_MAX + 1, 2**63):
        with pytest.raises(Exception) as info:
            existing_version(bad)
        assert getattr(info.value, "status_code", None) == 404


def test_what_counts_as_a_dependency_being_down() -> None:
    assert unavailable(ConnectionRefusedError()) == "postgres"
    assert unavailable(asyncpg.CannotConnectNowError("the database system is starting up")) \
        == "postgres"
    assert unavailable(OperationalError("SELECT 1", {}, Exception("gone"))) == "postgres"
    wrapped = DBAPIError("SELECT 1", {}, Exception("x"))
    wrapped.__cause__ = asyncpg.CannotConnectNowError("starting up")
    assert unavailable(wrapped) == "postgres"
    assert unavailable(ValueError("bad input")) is None
    assert unavailable(DBAPIError("SELECT 1", {}, Exception("syntax error"))) is None


def test_a_version_in_a_model_name_is_ascii_digits_in_the_id_range() -> None:
    from flywheel.serving.sync import addressed_version

    assert addressed_version("policy@v7", "policy") == 7
    assert addressed_version(f"policy@v{INT32_MAX}", "policy") == INT32_MAX
    for name in ("policy@v2147483648", "policy@v9223372036854775808", "policy@v²",
                 "policy@v" + "9" * 5000, "policy@v٣", "policy@v０", "policy@v0",
                 "policy@v", "other@v3", "policy@v3 "):
        assert addressed_version(name, "policy") is None, name


async def test_openai_routes_answer_guard_errors_in_the_openai_shape(
        client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", content=b"{" + b" " * LIMIT + b"}",
                          headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and "api.max_request_bytes" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    boom = await client.get("/v1/models/boom")
    assert boom.status_code == 500 and boom.json()["error"]["type"] == "server_error"
    assert "secret" not in boom.text
    missing = await client.get("/v1/models/none/such")
    assert missing.status_code == 404 and set(missing.json()) == {"error"}
    # Elsewhere the FastAPI shape stays.
    assert "detail" in (await client.post("/echo", content=b"{" + b" " * LIMIT + b"}")).json()
