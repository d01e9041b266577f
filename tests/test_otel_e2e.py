"""OpenTelemetry in, on the real stack (broker, Postgres, ingest, miner, relay and the API
with the real SmolLM2 behind `/v1/chat/completions`, as spawned processes).

A tiny agent instrumented with the real OpenTelemetry SDK and the real OTLP/HTTP exporter
(protobuf, gzip, the publish token as bearer) runs tool-calling conversations against
Flywheel's own `/v1/chat/completions`, with tools named as BFCL and MCP servers name them
(`math.factorial`, `units:convert`), and exports its spans to `/v1/traces`. It does so in
each style of recording content (GenAI attributes, GenAI span events, OpenInference). Then a
thumbs-down with a correction names one conversation by its id: that trajectory becomes a
failure and a task. A late span of a finished trace is merged into its trajectory; a re-sent
export changes nothing; planted bad spans, and only those, are dead letters.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
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
    RolloutSettings,
    Settings,
    TokenGrant,
    settings_env,
)
from flywheel.ingest.otel import trajectory_id, trajectory_key
from flywheel.observe.status import collect
from flywheel.runtime.kafka import ensure_topics
from flywheel.stack.broker import LocalBroker, free_port
from flywheel.stack.postgres import LocalPostgres
from tests.conftest import TEMPLATE_DB, _pg_dsn
from tests.support.helpers import scalar, spawn, wait_for

otel_sdk = pytest.importorskip("opentelemetry.sdk.trace")
pytest.importorskip("torch")
from opentelemetry.exporter.otlp.proto.http import Compression  # noqa: E402
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan  # noqa: E402
from opentelemetry.sdk.trace.export import (  # noqa: E402
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from tests.support.otel_agent import TOOLS, converse, provider  # noqa: E402

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]
TOKEN = "otel-publish-token-0123456789"
STYLES = ("genai", "events", "openinference")


class Recording(SpanExporter):
    """The real OTLP/HTTP exporter, remembering what each export returned and every span."""

    def __init__(self, inner: OTLPSpanExporter) -> None:
        self.inner, self.results, self.spans = inner, [], []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.inner.export(spans)
        self.results.append(result)
        self.spans.extend(spans)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


@dataclass
class Stack:
    settings: Settings
    dsn: str
    api: str


@pytest.fixture(scope="module")
async def stack(broker: LocalBroker, postgres: LocalPostgres, template_db: str,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    from flywheel.policy.model_cache import resolve_model_dir

    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(_pg_dsn(postgres.url, "postgres"))
    try:
        await admin.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    finally:
        await admin.close()
    home = tmp_path_factory.mktemp("otel")
    port = free_port()
    settings = Settings(
        home=home / "home",
        kafka=KafkaSettings(bootstrap=broker.bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}",
                            session_timeout_ms=2000, heartbeat_interval_ms=500),
        db=DbSettings(url=postgres.url.rsplit("/", 1)[0] + f"/{name}"),
        miner=MinerSettings(feedback_sweep_s=0.5),
        rollout=RolloutSettings(model_dir=resolve_model_dir(None)),
        api=ApiSettings(port=port, serve=True, tokens={TOKEN: TokenGrant(scopes=["publish"])}))
    assert settings.kafka.bootstrap
    await ensure_topics(settings.kafka.bootstrap, settings.topics.all(), partitions=3)
    logs = home / "logs"
    procs = [spawn(m, settings, logs / f"{m}.log") for m in
             ("consumers.ingest", "consumers.miner", "producers.relay", "flywheel.api.server")]
    api = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(600):
                try:
                    if (await client.get(api + "/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.2)
        yield Stack(settings, _pg_dsn(settings.db.url or "", name), api)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        for log in sorted(logs.glob("*.log")):
            text = log.read_text(errors="replace")
            if "Traceback" in text:
                print(f"--- {log.name}\n{text[-3000:]}")


async def _counts(stack: Stack) -> dict[str, int]:
    s = await collect(stack.settings)
    return {k: s[k] for k in ("trajectories", "awaiting_outcome", "failures", "tasks",
                              "feedback_applied")}


def _run_agent(stack: Stack, style: str, conversations: list[tuple[str, str]]
               ) -> tuple[Recording, list[dict[str, Any]]]:
    """The agent's conversations, its spans exported as an OTel exporter does."""
    exporter = Recording(OTLPSpanExporter(
        endpoint=stack.api + "/v1/traces", headers={"Authorization": f"Bearer {TOKEN}"},
        compression=Compression.Gzip, timeout=60))
    tp = provider(f"calc-service-{style}", BatchSpanProcessor, exporter)
    served: list[dict[str, Any]] = []
    with httpx.Client(base_url=stack.api, timeout=300,
                      headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        def chat(body: dict[str, Any]) -> dict[str, Any]:
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            served.append(r.json())
            return dict(r.json())

        for conversation, question in conversations:
            converse(tp, chat, style=style, conversation=conversation,  # type: ignore[arg-type]
                     question=question)
        tp.force_flush(60_000)
    tp.shutdown()
    return exporter, served


async def _row(dsn: str, tid: uuid.UUID) -> asyncpg.Record:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchrow("SELECT agent, status, record FROM trajectories "
                                   "WHERE trajectory_id = $1", tid)
    finally:
        await conn.close()


@pytest.mark.parametrize("style", STYLES)
async def test_an_instrumented_agent_feeds_the_loop(stack: Stack, style: str) -> None:
    before = await _counts(stack)
    n = STYLES.index(style)
    convs = [(f"conv-{style}-{uuid.uuid4().hex[:8]}", f"What is {4 + n} factorial?"),
             (f"conv-{style}-{uuid.uuid4().hex[:8]}", f"What is {7 + n} factorial?")]
    exporter, served = _run_agent(stack, style, convs)
    assert exporter.results and set(exporter.results) == {SpanExportResult.SUCCESS}
    ids = [trajectory_id(trajectory_key(c, "")) for c, _ in convs]
    in_ids = "'" + "','".join(map(str, ids)) + "'"
    assert await wait_for(stack.dsn, f"SELECT count(*) FROM trajectories WHERE trajectory_id"
                                     f" IN ({in_ids})", 2) == 2
    # What was served (dotted and colon names included) is what was logged and stored.
    calls = [c for r in served for c in r["choices"][0]["message"].get("tool_calls") or []]
    assert len(calls) == 2 and {c["function"]["name"] for c in calls} <= {
        t["function"]["name"] for t in TOOLS}
    for tid, call in zip(ids, calls, strict=True):
        row = await _row(stack.dsn, tid)
        record = json.loads(row["record"])
        assert (row["agent"], row["status"]) == ("calc-agent", "awaiting_outcome")
        stored = [i for i in record["items"] if i["type"] == "function_call"]
        assert [(i["name"], json.loads(i["arguments"])) for i in stored] == [
            (call["function"]["name"], json.loads(call["function"]["arguments"]))]
        assert [i["type"] for i in record["items"]] == [
            "message", "message", "function_call", "function_call_output", "message"]
        assert [t["name"] for t in record["tools"]] == ["math.factorial", "units:convert"]
        assert record["metadata"]["otel"]["span_count"] == 4
        assert record["usage"]["input_tokens"] > 0
    # Later, a person says what the agent should have done in the first conversation.
    correction = [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "math.factorial", "arguments": json.dumps({"n": 4 + n})}}]}]
    async with httpx.AsyncClient(base_url=stack.api, timeout=30,
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        r = await client.post(f"/v1/trajectories/{convs[0][0]}/feedback", json={
            "rating": "down", "by": "reviewer", "correction": correction})
        assert r.status_code == 202, r.text
    task_sql = (f"SELECT count(*) FROM task_sources s JOIN tasks t USING (task_id) "
                f"WHERE s.trajectory_id = '{ids[0]}' AND t.expected_from = 'human_correction'")
    assert await wait_for(stack.dsn, task_sql, 1, 90) == 1, "the correction made no task"
    conn = await asyncpg.connect(stack.dsn)
    try:
        spec = json.loads(await conn.fetchval(
            "SELECT t.spec::text FROM tasks t JOIN task_sources s USING (task_id) "
            "WHERE s.trajectory_id = $1", ids[0]))
    finally:
        await conn.close()
    assert spec["verifier"]["expected"][0]["name"] == "math.factorial"
    assert spec["verifier"]["expected"][0]["arguments"] == {"n": 4 + n}
    assert {t["function"]["name"] if "function" in t else t["name"] for t in spec["tools"]} \
        == {"math.factorial", "units:convert"}
    # The task, as training and the gate pose it, is served: its dotted tool is called.
    tools = [t if "function" in t else {"type": "function", "function": {
        k: v for k, v in t.items() if k != "type"}} for t in spec["tools"]]
    async with httpx.AsyncClient(base_url=stack.api, timeout=300,
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        r = await client.post("/v1/chat/completions", json={
            "model": "production", "messages": spec["messages"], "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "math.factorial"}},
            "temperature": 0, "max_tokens": 30})
        assert r.status_code == 200, r.text
        assert [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]
                ] == ["math.factorial"]
    await wait_for(stack.dsn, "SELECT count(*) FROM outbox WHERE published_at IS NULL", 0)
    after = await _counts(stack)
    assert {k: after[k] - before[k] for k in after} == {
        "trajectories": 2, "awaiting_outcome": 1, "failures": 1, "tasks": 1,
        "feedback_applied": 1}
    assert await scalar(stack.dsn, "SELECT count(*) FROM dead_letters") == 0


def _otlp_json(spans: list[dict[str, Any]], service: str = "planted") -> dict[str, Any]:
    return {"resourceSpans": [{"resource": {"attributes": [
        {"key": "service.name", "value": {"stringValue": service}}]},
        "scopeSpans": [{"scope": {"name": "t"}, "spans": spans}]}]}


def _span(trace: str, span: str, parent: str | None, attrs: dict[str, str],
          start: int = 1_700_000_000_000_000_000, status: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "traceId": trace, "spanId": span, "name": "chat m", "kind": 3,
        "startTimeUnixNano": str(start), "endTimeUnixNano": str(start + 1000),
        "attributes": [{"key": k, "value": {"stringValue": v}} for k, v in attrs.items()],
        "status": {"code": status}}
    if parent:
        out["parentSpanId"] = parent
    return out


CHAT = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m",
        "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [
            {"type": "text", "content": "hi"}]}]),
        "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [
            {"type": "text", "content": "hello"}]}])}


