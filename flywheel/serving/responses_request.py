"""The Responses API request (`POST /v1/responses`), as the OpenAI client and the Agents SDK
send it, and the Chat Completions request it is answered as.

`parse_responses_request(body)` validates the raw bytes strictly (pydantic's JSON parser, as
`serving.request` does) into a `ResponsesRequest` or raises a `RequestError` naming the
parameter the way OpenAI does (`input[1].call_id`). `to_chat_request(request, history)` is the
same call as a `ChatRequest`: `instructions` a system message first, then the stored
conversation `previous_response_id` names (its own instructions are not inherited, as on
OpenAI), then the input items — a `function_call` joins the assistant message before it (a
turn's text and calls are one assistant message, as the chat format renders them), a
`function_call_output` is a `tool` message. From there on a call is decoded exactly as a
chat completion, and so as the gate decodes (`flywheel.serving.completions`); what
`ChatRequest` refuses (the tool-name rule, ranges) is refused here, named by this API's
parameters.

Supported: `input` (a string, or `message` / `function_call` / `function_call_output`
items with text content), `instructions`, function `tools`, `tool_choice`,
`parallel_tool_calls`, `previous_response_id`, `store`, `stream`, `max_output_tokens`,
`temperature`, `top_p`, `metadata`, and the extensions `seed` and `return_token_ids`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, field_validator

from flywheel.serving.request import (
    ChatRequest,
    RequestError,
    _Model,
    check_tool_choice,
    request_error,
)


class TextPart(_Model):
    type: str
    text: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind not in ("input_text", "output_text", "text"):
            raise ValueError(f"content parts of type {kind!r} are not supported: the served "
                             "model reads text only; send a string or input_text parts")
        return kind


Content = str | list[TextPart]


class MessageInput(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallInput(_Model):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputInput(_Model):
    type: Literal["function_call_output"]
    call_id: str
    output: Content


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[Annotated[MessageInput, Tag("message")]
                      | Annotated[FunctionCallInput, Tag("function_call")]
                      | Annotated[FunctionCallOutputInput, Tag("function_call_output")],
                      Discriminator(_item_kind)]


class FunctionTool(_Model):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Model):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Model):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None
    """Flywheel's extension (as vLLM's): the sampling seed."""
    return_token_ids: bool = False
    """Flywheel's extension: `prompt_token_ids` in the answer."""
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    top_logprobs: int | None = Field(default=None, ge=0)

    def echo_tool_choice(self) -> str | dict[str, str]:
        if isinstance(self.tool_choice, ToolChoiceFunction):
            return {"type": "function", "name": self.tool_choice.name}
        return self.tool_choice or ("auto" if self.tools else "none")

    def echo_tools(self) -> list[dict[str, Any]]:
        return [t.model_dump() for t in self.tools or ()]


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """The validated request; `RequestError` (400) saying what is wrong and where."""
    if not body.strip():
        raise RequestError("the request body is empty: send a JSON responses request "
                           '({"model": "production", "input": "..."})', code="invalid_json")
    try:
        request = ResponsesRequest.model_validate_json(body)
    except ValidationError as err:
        raise _request_error(err) from None
    fmt = (request.text or {}).get("format")
    unsupported = {
        "text.format": isinstance(fmt, dict) and fmt.get("type", "text") != "text",
        "reasoning": bool(request.reasoning and request.reasoning.get("effort")),
        "background": bool(request.background), "conversation": request.conversation
        is not None, "top_logprobs": bool(request.top_logprobs)}
    for param, used in unsupported.items():
        if used:
            raise RequestError(f"{param} is not supported by this server (it would change the "
                               "answer, so it is refused rather than ignored); leave it out"
                               + ("; chain calls with previous_response_id"
                                  if param == "conversation" else ""),
                               param=param, code="unsupported_parameter")
    return request


def _text(content: Content) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """Input items → Chat Completions messages (the shape `ChatRequest` takes)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    joinable = False  # the last message is the assistant's and a call may join it
    for item in items:
        if isinstance(item, FunctionCallInput):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if joinable:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            joinable = True
        elif isinstance(item, FunctionCallOutputInput):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(item.output)})
            joinable = False
        else:
            out.append({"role": item.role, "content": _text(item.content)})
            joinable = item.role == "assistant"
    return out


_FIELDS = frozenset(name for model in (TextPart, MessageInput, FunctionCallInput,
                                       FunctionCallOutputInput, FunctionTool,
                                       ToolChoiceFunction, ResponsesRequest)
                    for name in model.model_fields) - {"message"}


def _request_error(err: ValidationError) -> RequestError:
    """`chat_request.request_error`'s reading of `err`, with the parameter named by this
    request's fields (`input[1].call_id`), not pydantic's union labels."""
    def path(loc: tuple[int | str, ...]) -> str | None:
        out = ""
        for part in loc:
            if isinstance(part, int):
                out += f"[{part}]"
            elif part in _FIELDS:
                out += f".{part}" if out else part
        return out or None

    deepest = max(err.errors(include_url=False), key=lambda e: len(path(tuple(e["loc"])) or ""))
    param = path(tuple(deepest["loc"]))
    chat = request_error(err)
    if param is None:
        return RequestError(chat.message.replace("a chat completion request",
                                                 "a responses request"), code=chat.code)
    said = chat.message.removeprefix(f"{chat.param}: ") if chat.param else chat.message
    return RequestError(f"{param}: {said}", param=param, code=chat.code)


_PARAMS = {"max_tokens": "max_output_tokens", "tool_choice.function.name": "tool_choice.name"}


def _renamed(err: RequestError) -> RequestError:
    """`err` with its parameter named as this API names it (`tools[0].name`)."""
    param = err.param
    if param is not None:
        param = _PARAMS.get(param, param)
        if param.startswith("tools[") and ".function." in param:
            param = param.replace(".function.", ".", 1)
    message = err.message if err.param is None or param == err.param else \
        err.message.replace(err.param, param or "", 1)
    return RequestError(message, param=param, code=err.code, status=err.status, kind=err.kind)


def to_chat_request(request: ResponsesRequest, history: list[dict[str, Any]]
                    ) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """The chat completion this call is answered as, and its messages without the
    instructions (what a later call chained to this one continues)."""
    conversation = [*history, *input_messages(request.input)]
    messages = ([{"role": "system", "content": request.instructions}]
                if request.instructions else []) + conversation
    body: dict[str, Any] = {
        "model": request.model, "messages": messages,
        "parallel_tool_calls": request.parallel_tool_calls, "seed": request.seed,
        "temperature": request.temperature, "top_p": request.top_p,
        "max_tokens": request.max_output_tokens, "return_token_ids": request.return_token_ids}
    if request.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            exclude={"type"}, exclude_none=True)} for t in request.tools]
    if isinstance(request.tool_choice, ToolChoiceFunction):
        body["tool_choice"] = {"type": "function",
                               "function": {"name": request.tool_choice.name}}
    elif request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    if not messages:
        raise RequestError("input is empty: send the user's message or the tool results",
                           param="input")
    try:
        chat = ChatRequest.model_validate_json(json.dumps(body))
        check_tool_choice(chat)
    except ValidationError as err:
        raise _renamed(request_error(err)) from None
    except RequestError as err:
        raise _renamed(err) from None
    return chat, conversation
