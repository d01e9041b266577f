"""The HTTP gateway against the real broker: auth, limits, validation, and what reaches Kafka."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer

from flywheel.api.gateway import create_gateway_app
from flywheel.config import ApiSettings, IngestSettings, KafkaSettings, Settings
from flywheel.runtime.kafka import ensure_topics
from flywheel.stack.broker import free_port
from flywheel.trajectory import Trajectory, content_id

pytestmark = pytest.mark.kafka

PUBLISH = "publish-token-0123456789"
OPERATE = "operate-token-0123456789"
MAX_REQUEST = 64_000
MAX_PAYLOAD = 8_000


def v1(**overrides: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "trajectory_id": str(uuid.uuid4()),
        "agent": "support-bot",
        "items": [{"type": "message", "role": "user", "content": "refund order 42"},
                  {"type": "function_call", "call_id": "c1", "name": "refund",
                   "arguments": "{\"order\": 42}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
        "outcome": {"status": "failure", "reward": 0.0},
    }
    record.update(overrides)
    return record


def chat(session: str) -> dict[str, Any]:
    """A Chat Completions transcript without a trajectory_id."""
    return {
        "agent": "support-bot",
        "session_id": session,
        "messages": [
            {"role": "user", "content": "what is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C, cloudy"},
            {"role": "assistant", "content": "It is 18C and cloudy."},
        ],
        "outcome": {"status": "success"},
    }


def auth(token: str = PUBLISH) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def limited(settings: Settings) -> Settings:
    return settings.model_copy(update={
        "api": ApiSettings(tokens={PUBLISH: ["publish"], OPERATE: ["operate"]},
                           max_request_bytes=MAX_REQUEST),
        "ingest": IngestSettings(max_payload_bytes=MAX_PAYLOAD),
    })


@asynccontextmanager
async def open_client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_gateway_app(settings)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        yield client


@pytest.fixture
async def gw_settings(settings: Settings) -> Settings:
    s = limited(settings)
    await ensure_topics(s.kafka.bootstrap or "", s.topics.all(), partitions=3)
    return s


@pytest.fixture
async def client(gw_settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    async with open_client(gw_settings) as c:
        yield c


async def consume(settings: Settings, expected: int, *,
                  timeout_s: float = 20) -> dict[bytes | None, bytes]:
    """Every record on the trajectories topic (key → value), read from the start."""
    consumer = AIOKafkaConsumer(settings.topics.trajectories,
                                bootstrap_servers=settings.kafka.bootstrap, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    seen: dict[bytes | None, bytes] = {}
    count = 0
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while count < expected and asyncio.get_running_loop().time() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for rec in records:
                    count += 1
                    seen[rec.key] = rec.value
        # One more poll: anything beyond `expected` would show up here.
        for records in (await consumer.getmany(timeout_ms=500)).values():
            count += len(records)
    finally:
        await consumer.stop()
    assert count == len(seen), "a trajectory was published more than once"
    return seen


async def assert_only_sentinel_arrives(client: httpx.AsyncClient, settings: Settings) -> None:
    """Publish one valid record after a rejected request: it must be alone on the topic.

    Waiting for a record that is known to come proves the consumer saw the whole topic, which
    a timed wait for "nothing" would not.
    """
    sentinel = v1()
    r = await client.post("/v1/trajectories", json=sentinel, headers=auth())
    assert r.status_code == 202, r.text
    assert set(await consume(settings, 1)) == {sentinel["trajectory_id"].encode()}


async def test_healthz_needs_no_token(client: httpx.AsyncClient) -> None:
    r = await client.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


async def test_missing_or_unknown_token_is_401(client: httpx.AsyncClient) -> None:
    for headers in ({}, auth("not-a-token"), {"Authorization": "Basic dXNlcjpwdw=="}):
        r = await client.post("/v1/trajectories", json=v1(), headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"] == "Bearer"
        assert "bearer token" in r.json()["detail"]


async def test_token_without_publish_scope_is_403(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/trajectories", json=v1(), headers=auth(OPERATE))
    assert r.status_code == 403
    assert "'publish' scope" in r.json()["detail"]


async def test_request_over_size_limit_is_413(client: httpx.AsyncClient) -> None:
    big = [v1() for _ in range(200)]
    assert len(json.dumps(big)) > MAX_REQUEST
    r = await client.post("/v1/trajectories", json=big, headers=auth())
    assert r.status_code == 413
    assert "api.max_request_bytes" in r.json()["detail"]

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the real length counts
        yield json.dumps(big).encode()

    r = await client.post("/v1/trajectories", content=chunked(), headers=auth())
    assert "content-length" not in r.request.headers
    assert r.status_code == 413


async def test_one_trajectory_over_payload_limit_is_413_naming_it(
        client: httpx.AsyncClient, gw_settings: Settings) -> None:
    batch = [v1(), v1(metadata={"log": "x" * MAX_PAYLOAD})]
    r = await client.post("/v1/trajectories", json=batch, headers=auth())
    assert r.status_code == 413
    assert "trajectories[1]" in r.json()["detail"]
    await assert_only_sentinel_arrives(client, gw_settings)


async def test_schema_error_is_422_naming_the_field_and_publishes_nothing(
        client: httpx.AsyncClient, gw_settings: Settings) -> None:
    batch = [v1(), v1(), v1(), v1(outcome={"status": "great"})]
    r = await client.post("/v1/trajectories", json={"trajectories": batch}, headers=auth())
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert "trajectories[3]: outcome.status: Input should be 'success', 'failure'" in detail
    assert "nothing was published" in detail
    await assert_only_sentinel_arrives(client, gw_settings)


async def test_non_json_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/trajectories", content=b"{not json", headers=auth())
    assert r.status_code == 400
    assert "not valid UTF-8 JSON" in r.json()["detail"]


async def test_one_object_is_published_keyed_by_its_id(
        client: httpx.AsyncClient, gw_settings: Settings) -> None:
    record = v1()
    r = await client.post("/v1/trajectories", json=record, headers=auth())
    assert r.status_code == 202, r.text
    assert r.json() == {"accepted": 1, "trajectory_ids": [record["trajectory_id"]]}
    seen = await consume(gw_settings, 1)
    key = record["trajectory_id"].encode()
    assert list(seen) == [key]
    assert Trajectory.model_validate_json(seen[key]).agent == "support-bot"


async def test_mixed_batch_of_50_arrives_exactly(
        client: httpx.AsyncClient, gw_settings: Settings) -> None:
    batch = [v1() if i % 2 else chat(f"s{i}") for i in range(50)]
    r = await client.post("/v1/trajectories", json=batch, headers=auth())
    assert r.status_code == 202, r.text
    ids = r.json()["trajectory_ids"]
    assert r.json()["accepted"] == 50 and len(set(ids)) == 50
    assert ids[1] == batch[1]["trajectory_id"]
    assert ids[0] == str(content_id(batch[0]))

    seen = await consume(gw_settings, 50)
    assert set(seen) == {i.encode() for i in ids}
    for key, value in seen.items():
        t = Trajectory.model_validate_json(value)
        assert str(t.trajectory_id).encode() == key
    converted = Trajectory.model_validate_json(seen[ids[0].encode()])
    assert [i.type for i in converted.items] == [
        "message", "function_call", "function_call_output", "message"]


async def test_chat_transcript_without_id_gets_the_same_id_twice(
        client: httpx.AsyncClient) -> None:
    ids = []
    for _ in range(2):
        r = await client.post("/v1/trajectories", json=chat("same-session"), headers=auth())
        assert r.status_code == 202, r.text
        ids.append(r.json()["trajectory_ids"][0])
    assert ids[0] == ids[1] == str(content_id(chat("same-session")))


async def test_broker_unreachable_is_503_with_retry_after(settings: Settings) -> None:
    down = limited(settings).model_copy(
        update={"kafka": KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}")})
    # The app still starts: gateway and broker may come up in any order.
    async with open_client(down) as c:
        r = await c.post("/v1/trajectories", json=v1(), headers=auth())
        assert r.status_code == 503
        assert r.headers["retry-after"].isdigit()


async def _read(settings: Settings, topic: str, expected: int) -> list[tuple[bytes, bytes]]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=settings.kafka.bootstrap,
                                group_id=None, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    out: list[tuple[bytes, bytes]] = []
    try:
        deadline = asyncio.get_running_loop().time() + 20
        while len(out) < expected and asyncio.get_running_loop().time() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                out += [(r.key or b"", r.value or b"") for r in records]
    finally:
        await consumer.stop()
    return out


async def test_a_token_may_name_the_agent_of_what_it_posts(gw_settings: Settings) -> None:
    s = gw_settings.model_copy(update={"api": gw_settings.api.model_copy(update={"tokens": {
        PUBLISH: {"scopes": ["publish"], "agent": "billing-bot"}}})})
    transcript = {k: v for k, v in chat("s-agent").items() if k not in ("agent", "outcome")}
    async with open_client(s) as c:
        r = await c.post("/v1/trajectories", json=[transcript, v1()], headers=auth())
    assert r.status_code == 202, r.text
    seen = await consume(s, 2)
    named = Trajectory.model_validate_json(seen[r.json()["trajectory_ids"][0].encode()])
    own = Trajectory.model_validate_json(seen[r.json()["trajectory_ids"][1].encode()])
    assert (named.agent, named.metadata["agent_source"], named.status) == \
        ("billing-bot", "token", "awaiting_outcome")
    assert own.agent == "support-bot" and "agent_source" not in own.metadata


async def test_feedback_routes_validate_then_publish_keyed_by_target(
        client: httpx.AsyncClient, gw_settings: Settings) -> None:
    tid = str(uuid.uuid4())
    url = f"/v1/trajectories/{tid}/feedback"
    assert (await client.post(url, json={"rating": "down"})).status_code == 401
    r = await client.post(url, json={"rating": "down", "note": "wrong order"}, headers=auth())
    assert r.status_code == 202, r.text
    r = await client.post("/v1/trajectories/chatcmpl-7/feedback", json={"rating": "up"},
                          headers=auth())
    assert r.status_code == 202, r.text
    batch = [{"request_id": "chatcmpl-8", "outcome": {"status": "failure"}},
             {"trajectory_id": tid, "feedback": {"expected_call": {"name": "refund"}}}]
    r = await client.post("/v1/feedback", json={"feedback": batch}, headers=auth())
    assert r.status_code == 202 and r.json()["accepted"] == 2, r.text
    for body, where, why in (([{"rating": "up"}], "/v1/feedback", "names no trajectory"),
                             ({"trajectory_id": str(uuid.uuid4()), "rating": "up"}, url,
                              "the URL names"),
                             ({"request_id": "r"}, "/v1/feedback", "says nothing")):
        bad = await client.post(where, json=body, headers=auth())
        assert bad.status_code == 422 and why in bad.json()["detail"], bad.text
    got = await _read(gw_settings, gw_settings.topics.feedback, 4)
    assert sorted(k for k, _ in got) == sorted([tid.encode(), b"chatcmpl-7", b"chatcmpl-8",
                                                tid.encode()])
    first = json.loads(got[[k for k, _ in got].index(b"chatcmpl-7")][1])
    assert (first["request_id"], first["rating"]) == ("chatcmpl-7", "up")