async def test_late_spans_resends_and_bad_spans(stack: Stack) -> None:
    """A child before its root waits; the root completes the trace; a late span is merged;
    the same export again changes nothing; a bad span is refused (partial success) and is
    a dead letter with its reason; an unreadable export is 400, a missing token 401."""
    before = await _counts(stack)
    trace, root, child, late = uuid.uuid4().hex, "a1" * 8, "b2" * 8, "c3" * 8
    tid = trajectory_id(trajectory_key(None, trace))
    outcome = {"flywheel.outcome.status": "failure", "flywheel.outcome.error": "gave up"}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=stack.api, timeout=30, headers=headers) as client:
        async def send(doc: dict[str, Any]) -> dict[str, Any]:
            r = await client.post("/v1/traces", json=doc)
            assert r.status_code == 200, r.text
            return dict(r.json())

        assert await send(_otlp_json([_span(trace, child, root, CHAT)])) == {}
        await asyncio.sleep(2)
        assert await scalar(stack.dsn, f"SELECT count(*) FROM trajectories WHERE "
                                       f"trajectory_id = '{tid}'") == 0, "sent before its root"
        full = _otlp_json([_span(trace, root, None, {"gen_ai.operation.name": "invoke_agent",
                                                     "gen_ai.agent.name": "late-bot",
                                                     **outcome})])
        assert await send(full) == {}
        await wait_for(stack.dsn, f"SELECT count(*) FROM trajectories WHERE trajectory_id = "
                                  f"'{tid}'", 1)
        tool = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "math.factorial",
                "gen_ai.tool.call.id": "call_late", "gen_ai.tool.call.arguments": '{"n": 3}',
                "gen_ai.tool.call.result": '{"result": 6}'}
        assert await send(_otlp_json([_span(trace, late, root, tool,
                                            start=1_700_000_000_000_002_000)])) == {}
        merged = (f"SELECT count(*) FROM trajectories WHERE trajectory_id = '{tid}' AND "
                  "(record #>> '{metadata,otel,span_count}')::int = 3")
        assert await wait_for(stack.dsn, merged, 1) == 1, "the late span was not merged"
        assert await send(full) == {}  # re-sent: the same trajectory, nothing new
        bad_chat = {**CHAT, "gen_ai.input.messages": "[{not json"}
        other = uuid.uuid4().hex
        answer = await send(_otlp_json([_span(other, "d4" * 8, None, bad_chat),
                                        _span("00" * 16, "e5" * 8, None, CHAT)]))
        assert answer["partialSuccess"]["rejectedSpans"] == "2"
        assert "gen_ai.input.messages is not valid JSON" in \
            answer["partialSuccess"]["errorMessage"]
        garbage = await client.post("/v1/traces", content=b"\x0a\xff",
                                    headers={"Content-Type": "application/x-protobuf"})
        assert garbage.status_code == 400
        anonymous = await client.post("/v1/traces", json=full, headers={"Authorization": ""})
        assert anonymous.status_code == 401
    assert await wait_for(stack.dsn, "SELECT count(*) FROM dead_letters", 2) == 2
    conn = await asyncpg.connect(stack.dsn)
    try:
        errors = sorted(r[0] for r in await conn.fetch("SELECT error FROM dead_letters"))
        row = await conn.fetchrow("SELECT agent, status, record FROM trajectories "
                                  "WHERE trajectory_id = $1", tid)
    finally:
        await conn.close()
    assert errors[0].startswith("span d4d4d4d4d4d4d4d4: gen_ai.input.messages is not valid")
    assert errors[1].startswith("span e5e5e5e5e5e5e5e5: trace_id must be 32 hex digits")
    record = json.loads(row["record"])
    assert (row["agent"], row["status"]) == ("late-bot", "failure")
    assert [i["type"] for i in record["items"]] == [
        "message", "message", "function_call", "function_call_output"]
    await wait_for(stack.dsn, "SELECT count(*) FROM outbox WHERE published_at IS NULL", 0)
    after = await _counts(stack)
    assert after["trajectories"] - before["trajectories"] == 1


