"""`flywheel bench otlp`: OTLP/HTTP spans → `/v1/traces` → Kafka → ingest → Postgres, against
the HTTP gateway (`/v1/trajectories`) carrying the same conversations, in the same run.

Starts its own broker, Postgres, one ingest consumer and the API (no serving). Each
conversation is an agent turn as the GenAI conventions record it: an `invoke_agent` root, a
chat span that calls a tool, the `execute_tool` span, a chat span that answers (4 spans).
The gateway leg posts the same conversations as Chat Completions transcripts. Both post in
batches (`batch` conversations a request, gzip for OTLP as exporters send it), `concurrency`
requests in flight, timed from the first request until every trajectory is stored. Reports
`otlp_spans_per_s`, `otlp_trajectories_per_s`, `gateway_trajectories_per_s` and their ratio.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from flywheel.bench.stack import temp_stack
from flywheel.config import ApiSettings, Settings, TokenGrant, settings_env
from flywheel.stack.broker import free_port

TOKEN = "bench-otlp-token-0123456789abcdef"
SPANS_PER_CONVERSATION = 4
_TOOLS = [{"type": "function", "function": {"name": "orders.lookup", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "string"}}}}}]


def _kv(key: str, value: str | int) -> KeyValue:
    v = AnyValue(int_value=value) if isinstance(value, int) else AnyValue(string_value=value)
    return KeyValue(key=key, value=v)


def _messages(n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the chat transcript, the GenAI messages of the same turn) of conversation `n`."""
    order = str(10_000 + n)
    call = {"id": f"call_{n}", "type": "function", "function": {
        "name": "orders.lookup", "arguments": json.dumps({"order_id": order})}}
    chat: list[dict[str, Any]] = [
        {"role": "user", "content": f"Where is order {order}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{n}", "content": '{"status": "shipped"}'},
        {"role": "assistant", "content": f"Order {order} has shipped."}]
    genai: list[dict[str, Any]] = [
        {"role": "user", "parts": [{"type": "text", "content": chat[0]["content"]}]},
        {"role": "assistant", "parts": [{"type": "tool_call", "id": f"call_{n}",
                                         "name": "orders.lookup",
                                         "arguments": {"order_id": order}}]},
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": f"call_{n}",
                                    "response": '{"status": "shipped"}'}]},
        {"role": "assistant", "parts": [{"type": "text", "content": chat[3]["content"]}]}]
    return chat, genai


def conversation_spans(n: int, run: str, t0: int) -> list[Span]:
    _, genai = _messages(n)
    trace = uuid.uuid5(uuid.NAMESPACE_URL, f"{run}/{n}").bytes
    ids = [uuid.uuid5(uuid.NAMESPACE_URL, f"{run}/{n}/{i}").bytes[:8] for i in range(4)]
    conv = [_kv("gen_ai.conversation.id", f"{run}-{n}")]

    def span(i: int, name: str, attrs: list[KeyValue], start: int, end: int) -> Span:
        return Span(trace_id=trace, span_id=ids[i], parent_span_id=ids[0] if i else b"",
                    name=name, start_time_unix_nano=t0 + start, end_time_unix_nano=t0 + end,
                    attributes=attrs)

    chat = [_kv("gen_ai.operation.name", "chat"), _kv("gen_ai.request.model", "m"),
            _kv("gen_ai.tool.definitions", json.dumps(_TOOLS))]
    return [
        span(0, "invoke_agent shop", [_kv("gen_ai.operation.name", "invoke_agent"),
                                      _kv("gen_ai.agent.name", "shop-bot"), *conv], 0, 4000),
        span(1, "chat m", [*chat, *conv, _kv("gen_ai.input.messages", json.dumps(genai[:1])),
                           _kv("gen_ai.output.messages", json.dumps(genai[1:2])),
                           _kv("gen_ai.usage.input_tokens", 40),
                           _kv("gen_ai.usage.output_tokens", 9)], 100, 1000),
        span(2, "execute_tool orders.lookup", [
            _kv("gen_ai.operation.name", "execute_tool"), _kv("gen_ai.tool.name",
                                                              "orders.lookup"),
            _kv("gen_ai.tool.call.id", f"call_{n}")], 1100, 1500),
        span(3, "chat m", [*chat, *conv, _kv("gen_ai.input.messages", json.dumps(genai[:3])),
                           _kv("gen_ai.output.messages", json.dumps(genai[3:])),
                           _kv("gen_ai.usage.input_tokens", 60),
                           _kv("gen_ai.usage.output_tokens", 8)], 1600, 3900)]


