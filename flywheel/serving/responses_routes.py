"""The OpenAI Responses API on the serving endpoint: `POST /v1/responses`,
`GET /v1/responses/{id}`.

A call is parsed (`responses_request`), continued from the stored conversation that
`previous_response_id` names (`responses_store`), answered as the chat completion it is
(`serving_routes.answer_chat`: the same versions, the same chat format and decoding, the
same errors in OpenAI's shape) and returned as a `response` object or its event stream
(`responses_body`). With `store` (the default) the answer is kept for chaining. The same
scopes as chat: `publish` to create, any valid token to retrieve.

Mount beside `serving_router()`: `create_app(settings, routers=[serving_router(),
responses_router()], lifespan_hooks=[serving_lifespan])`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from flywheel.serving.request import RequestError
from flywheel.serving.responses_body import assistant_message, response_body, sse
from flywheel.serving.responses_request import parse_responses_request, to_chat_request
from flywheel.serving.responses_store import load, save
from flywheel.serving.routes import MODEL_HEADER, OpenAIRoute, answer_chat
from flywheel.serving.sync import ServingSync
from flywheel.web.auth import Principal, require_scope


def _serving(request: Request) -> ServingSync:
    sync: ServingSync = request.app.state.serving
    return sync


async def _stored(serving: ServingSync, response_id: str, param: str | None
                  ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    found = await load(serving.engine, response_id)
    if found is None:
        raise RequestError(f"Previous response with id {response_id!r} not found: it was "
                           "never stored (store: false), or it is older than the newest "
                           f"{serving.settings.api.responses_kept} kept",
                           param=param, code="previous_response_not_found",
                           status=400 if param else 404)
    return found


def responses_router() -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["serving"], route_class=OpenAIRoute)

    @router.post("/responses")
    async def create(request: Request, _: Principal = require_scope("publish")) -> Response:
        """OpenAI Responses with function tools (`tools`, `tool_choice`,
        `parallel_tool_calls`, `previous_response_id`, `stream`); see docs/FORMATS.md."""
        serving = _serving(request)
        call = parse_responses_request(await request.body())
        history: list[dict[str, Any]] = []
        if call.previous_response_id is not None:
            history = (await _stored(serving, call.previous_response_id,
                                     "previous_response_id"))[0]
        chat, conversation = to_chat_request(call, history)
        answer = await answer_chat(serving, chat)
        body = response_body(call, answer, f"resp_{uuid.uuid4().hex}")
        if call.store:
            await save(serving.engine, body["id"], [*conversation, assistant_message(body)],
                       body, serving.settings.api.responses_kept)
        headers = {MODEL_HEADER: body["model"]}
        if not call.stream:
            return JSONResponse(body, headers=headers)

        async def events() -> AsyncIterator[str]:
            for event in sse(body):
                yield event

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})

    @router.get("/responses/{response_id}")
    async def retrieve(response_id: str, request: Request,
                       _: Principal = require_scope(None)) -> dict[str, Any]:
        """A stored `response` object."""
        return (await _stored(_serving(request), response_id, None))[1]

    return router