FORMATS = Path(__file__).resolve().parents[1] / "docs" / "FORMATS.md"


def _formats_example() -> str:
    text = FORMATS.read_text()
    block = re.search(r"<!-- otel-example -->\n```python\n(.*?)^```", text, re.S | re.M)
    assert block is not None, "docs/FORMATS.md lost its OpenTelemetry example"
    return block.group(1)


async def test_the_formats_md_example_runs(stack: Stack, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", stack.api + "/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"Authorization=Bearer {TOKEN}")
    await asyncio.to_thread(exec, compile(_formats_example(), str(FORMATS), "exec"), {})
    tid = trajectory_id(trajectory_key("conv-42", ""))
    assert await wait_for(stack.dsn, f"SELECT count(*) FROM trajectories WHERE "
                                     f"trajectory_id = '{tid}'", 1) == 1
    row = await _row(stack.dsn, tid)
    record = json.loads(row["record"])
    assert (row["agent"], row["status"], record["session_id"]) == (
        "support-bot", "awaiting_outcome", "conv-42")
    assert [(i["type"], i.get("name")) for i in record["items"]] == [
        ("message", None), ("function_call", "orders.refund"), ("function_call_output", None)]
    assert record["usage"] == {"input_tokens": 42, "output_tokens": 9}
    assert record["model"] == "gpt-4o-mini" and record["tools"][0]["name"] == "orders.refund"


