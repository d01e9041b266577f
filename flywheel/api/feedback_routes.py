"""Feedback over HTTP: outcomes, ratings and corrections that arrive after the trajectory.

`POST /v1/trajectories/{id}/feedback` names the trajectory in the URL: its trajectory id
(a UUID, as the gateway and the SDK return it) or, for anything else, the request's id
(e.g. the response's `id` of a logged request/response pair). `POST /v1/feedback` takes one
feedback object, a JSON array of them or `{"feedback": [...]}`, each naming its trajectory
itself (`trajectory_id` or `request_id`). Both need the `publish` scope, validate everything
before anything is sent, and publish to `<prefix>.feedback` (key = the trajectory or request
id); the miner applies it. 202 once the broker acknowledged every record.

Mounted with the gateway (it shares the gateway's producer, `gateway_lifespan`).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import APIRouter, HTTPException, Request, status
from pydantic import BaseModel

from flywheel.api.publishing import publish_or_503, read_body
from flywheel.feedback import Feedback
from flywheel.ingest.feedback_wire import validate_feedback
from flywheel.ingest.wire import load_json, sniff
from flywheel.web.app import settings_of
from flywheel.web.auth import Principal, require_scope

log = logging.getLogger(__name__)
_REPORTED = 10  # a 422 lists this many bad records

_DOC = ('Feedback: {"rating": "up"|"down", "outcome": {…}, "feedback": {"expected_call": …},'
        ' "correction": [chat messages or items], "by": …, "note": …}; on /v1/feedback each'
        " names `trajectory_id` or `request_id`.")


class FeedbackAccepted(BaseModel):
    accepted: int
    """How many feedback records the broker acknowledged."""
    feedback_ids: list[str]
    """Their ids, in request order (content-derived where the request had none)."""


def _target(ref: str) -> dict[str, Any]:
    """The target a URL names: a trajectory id (a UUID), else a request id."""
    try:
        return {"trajectory_id": uuid.UUID(ref)}
    except ValueError:
        return {"request_id": ref}


def parse_feedback_body(body: bytes, *, ref: str | None) -> list[Feedback]:
    """All records of a body as `Feedback`, or HTTPException 400/422 saying what is wrong.

    Each record is judged by the feedback boundary the miner decides with
    (`flywheel.ingest.feedback_wire`): refused here exactly when, with the same words, the miner
    would park it if it were sent to Kafka directly."""
    plain, doc = sniff(body)  # a plain body holds only plain records: no walk needed
    if not plain:
        doc = load_json(body)
    if isinstance(doc, tuple):  # a Rejection (decoded JSON is never a tuple)
        reason, error = doc
        if reason == "not_json":
            raise HTTPException(400, f"the body is not valid UTF-8 JSON ({error})")
        raise HTTPException(422, f"the body: {error}")
    if ref is not None:
        if not isinstance(doc, dict):
            raise HTTPException(422, "send one feedback object to this URL (several go to "
                                     "POST /v1/feedback)")
        records: list[Any] = [doc]
    elif isinstance(doc, dict) and isinstance(doc.get("feedback"), list) and len(doc) == 1:
        records = doc["feedback"]
    else:
        records = doc if isinstance(doc, list) else [doc]
    if not records:
        raise HTTPException(422, "the request holds no feedback; send at least one")
    target = _target(ref) if ref is not None else {}
    out, invalid = [], []
    for i, record in enumerate(records):
        result = validate_feedback(record, plain=plain, **target)
        if isinstance(result, tuple):
            invalid.append(f"feedback[{i}]: {result[1]}")
        else:
            out.append(result)
    if invalid:
        raise HTTPException(422, f"{len(invalid)} of {len(records)} feedback records are "
                                 f"invalid, nothing was published: "
                                 + "; ".join(invalid[:_REPORTED])
                                 + (f"; and {len(invalid) - _REPORTED} more"
                                    if len(invalid) > _REPORTED else ""))
    return out


def feedback_router() -> APIRouter:
    """`POST /v1/trajectories/{id}/feedback` and `POST /v1/feedback`."""
    router = APIRouter(tags=["feedback"])
    spec = {"requestBody": {"required": True, "description": _DOC, "content": {
        "application/json": {"schema": {"oneOf": [{"type": "object"}, {"type": "array"}]}}}}}

    async def accept(request: Request, principal: Principal, ref: str | None
                     ) -> FeedbackAccepted:
        settings = settings_of(request)
        body = await read_body(request, settings.api.max_request_bytes)
        records = parse_feedback_body(body, ref=ref)
        values = [(fb.target.encode(), fb.model_dump_json(exclude_none=True).encode())
                  for fb in records]
        too_large = [n for n, (_, v) in enumerate(values)
                     if len(v) > settings.ingest.max_payload_bytes]
        if too_large:
            raise HTTPException(413, f"feedback {too_large[:10]} over "
                                     f"{settings.ingest.max_payload_bytes} bytes "
                                     "(ingest.max_payload_bytes); nothing was published")
        await publish_or_503(request, settings.topics.feedback, values, what="feedback",
                             dedupe="feedback is applied once per feedback_id")
        ids = [str(fb.feedback_id) for fb in records]
        log.info("gateway: token %s published %d feedback records", principal.fingerprint,
                 len(ids))
        return FeedbackAccepted(accepted=len(ids), feedback_ids=ids)

    @router.post("/v1/trajectories/{ref}/feedback", status_code=status.HTTP_202_ACCEPTED,
                 response_model=FeedbackAccepted, openapi_extra=spec)
    async def post_trajectory_feedback(request: Request, ref: str,
                                       principal: Principal = require_scope("publish")
                                       ) -> FeedbackAccepted:
        """Feedback for one trajectory: `ref` is its trajectory id, or the request's id."""
        return await accept(request, principal, ref)

    @router.post("/v1/feedback", status_code=status.HTTP_202_ACCEPTED,
                 response_model=FeedbackAccepted, openapi_extra=spec)
    async def post_feedback(request: Request, principal: Principal = require_scope("publish")
                            ) -> FeedbackAccepted:
        """Feedback records that each name their trajectory (`trajectory_id`/`request_id`)."""
        return await accept(request, principal, None)

    return router
