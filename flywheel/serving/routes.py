"""The OpenAI-compatible routes agents call: `POST /v1/chat/completions`, `GET /v1/models`.

`model: "production"` follows promotions and rollbacks (`ServingSync`); `base` and
`<policy>@v<N>` address a version directly. Every answer names the version that answered,
in its `model` field and in the `X-Flywheel-Model` header. Chat needs a token with the
`publish` scope, the model list any valid token. Every error on these routes — a malformed
body, a wrong type, an unknown model, a missing token — has OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}`, so OpenAI clients raise their usual
exceptions with a readable message.

Mount with `create_app(settings, routers=[serving_router()], lifespan_hooks=[serving_lifespan])`
(`flywheel.serving.lifespan` owns the `ServingSync`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute

from flywheel.policy.base import PolicyError
from flywheel.policy.chat_format import ChatFormatError
from flywheel.serving.completions import complete, model_cards
from flywheel.serving.request import ChatRequest, RequestError, parse_request
from flywheel.serving.stream import events
from flywheel.serving.sync import ServingSync
from flywheel.web.auth import Principal, require_scope

MODEL_HEADER = "X-Flywheel-Model"
_CODES = {401: "invalid_api_key", 403: "insufficient_permissions", 404: "not_found",
          413: "request_too_large", 429: "rate_limit_exceeded"}


def openai_error(status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code or _CODES.get(status)}},
                        status_code=status, headers=headers)


class OpenAIRoute(APIRoute):
    """A route whose every error answers in OpenAI's error shape (auth errors included:
    dependencies run inside the route handler)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestError as err:
                return JSONResponse(err.body(), status_code=err.status)
            except HTTPException as err:
                return openai_error(err.status_code, str(err.detail),
                                    headers=dict(err.headers or {}))

        return route


async def answer_chat(serving: ServingSync, chat_request: ChatRequest) -> dict[str, Any]:
    """`complete`, its refusals as OpenAI errors (also what `/v1/responses` answers with)."""
    try:
        return await complete(serving, chat_request)
    except LookupError as err:
        raise RequestError(str(err), param="model", code="model_not_found",
                           status=404) from err
    except ChatFormatError as err:
        raise RequestError(str(err), param="tool_choice") from err
    except PolicyError as err:
        raise RequestError(f"the serving engine could not answer: {err}", status=503,
                           kind="server_error", code="engine_unavailable") from err


def _serving(request: Request) -> ServingSync:
    sync: ServingSync = request.app.state.serving
    return sync


def serving_router() -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["serving"], route_class=OpenAIRoute)

    @router.post("/chat/completions")
    async def chat(request: Request, _: Principal = require_scope("publish")) -> Response:
        """OpenAI Chat Completions with tool use (`tools`, `tool_choice`,
        `parallel_tool_calls`, `n`, `seed`, `stream`); see the README, "Calling
        production"."""
        chat_request = parse_request(await request.body())
        answer = await answer_chat(_serving(request), chat_request)
        headers = {MODEL_HEADER: answer["model"]}
        if not chat_request.stream:
            return JSONResponse(answer, headers=headers)
        usage = chat_request.stream_options is not None and \
            chat_request.stream_options.include_usage

        async def body() -> AsyncIterator[str]:
            for event in events(answer, include_usage=usage):
                yield event

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})

    @router.get("/models")
    async def models(request: Request, _: Principal = require_scope(None)) -> dict[str, Any]:
        """`production`, `base` and the servable versions (`<policy>@v<N>`: registered, with
        an artifact in the store), as OpenAI's model list."""
        return {"object": "list", "data": await model_cards(_serving(request))}

    @router.get("/models/{model}")
    async def model(model: str, request: Request,
                    _: Principal = require_scope(None)) -> dict[str, Any]:
        for card in await model_cards(_serving(request)):
            if card["id"] == model:
                return card
        raise RequestError(f"no model {model!r}: GET /v1/models lists what is served",
                           param="model", code="model_not_found", status=404)

    return router
