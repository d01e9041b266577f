"""HTTP gateway for agents that cannot speak Kafka: `POST /v1/trajectories` → Kafka.

Publishes to `settings.topics.trajectories` (key = trajectory_id, value = the v1 JSON); writes
nothing. Needs a token with the `publish` scope.

The body is one trajectory, a JSON array of them, or `{"trajectories": [...]}`; each may be
v1, an OpenAI Chat Completions transcript or a request/response pair, gets a content-derived
id when it has none, and is named by the token's agent when it names none
(`FLYWHEEL_API__TOKENS='{"tok": {"scopes": ["publish"], "agent": "support-bot"}}'`).
The whole request is validated before anything is sent, by ingest's own decoding boundary
(the same decision, reason and words as a dead letter on the Kafka path): one bad record
rejects the request and nothing is published. 202 is answered only after the broker
acknowledged every record (acks=all). If the broker fails midway some records may already be
on the topic; the client retries the whole request, which is safe because ingest dedupes on
trajectory_id.

Mount with `create_app(settings, routers=[gateway_router()], lifespan_hooks=[gateway_lifespan])`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request, status
from pydantic import BaseModel

from flywheel.api.feedback_routes import feedback_router
from flywheel.api.intake import intake_of, intake_router
from flywheel.api.publishing import gateway_lifespan, publish_or_503, read_body
from flywheel.config import Settings
from flywheel.formats import ParseContext
from flywheel.ingest.wire import load_json, sniff, validate_record
from flywheel.trajectory import Trajectory
from flywheel.web.app import create_app, settings_of
from flywheel.web.auth import Principal, require_scope

log = logging.getLogger(__name__)

_BODY_DOC = ("One trajectory, a JSON array of them, or {\"trajectories\": [...]}; each in v1"
             " format, an OpenAI Chat Completions transcript (`messages`) or a request/"
             "response pair (`request`, `response`).")
_REPORTED_RECORDS = 10  # a 422 lists this many bad records, then counts the rest


class Accepted(BaseModel):
    accepted: int
    """How many trajectories the broker acknowledged."""
    trajectory_ids: list[str]
    """Their ids, in request order (content-derived where the request had none)."""


@dataclass(frozen=True, slots=True)
class Prepared:
    trajectory: Trajectory
    value: bytes
    """The exact bytes published: what ingest's size limit is checked against."""


