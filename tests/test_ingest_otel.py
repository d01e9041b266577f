"""OTel GenAI spans → trajectories: spans recorded by the real OpenTelemetry SDK, encoded by
the real OTLP encoder (protobuf and OTLP/JSON), read by the receiver's wire half and
converted at ingest's boundary — in the three styles agents record content in."""

from __future__ import annotations

import base64
import gzip
import json
from typing import Any

import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flywheel.ingest.otel import OTEL_RECORD, span_problem, trajectory_id, trajectory_key
from flywheel.ingest.otlp import BadExport, decompress, export_response, read_export
from flywheel.ingest.wire import validate_record
from flywheel.trajectory import Trajectory
from tests.support.otel_agent import converse, provider


def scripted_model(body: dict[str, Any]) -> dict[str, Any]:
    """A model that calls math.factorial when it must call a tool, then answers."""
    if body["tool_choice"] == "required":
        n = len(body["messages"])
        message = {"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{n}", "type": "function",
            "function": {"name": "math.factorial", "arguments": '{"n": 5}'}}]}
    else:
        message = {"role": "assistant", "content": "5! is 120."}
    return {"model": "production", "choices": [{"index": 0, "message": message}],
            "usage": {"prompt_tokens": 30, "completion_tokens": 7}}


def export(style: Any, conversation: str = "conv-1") -> bytes:
    exporter = InMemorySpanExporter()
    tp = provider("calc-service", SimpleSpanProcessor, exporter)
    converse(tp, scripted_model, style=style, conversation=conversation,
             question="What is 5 factorial?")
    tp.shutdown()
    return encode_spans(exporter.get_finished_spans()).SerializeToString()


def as_otlp_json(body: bytes) -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    doc = json_format.MessageToDict(ExportTraceServiceRequest.FromString(body))
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for s in ss["spans"]:
                for k in ("traceId", "spanId", "parentSpanId"):
                    if k in s:
                        s[k] = base64.b64decode(s[k]).hex()
    return json.dumps(doc).encode()


EXPECTED_ITEMS = [
    {"type": "message", "role": "system", "content": "You are a calculator. Use the tools."},
    {"type": "message", "role": "user", "content": "What is 5 factorial?"},
    {"type": "function_call", "call_id": "call_2", "name": "math.factorial",
     "arguments": '{"n": 5}'},
    {"type": "function_call_output", "call_id": "call_2", "output": '{"result": 120}',
     "status": "ok"},
    {"type": "message", "role": "assistant", "content": "5! is 120."}]


@pytest.mark.parametrize("style", ["genai", "events", "openinference"])
def test_each_style_makes_the_same_trajectory(style: str) -> None:
    spans = read_export(export(style), "application/x-protobuf")
    assert len(spans) == 4 and all(span_problem(s) is None for s in spans)
    t = validate_record({OTEL_RECORD: spans})
    assert isinstance(t, Trajectory), t
    items = [i.model_dump(exclude_none=True) for i in t.items]
    # The arguments differ only in spacing between styles: compare them decoded.
    for got in items:
        if got["type"] == "function_call":
            got["arguments"] = json.dumps(json.loads(got["arguments"]))
    assert items == EXPECTED_ITEMS
    assert t.trajectory_id == trajectory_id(trajectory_key("conv-1", "ignored"))
    assert t.agent == "calc-agent" and t.session_id == "conv-1"
    assert [tool.name for tool in t.tools] == ["math.factorial", "units:convert"]
    assert t.outcome is None and t.status == "awaiting_outcome"
    assert t.usage is not None and (t.usage.input_tokens, t.usage.output_tokens) == (60, 14)
    assert t.metadata["request_id"] == "conv-1" and t.metadata["otel"]["span_count"] == 4
    assert t.started_at is not None and t.ended_at is not None and t.latency_ms is not None


def test_json_and_gzip_read_as_protobuf_does() -> None:
    body = export("genai")
    spans = read_export(body, "application/x-protobuf")
    assert read_export(as_otlp_json(body), "application/json; charset=utf-8") == spans
    assert decompress(gzip.compress(body), "gzip", 10**6) == body
    with pytest.raises(BadExport, match="inflates to over"):
        decompress(gzip.compress(b"\0" * 5000), "gzip", 1000)
    with pytest.raises(BadExport, match="not an OTLP"):
        read_export(b"\xff\xff\xff", "application/x-protobuf")


def test_outcome_attributes_and_root_status() -> None:
    spans = read_export(export("genai"), "application/x-protobuf")
    root = next(s for s in spans if not s["parent_span_id"])
    root["attributes"]["flywheel.outcome.status"] = "failure"
    root["attributes"]["flywheel.outcome.reward"] = 0.0
    t = validate_record({OTEL_RECORD: spans})
    assert isinstance(t, Trajectory) and t.outcome is not None
    assert (t.outcome.status, t.outcome.reward) == ("failure", 0.0)
    del root["attributes"]["flywheel.outcome.status"]
    root["status"] = {"code": 2, "message": "agent crashed"}
    t = validate_record({OTEL_RECORD: spans})
    assert isinstance(t, Trajectory) and t.outcome is not None
    assert (t.outcome.status, t.outcome.error) == ("error", "agent crashed")


def test_a_malformed_span_is_refused_with_its_reason() -> None:
    spans = read_export(export("genai"), "application/x-protobuf")
    chat = next(s for s in spans if s["name"].startswith("chat"))
    chat["attributes"]["gen_ai.input.messages"] = "[{not json"
    assert span_problem(chat) == f"span {chat['span_id']}: gen_ai.input.messages is not " \
                                 "valid JSON"
    assert validate_record({OTEL_RECORD: spans}) == ("schema", span_problem(chat))
    assert span_problem({**chat, "trace_id": "00" * 16}) is not None
    body, media = export_response(1, "span x: bad", "application/json")
    assert media == "application/json"
    assert json.loads(body) == {"partialSuccess": {"rejectedSpans": "1",
                                                   "errorMessage": "span x: bad"}}
    assert export_response(0, "", None)[0] == b""


def test_late_spans_make_a_superset_with_the_same_id() -> None:
    spans = read_export(export("genai"), "application/x-protobuf")
    early = [s for s in spans if s["name"].startswith(("invoke", "chat"))]
    first, full = validate_record({OTEL_RECORD: early}), validate_record({OTEL_RECORD: spans})
    assert isinstance(first, Trajectory) and isinstance(full, Trajectory)
    assert first.trajectory_id == full.trajectory_id
    assert (first.metadata["otel"]["span_count"], full.metadata["otel"]["span_count"]) == (3, 4)


def test_a_span_postgres_cannot_store_is_refused() -> None:
    spans = read_export(export("genai"), "application/x-protobuf")
    spans[0]["attributes"]["note"] = "a\x00b"
    problem = span_problem(spans[0])
    assert problem is not None and problem.startswith(f"span {spans[0]['span_id']}: ")
    assert isinstance(validate_record({OTEL_RECORD: spans}), tuple)


def test_a_record_over_the_payload_limit_is_refused_not_published() -> None:
    """What the broker would refuse (over `ingest.max_payload_bytes`) is answered as a refused
    span with its size, never sent: a 503 on every later export of the conversation else."""
    from flywheel.api.traces import to_publish
    from flywheel.formats import ParseContext

    small, big = ({"name": "s"}, "bad span"), ({"name": "b" * 5000}, "bad span too")
    records, refused, reasons = to_publish({}, [small, big], ParseContext(), 1000)
    assert len(records) == 1 and refused == 2
    assert any("ingest.max_payload_bytes" in r for r in reasons)
