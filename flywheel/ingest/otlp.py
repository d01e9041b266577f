"""OTLP/HTTP trace requests → plain span dicts (no I/O): the wire half of the OTel receiver.

Both encodings of `ExportTraceServiceRequest` are read with the official
`opentelemetry-proto` messages: `application/x-protobuf` is parsed as is; OTLP/JSON is
parsed into the same message after its one deviation from the protobuf JSON mapping is
undone (OTLP/JSON writes `traceId`, `spanId` and `parentSpanId` as hex, not base64). The
result is a list of `Span` dicts, the shape `flywheel.ingest.otel` converts and the
`otel_spans` record on the trajectories topic carries:

    {"trace_id": hex32, "span_id": hex16, "parent_span_id": hex16 | None, "name": str,
     "kind": int, "start_ns": int, "end_ns": int, "attributes": {key: value},
     "events": [{"name": str, "time_ns": int, "attributes": {...}}],
     "status": {"code": 0 unset | 1 ok | 2 error, "message": str},
     "resource": {key: value}, "scope": str}

Attribute values become JSON values (arrays and key-value lists kept as lists / objects,
bytes as hex). The answer to an export is `export_response`: OTLP's partial success when
some spans were refused.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import json
import zlib
from typing import Any

import msgspec
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")
_JSON = msgspec.json.Decoder()


class BadExport(ValueError):
    """The request as a whole cannot be read (OTLP answers 400; nothing is stored)."""


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body without its `Content-Encoding` (gzip, deflate or none), at most `limit` bytes
    once inflated, so a small bomb cannot take the process's memory."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding not in ("gzip", "deflate"):
        raise BadExport(f"Content-Encoding {encoding!r} is not supported; send gzip or none")
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as err:
        raise BadExport(f"the body is not valid {encoding} ({err})") from None
    if len(out) > limit:
        raise BadExport(f"the body inflates to over {limit} bytes (api.max_request_bytes); "
                        "export smaller batches")
    return out


def parse_request(body: bytes, content_type: str | None) -> ExportTraceServiceRequest:
    """The export request, from protobuf or OTLP/JSON by `content_type`."""
    kind = (content_type or PROTOBUF).split(";")[0].strip().lower()
    message = ExportTraceServiceRequest()
    if kind == PROTOBUF:
        try:
            message.ParseFromString(body)
        except (DecodeError, RecursionError) as err:
            raise BadExport(f"the body is not an OTLP ExportTraceServiceRequest ({err})"
                            ) from None
        return message
    if kind != JSON:
        raise BadExport(f"Content-Type {kind!r} is not OTLP; send {PROTOBUF} or {JSON}")
    try:
        doc = _JSON.decode(body)  # refuses lone surrogates, which no protobuf string holds
    except RecursionError:
        raise BadExport("the body is nested too deeply to be an OTLP export") from None
    except msgspec.DecodeError as err:
        raise BadExport(f"the body is not valid JSON ({err})") from None
    if not isinstance(doc, dict):
        raise BadExport("an OTLP/JSON export is an object with 'resourceSpans'")
    try:
        json_format.ParseDict(_ids_to_base64(doc), message, ignore_unknown_fields=True)
    except (json_format.ParseError, TypeError, ValueError, RecursionError) as err:
        raise BadExport(f"the body is not OTLP/JSON: {err}") from None
    return message


def _ids_to_base64(doc: Any) -> Any:
    """OTLP/JSON hex ids → the base64 the protobuf JSON mapping expects for bytes. A value
    that is not hex is left as it is: its span is then refused with a reason, not the
    request."""
    if isinstance(doc, list):
        return [_ids_to_base64(v) for v in doc]
    if not isinstance(doc, dict):
        return doc
    out = {}
    for key, value in doc.items():
        if key in _ID_FIELDS and isinstance(value, str):
            try:
                out[key] = base64.b64encode(bytes.fromhex(value)).decode()
            except ValueError:
                out[key] = value
        else:
            out[key] = _ids_to_base64(value)
    return out


def read_export(body: bytes, content_type: str | None) -> list[dict[str, Any]]:
    """Every span of an export as a `Span` dict (see the module docstring)."""
    return request_spans(parse_request(body, content_type))


def request_spans(message: ExportTraceServiceRequest) -> list[dict[str, Any]]:
    spans = []
    for rs in message.resource_spans:
        resource = attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append({
                    "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex() or None, "name": s.name,
                    "kind": int(s.kind), "start_ns": s.start_time_unix_nano,
                    "end_ns": s.end_time_unix_nano, "attributes": attributes(s.attributes),
                    "events": [{"name": e.name, "time_ns": e.time_unix_nano,
                                "attributes": attributes(e.attributes)} for e in s.events],
                    "status": {"code": int(s.status.code), "message": s.status.message},
                    "resource": resource, "scope": ss.scope.name})
    return spans


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs if isinstance(kv, KeyValue)}


def any_value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return attributes(v.kvlist_value.values)
    if which == "bytes_value":
        return binascii.hexlify(v.bytes_value).decode()
    return getattr(v, which)


def export_response(rejected: int, error: str, content_type: str | None) -> tuple[bytes, str]:
    """(body, media type) of the answer: an empty `ExportTraceServiceResponse`, or its
    partial success naming how many spans were refused and why, in the request's encoding."""
    response = ExportTraceServiceResponse()
    if rejected:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = error
    if (content_type or "").split(";")[0].strip().lower() == JSON:
        return json.dumps(json_format.MessageToDict(response)).encode(), JSON
    return response.SerializeToString(), PROTOBUF


def read_otlp_json_file(text: str) -> list[dict[str, Any]]:
    """The spans of an OTLP/JSON file: one `ExportTraceServiceRequest` a line (what the
    Collector's file exporter writes), or one request in the whole file."""
    try:
        return read_export(text.encode(), JSON)
    except BadExport:
        pass
    spans: list[dict[str, Any]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                spans.extend(read_export(line.encode(), JSON))
            except BadExport as err:
                raise BadExport(f"line {n}: {err}") from None
    return spans


def gzip_bytes(body: bytes) -> bytes:
    """What an exporter with `compression=gzip` sends (tests and the benchmark)."""
    return gzip.compress(body)
