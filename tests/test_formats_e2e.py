"""What agents already log, through every path, on the real stack (broker, Postgres, ingest,
miner, relay and API as spawned processes).

Each path publishes the same three records (with its own content): a Chat Completions
transcript with no field of ours, a request/response pair, and a second pair of the same
conversation that later gets a thumbs-down with a correction. All three are stored and
await their outcome; the corrected one becomes a failure and a task. Paths: the SDK, the HTTP
gateway, `flywheel publish`, and a librdkafka client (confluent-kafka: the C client behind
the Go, Node and .NET producers), which also sends its feedback before the trajectories.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from flywheel.config import (
    ApiSettings,
    DbSettings,
    KafkaSettings,
    MinerSettings,
    Settings,
    TokenGrant,
    settings_env,
)
from flywheel.observe.status import collect
from flywheel.runtime.kafka import ensure_topics
from flywheel.stack.broker import LocalBroker, free_port
from flywheel.stack.postgres import LocalPostgres
from flywheel.trajectory import parse_trajectory
from tests.conftest import TEMPLATE_DB, _pg_dsn
from tests.support.helpers import scalar, spawn, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]
TOKEN = "e2e-publish-token-0123456789"
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name.replace('_', ' ')} of an order",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                   "required": ["order_id"], "additionalProperties": False}}}
    for name in ("get_order", "cancel_order", "refund")]


ORDERS = {"sdk": 7101, "gateway": 7202, "publish": 7303, "librdkafka": 7404,
          "exit-status": 7505}


def tool_call(name: str, order: str, call_id: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "function", "function": {
        "name": name, "arguments": json.dumps({"order_id": order})}}
    if call_id:
        out["id"] = call_id
    return out


@dataclass(frozen=True)
class Records:
    """The three records of one path, and the feedback for the third."""

    transcript: dict[str, Any]
    first: dict[str, Any]
    second: dict[str, Any]
    order: str

    @classmethod
    def for_path(cls, path: str) -> Records:
        order = str(ORDERS[path])  # distinct per path: distinct conversations and tasks
        system = {"role": "system", "content": "You are the shop's order assistant."}
        user = {"role": "user", "content": f"Please refund order {order}, it arrived broken."}
        looked_up = {"role": "assistant", "content": None,
                     "tool_calls": [tool_call("get_order", order, None)]}
        transcript = {"model": "gpt-4o-mini", "tools": TOOLS, "messages": [
            system, user, {**looked_up, "tool_calls": [tool_call("get_order", order, "c1")]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"status": "delivered"}'},
            {"role": "assistant", "content": None,
             "tool_calls": [tool_call("refund", order, "c2")]},
            {"role": "tool", "tool_call_id": "c2", "content": '{"refunded": true}'},
            {"role": "assistant", "content": f"Order {order} is refunded."}]}

        def pair(n: int, messages: list[dict[str, Any]], answer: dict[str, Any]
                 ) -> dict[str, Any]:
            return {"timestamp": 1746138417 + n, "client_id": "shop-prod",
                    "workload_id": "orders",
                    "request": {"model": "m", "messages": messages, "tools": TOOLS},
                    "response": {"id": f"chatcmpl-{path}-{n}", "object": "chat.completion",
                                 "created": 1746138417 + n, "model": "m",
                                 "choices": [{"index": 0, "message": answer,
                                              "finish_reason": "tool_calls"}],
                                 "usage": {"prompt_tokens": 50 + n, "completion_tokens": 9}}}

        first = pair(1, [system, user], looked_up)
        second = pair(2, [system, user, looked_up,
                          {"role": "tool", "tool_call_id": "call_2_0",
                           "content": '{"status": "delivered"}'}],
                      {"role": "assistant", "content": None,
                       "tool_calls": [tool_call("cancel_order", order, None)]})
        return cls(transcript, first, second, order)

    @property
    def all(self) -> list[dict[str, Any]]:
        return [self.transcript, self.first, self.second]

    @property
    def ids(self) -> list[str]:
        return [str(parse_trajectory(r).trajectory_id) for r in self.all]

    def thumbs_down(self, **target: str) -> dict[str, Any]:
        return {**target, "rating": "down", "by": "support-lead",
                "note": "cancelled instead of refunding",
                "correction": [{"role": "assistant", "content": None,
                                "tool_calls": [tool_call("refund", self.order, None)]}]}


@dataclass
class Stack:
    settings: Settings
    dsn: str
    api: str
    env: dict[str, str]


@pytest.fixture(scope="module")
async def stack(broker: LocalBroker, postgres: LocalPostgres, template_db: str,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(_pg_dsn(postgres.url, "postgres"))
    try:
        await admin.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    finally:
        await admin.close()
    home = tmp_path_factory.mktemp("formats")
    port = free_port()
    settings = Settings(
        home=home / "home",
        kafka=KafkaSettings(bootstrap=broker.bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}",
                            session_timeout_ms=2000, heartbeat_interval_ms=500),
        db=DbSettings(url=postgres.url.rsplit("/", 1)[0] + f"/{name}"),
        miner=MinerSettings(feedback_sweep_s=0.5),
        api=ApiSettings(port=port, serve=False, tokens={
            TOKEN: TokenGrant(scopes=["publish"], agent="gateway-bot")}))
    assert settings.kafka.bootstrap
    await ensure_topics(settings.kafka.bootstrap, settings.topics.all(), partitions=3)
    logs = home / "logs"
    procs = [spawn(m, settings, logs / f"{m}.log") for m in
             ("consumers.ingest", "consumers.miner", "producers.relay", "flywheel.api.server")]
    api = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(200):
                try:
                    if (await client.get(api + "/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.2)
        yield Stack(settings, _pg_dsn(settings.db.url or "", name), api,
                    {**os.environ, **settings_env(settings)})
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)
        for log in sorted(logs.glob("*.log")):
            text = log.read_text(errors="replace")
            if "Traceback" in text:
                print(f"--- {log.name}\n{text[-3000:]}")


async def _counts(stack: Stack) -> dict[str, int]:
    s = await collect(stack.settings)
    return {k: s[k] for k in ("trajectories", "awaiting_outcome", "failures", "tasks",
                              "feedback_applied")}


async def _stored(stack: Stack, records: Records) -> dict[str, tuple[str, str | None, str]]:
    """trajectory id → (agent, metadata.agent_source, status), once all three are stored."""
    ids = records.ids
    in_ids = "'" + "','".join(ids) + "'"
    got = await wait_for(stack.dsn, f"SELECT count(*) FROM trajectories "
                                    f"WHERE trajectory_id IN ({in_ids})", 3)
    assert got == 3, "not every record was stored"
    conn = await asyncpg.connect(stack.dsn)
    try:
        rows = await conn.fetch(
            f"SELECT trajectory_id::text, agent, record->'metadata'->>'agent_source', status "
            f"FROM trajectories WHERE trajectory_id IN ({in_ids})")
    finally:
        await conn.close()
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


async def _corrected(stack: Stack, records: Records, before: dict[str, int]) -> None:
    """The third record became a failure and a task from the correction; the other two still
    await their outcome; the global counts moved by exactly that."""
    transcript, first, second = records.ids
    task_sql = (f"SELECT count(*) FROM task_sources s JOIN tasks t USING (task_id) "
                f"WHERE s.trajectory_id = '{second}' AND t.expected_from = 'human_correction'")
    assert await wait_for(stack.dsn, task_sql, 1, 60) == 1, "the correction made no task"
    assert await scalar(stack.dsn, f"SELECT count(*) FROM failures WHERE trajectory_id = "
                                   f"'{second}' AND failure_mode = 'wrong_tool' "
                                   f"AND status = 'task'") == 1
    assert await scalar(stack.dsn, f"SELECT count(*) FROM failures WHERE trajectory_id IN "
                                   f"('{transcript}', '{first}')") == 0
    assert await scalar(stack.dsn, f"SELECT count(*) FROM events WHERE type = "
                                   f"'FeedbackReceived' AND aggregate_id = '{second}'") == 1
    spec = json.loads(str(await _fetchval(stack.dsn, f"""SELECT t.spec::text FROM tasks t
        JOIN task_sources s USING (task_id) WHERE s.trajectory_id = '{second}'""")))
    assert spec["verifier"]["expected"] == [{"name": "refund", "arguments": {
        "order_id": records.order}, "alternatives": {}, "optional": []}]
    assert [m["role"] for m in spec["messages"]] == ["system", "user", "assistant", "tool"]
    await wait_for(stack.dsn, "SELECT count(*) FROM outbox WHERE published_at IS NULL", 0)
    after = await _counts(stack)
    assert {k: after[k] - before[k] for k in after} == {
        "trajectories": 3, "awaiting_outcome": 2, "failures": 1, "tasks": 1,
        "feedback_applied": 1}


async def _fetchval(dsn: str, sql: str) -> object:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


def _assert_agents(stored: dict[str, tuple[str, str | None, str]], records: Records,
                   expected: list[tuple[str, str | None]]) -> None:
    got = [stored[i] for i in records.ids]
    assert [(a, s) for a, s, _ in got] == expected
    assert [status for *_, status in got] == ["awaiting_outcome"] * 3


async def test_through_the_sdk(stack: Stack) -> None:
    from producers.feedback_client import FeedbackClient
    from producers.sdk import FlywheelClient

    records = Records.for_path("sdk")
    before = await _counts(stack)
    async with FlywheelClient.from_settings(stack.settings, agent="sdk-bot") as client:
        ids = [str(await client.log(r)) for r in records.all]
        await client.flush(timeout=30)
    assert ids == records.ids
    stored = await _stored(stack, records)
    _assert_agents(stored, records, [("sdk-bot", "publisher")] * 3)
    async with FeedbackClient.from_settings(stack.settings) as feedback:
        await feedback.log(records.thumbs_down(trajectory_id=records.ids[2]))
        await feedback.flush(timeout=30)
    await _corrected(stack, records, before)


async def test_through_the_gateway(stack: Stack) -> None:
    records = Records.for_path("gateway")
    before = await _counts(stack)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=stack.api, headers=headers, timeout=30) as client:
        r = await client.post("/v1/trajectories", json=records.all)
        assert r.status_code == 202, r.text
        assert r.json()["trajectory_ids"] == records.ids
        stored = await _stored(stack, records)
        _assert_agents(stored, records, [("gateway-bot", "token")] * 3)
        # Named by the request's id: the logged response's `id`.
        r = await client.post("/v1/trajectories/chatcmpl-gateway-2/feedback",
                              json=records.thumbs_down())
        assert r.status_code == 202, r.text
        bad = await client.post(f"/v1/trajectories/{records.ids[2]}/feedback",
                                json={"rating": "sideways"})
        assert bad.status_code == 422 and "feedback[0]: rating: " in bad.json()["detail"]
    await _corrected(stack, records, before)


def _publish(stack: Stack, path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flywheel.cli.main", "publish", str(path),
                           *args], env=stack.env, capture_output=True, text=True, timeout=180)


async def test_through_flywheel_publish(stack: Stack, tmp_path: Path) -> None:
    records = Records.for_path("publish")
    before = await _counts(stack)
    logs = tmp_path / "logs.jsonl"
    logs.write_text("".join(json.dumps(r) + "\n" for r in records.all))
    done = _publish(stack, logs, "--agent", "cli-bot", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"published": 3, "invalid": 0, "errors": [],
                                       "spooled": 0}
    stored = await _stored(stack, records)
    _assert_agents(stored, records, [("cli-bot", "publisher")] * 3)
    feedback = tmp_path / "feedback.jsonl"
    feedback.write_text(json.dumps(records.thumbs_down(trajectory_id=records.ids[2])) + "\n")
    done = _publish(stack, feedback, "--feedback")
    assert done.returncode == 0, done.stderr
    assert "published 1 feedback records, invalid 0" in done.stderr
    await _corrected(stack, records, before)


async def test_through_a_librdkafka_client(stack: Stack) -> None:
    from confluent_kafka import Producer

    records = Records.for_path("librdkafka")
    before = await _counts(stack)
    producer = Producer({"bootstrap.servers": stack.settings.kafka.bootstrap, "acks": "all"})
    topics = stack.settings.topics
    # The outcome first: it waits for its trajectory and is applied when that is stored.
    producer.produce(topics.feedback, key=b"chatcmpl-librdkafka-2",
                     value=json.dumps(records.thumbs_down(
                         request_id="chatcmpl-librdkafka-2")).encode())
    assert producer.flush(30) == 0
    assert await wait_for(stack.dsn, "SELECT count(*) FROM feedback WHERE request_id = "
                                     "'chatcmpl-librdkafka-2' AND applied_at IS NULL", 1) == 1
    for record, headers in zip(records.all, ([("flywheel-agent", b"go-bot")],
                                             [("flywheel-agent", b"go-bot")], []), strict=True):
        producer.produce(topics.trajectories, value=json.dumps(record).encode(),
                         headers=headers)
    assert producer.flush(30) == 0
    stored = await _stored(stack, records)
    _assert_agents(stored, records, [("go-bot", "header"), ("go-bot", "header"),
                                     ("unknown", "default")])
    await _corrected(stack, records, before)
    assert await scalar(stack.dsn, "SELECT count(*) FROM dead_letters") == 0


async def test_publish_exit_status_tells_the_truth(stack: Stack, tmp_path: Path) -> None:
    records = Records.for_path("exit-status")
    clean = tmp_path / "clean.jsonl"
    clean.write_text(json.dumps(records.transcript) + "\n")
    dirty = tmp_path / "dirty.jsonl"
    dirty.write_text(json.dumps(records.first) + "\n{not json\n"
                     + json.dumps({"messages": "hello"}) + "\n\n")
    ok = _publish(stack, clean)
    assert ok.returncode == 0 and "published 1 trajectories, invalid 0" in ok.stderr
    bad = _publish(stack, dirty)
    assert bad.returncode == 1, bad.stderr
    assert "published 1 trajectories, invalid 2" in bad.stderr
    assert "line 2: not valid JSON" in bad.stderr and "line 3:" in bad.stderr
    allowed = _publish(stack, dirty, "--allow-invalid", "--json")
    assert allowed.returncode == 0
    report = json.loads(allowed.stdout)
    assert (report["published"], report["invalid"]) == (1, 2)
    assert [e["line"] for e in report["errors"]] == [2, 3]
    strict = _publish(stack, dirty, "--strict", "--json")
    assert strict.returncode == 1 and json.loads(strict.stdout)["invalid"] == 1
    usage = _publish(stack, clean, "--raw", "--agent", "x")
    assert usage.returncode == 2 and "--raw sends lines" in usage.stderr