class Rejection(Exception):
    """The request cannot be accepted as sent; `detail` says why and how to fix it."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(detail)
        self.status_code = status_code
        self.detail = detail


# --- pure logic: bytes → validated records, or a rejection --------------------------------


def split_records(doc: Any) -> list[Any]:
    """The records of a decoded body: an object, an array, or `{"trajectories": [...]}`."""
    if isinstance(doc, list):
        return doc
    if isinstance(doc, dict) and "trajectories" in doc:
        extra = sorted(set(doc) - {"trajectories"})
        if extra:
            raise Rejection(422, f"unexpected field(s) {extra} next to 'trajectories': send"
                                 " {\"trajectories\": [...]} alone, or a bare trajectory")
        if not isinstance(doc["trajectories"], list):
            raise Rejection(422, "'trajectories' must be a JSON array of trajectory objects")
        records: list[Any] = doc["trajectories"]
        return records
    return [doc]


def prepare(body: bytes, *, max_payload_bytes: int,
            context: ParseContext | None = None) -> list[Prepared]:
    """Decode and validate a request body; all records are good, or `Rejection` is raised.

    Each record is judged by ingest's own boundary (`flywheel.ingest.wire`), so a record
    is refused here exactly when, with the same reason and words, it would be dead-lettered
    if sent to Kafka directly. `context` names the agent of records that name none (the
    token's agent).
    """
    plain, doc = sniff(body)  # a plain body holds only plain records: no walk needed
    if not plain:
        doc = load_json(body)
    if isinstance(doc, tuple):  # a Rejection (decoded JSON is never a tuple)
        reason, error = doc
        if reason == "not_json":
            raise Rejection(400, f"the body is not valid UTF-8 JSON ({error}); send one "
                                 "trajectory object, an array of them, or "
                                 "{\"trajectories\": [...]}")
        raise Rejection(422, f"the body: {error}")
    records = split_records(doc)
    if not records:
        raise Rejection(422, "the request holds no trajectories; send at least one")
    prepared: list[Prepared] = []
    invalid: list[str] = []
    too_large: list[str] = []
    for i, record in enumerate(records):
        result = validate_record(record, plain=plain, context=context)
        if isinstance(result, tuple):
            invalid.append(f"trajectories[{i}]: {result[1]}")
            continue
        value = result.model_dump_json(exclude_none=True).encode()
        if len(value) > max_payload_bytes:
            too_large.append(f"trajectories[{i}] is {len(value)} bytes")
        prepared.append(Prepared(result, value))
    if invalid:
        shown = "; ".join(invalid[:_REPORTED_RECORDS])
        rest = len(invalid) - _REPORTED_RECORDS
        raise Rejection(422, f"{len(invalid)} of {len(records)} trajectories are invalid, nothing"
                             f" was published: {shown}"
                             + (f"; and {rest} more invalid trajectories" if rest > 0 else ""))
    if too_large:
        raise Rejection(413, f"{'; '.join(too_large[:_REPORTED_RECORDS])}: one trajectory may be"
                             f" at most {max_payload_bytes} bytes (ingest.max_payload_bytes);"
                             " nothing was published. Trim large tool outputs or raise the limit")
    return prepared


def gateway_router() -> APIRouter:
    """`POST /v1/trajectories`; mount it together with `gateway_lifespan`."""
    router = APIRouter(tags=["trajectories"])

    # The body is read by hand (size cap, three shapes), so the spec declares it explicitly.
    body_spec = {"requestBody": {"required": True, "description": _BODY_DOC, "content": {
        "application/json": {"schema": {"oneOf": [{"type": "object"}, {"type": "array"}]}}}}}

    @router.post("/v1/trajectories", status_code=status.HTTP_202_ACCEPTED,
                 response_model=Accepted, openapi_extra=body_spec)
    async def post_trajectories(request: Request,
                                principal: Principal = require_scope("publish")) -> Accepted:
        """Publish one trajectory, an array, or `{"trajectories": [...]}` (v1 or chat format)."""
        async with intake_of(request.app).admit():  # 503 while the stack drains
            return await _publish_request(request, principal)

    async def _publish_request(request: Request, principal: Principal) -> Accepted:
        settings = settings_of(request)
        body = await read_body(request, settings.api.max_request_bytes)
        try:
            # Off the event loop: validating megabytes of JSON would stall every other request.
            records = await asyncio.to_thread(
                prepare, body, max_payload_bytes=settings.ingest.max_payload_bytes,
                context=ParseContext(token_agent=principal.agent))
        except Rejection as rej:
            raise HTTPException(rej.status_code, rej.detail) from None
        topic = settings.topics.trajectories
        await publish_or_503(request, topic, [
            (str(r.trajectory.trajectory_id).encode(), r.value) for r in records],
            what="trajectories", dedupe="ingest dedupes on trajectory_id")
        ids = [str(r.trajectory.trajectory_id) for r in records]
        log.info("gateway: token %s published %d trajectories to %s",
                 principal.fingerprint, len(ids), topic)
        return Accepted(accepted=len(ids), trajectory_ids=ids)

    return router


def create_gateway_app(settings: Settings) -> FastAPI:
    """An API app serving only the gateway, its feedback routes and intake (plus `/healthz`)."""
    return create_app(settings, routers=[gateway_router(), feedback_router(), intake_router()],
                      lifespan_hooks=[gateway_lifespan])