def export_body(numbers: range, run: str) -> bytes:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(_kv("service.name", "shop"))
    ss = rs.scope_spans.add()
    t0 = time.time_ns()
    for n in numbers:
        ss.spans.extend(conversation_spans(n, run, t0))
    return gzip.compress(req.SerializeToString())


async def _post_all(client: httpx.AsyncClient, path: str, bodies: list[tuple[bytes, str]],
                    concurrency: int, gz: bool) -> None:
    queue = list(reversed(bodies))

    async def worker() -> None:
        while queue:
            body, ctype = queue.pop()
            headers = {"Content-Type": ctype, **({"Content-Encoding": "gzip"} if gz else {})}
            for _ in range(20):
                r = await client.post(path, content=body, headers=headers)
                if r.status_code != 503:
                    break
                await asyncio.sleep(1)
            if r.status_code >= 300:
                raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:300]}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _timed(dsn: str, expected: int, send: Any) -> float:
    conn = await asyncpg.connect(dsn)
    try:
        base = int(await conn.fetchval("SELECT count(*) FROM trajectories"))
        t0 = time.perf_counter()
        sending = asyncio.create_task(send())
        while int(await conn.fetchval("SELECT count(*) FROM trajectories")) - base < expected:
            if sending.done() and sending.exception() is not None:
                raise sending.exception()  # type: ignore[misc]
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - t0
        await sending
        return elapsed
    finally:
        await conn.close()


async def _legs(settings: Settings, api: str, n: int, batch: int, concurrency: int
                ) -> tuple[float, float]:
    assert settings.db.url
    dsn = settings.db.url.replace("postgresql+asyncpg://", "postgresql://")
    run = uuid.uuid4().hex[:8]
    chats = [json.dumps([{"agent": "shop-bot", "tools": _TOOLS, "session_id": f"g-{run}-{i}",
                          "messages": _messages(i)[0]} for i in range(s, min(s + batch, n))]
                        ).encode() for s in range(0, n, batch)]
    exports = [export_body(range(s, min(s + batch, n)), run) for s in range(0, n, batch)]
    async with httpx.AsyncClient(base_url=api, timeout=120,
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        for _ in range(300):
            try:
                if (await client.get("/healthz")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
        # Warm-up: one of each, so neither leg pays for connections and the group forming.
        await _timed(dsn, 1, lambda: _post_all(client, "/v1/trajectories", [(json.dumps(
            {"agent": "w", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            "application/json")], 1, False))
        await _timed(dsn, 1, lambda: _post_all(client, "/v1/traces", [(
            export_body(range(n, n + 1), "warm"), "application/x-protobuf")], 1, True))
        gateway = await _timed(dsn, n, lambda: _post_all(
            client, "/v1/trajectories", [(b, "application/json") for b in chats],
            concurrency, False))
        otlp = await _timed(dsn, n, lambda: _post_all(
            client, "/v1/traces", [(b, "application/x-protobuf") for b in exports],
            concurrency, True))
    return gateway, otlp


def run_bench(n: int = 2000, *, batch: int = 50, concurrency: int = 4) -> dict[str, Any]:
    port = free_port()
    with temp_stack(api=ApiSettings(port=port, serve=False, tokens={
            TOKEN: TokenGrant(scopes=["publish"])})) as settings:
        env = {**os.environ, **settings_env(settings)}
        log = Path(settings.home) / "otlp-bench.log"
        with open(log, "ab") as out:
            procs = [subprocess.Popen([sys.executable, "-m", m], env=env, stdout=out,
                                      stderr=subprocess.STDOUT)
                     for m in ("consumers.ingest", "flywheel.api.server")]
        try:
            gateway, otlp = asyncio.run(_legs(settings, f"http://127.0.0.1:{port}", n, batch,
                                              concurrency))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
    spans = n * SPANS_PER_CONVERSATION
    return {"conversations": n, "batch": batch, "concurrency": concurrency,
            "otlp_spans_per_s": round(spans / otlp, 1),
            "otlp_trajectories_per_s": round(n / otlp, 1),
            "gateway_trajectories_per_s": round(n / gateway, 1),
            "otlp_vs_gateway": round(gateway / otlp, 3)}