async def test_flywheel_publish_reads_an_otlp_json_file(stack: Stack, tmp_path: Path) -> None:
    from tests.test_ingest_otel import as_otlp_json, export

    convs = [f"conv-file-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    lines = [as_otlp_json(export("genai", c)).decode() for c in convs]
    bad = _otlp_json([_span(uuid.uuid4().hex, "f6" * 8, None,
                            {**CHAT, "gen_ai.output.messages": "{"})])
    path = tmp_path / "traces.jsonl"
    path.write_text("\n".join([*lines, json.dumps(bad)]) + "\n")
    done = subprocess.run([sys.executable, "-m", "flywheel.cli.main", "publish", str(path),
                           "--format", "otlp-json", "--json", "--agent", "file-bot"],
                          env={**os.environ, **settings_env(stack.settings)},
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stderr  # the bad span is reported, the rest published
    report = json.loads(done.stdout)
    assert (report["published"], report["invalid"]) == (2, 1)
    assert "span f6f6f6f6f6f6f6f6: gen_ai.output.messages is not valid JSON" in \
        report["errors"][0]["error"]
    ids = "','".join(str(trajectory_id(trajectory_key(c, ""))) for c in convs)
    assert await wait_for(stack.dsn, f"SELECT count(*) FROM trajectories WHERE trajectory_id "
                                     f"IN ('{ids}') AND agent = 'calc-agent'", 2) == 2
