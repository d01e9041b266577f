"""The Chat Completions request, as agents send it with the OpenAI client.

`parse_request(body)` validates the raw body bytes into a `ChatRequest` or raises a
`RequestError` that names the offending parameter the way OpenAI does (`messages[0].content`).
The body is parsed by pydantic's own JSON parser (`model_validate_json`), never by
`json.loads`: its recursion limit turns a 100 000-deep `[[[…]]]` into a 400, where the
standard library would raise `RecursionError` (a 500). Types are strict, as OpenAI's are:
`"max_tokens": "5"` is refused, not coerced. Fields this server does not know are ignored.

`ChatRequest.template_messages()` and `.template_tools()` give the conversation in the shape
the policy's chat format renders (`flywheel.policy.chat_format`): system/developer → system,
text parts joined by a newline (as vLLM joins them), tool results as `tool` messages with
their `tool_call_id`, the deprecated `function` role as a tool result.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from flywheel.trajectory import TOOL_NAME_PATTERN

MAX_N = 16
"""Most choices one request may ask for (each is a full generation on the serving engine)."""
MAX_STOP = 4
"""Most stop sequences, as OpenAI allows."""
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class RequestError(ValueError):
    """A request this server refuses; rendered as an OpenAI error body."""

    def __init__(self, message: str, *, param: str | None = None,
                 code: str = "invalid_value", status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (
            message, param, code, status, kind)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class ContentPart(_Model):
    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise ValueError(f"content parts of type {kind!r} are not supported: the served "
                             "model reads text only; send a string or text parts")
        return kind

    @field_validator("text")
    @classmethod
    def _has_text(cls, text: str | None) -> str:
        if text is None:
            raise ValueError("a text part needs its `text`")
        return text


Content = str | list[ContentPart]


class FunctionCall(_Model):
    name: str
    arguments: str | dict[str, Any] = "{}"
    """A JSON string, as OpenAI sends it (an object is accepted too)."""


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Model):
    role: Literal["system"]
    content: Content
    name: str | None = None


class DeveloperMessage(_Model):
    role: Literal["developer"]
    content: Content
    name: str | None = None


class UserMessage(_Model):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Model):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None


class ToolMessage(_Model):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


class FunctionMessage(_Model):
    role: Literal["function"]
    name: str
    content: str | None = None


Message = Annotated[SystemMessage | DeveloperMessage | UserMessage | AssistantMessage
                    | ToolMessage | FunctionMessage, Field(discriminator="role")]


class FunctionDef(_Model):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(_Model):
    include_usage: bool = False


class ChatRequest(_Model):
    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    """Default: `auto` with tools, `none` without (OpenAI's defaults)."""
    parallel_tool_calls: bool = True
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    """0 = greedy decoding; default 1, as OpenAI's."""
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    """vLLM's extension: `prompt_token_ids` and each choice's `token_ids` in the answer."""
    # Known OpenAI parameters the engines do not implement: refused when they would change
    # the answer, rather than silently ignored.
    logprobs: bool | None = None
    top_logprobs: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return tuple(s for s in stops if s)

    def choice(self) -> str:
        """`none`, `auto`, `required`, or `function:<name>`."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return f"function:{self.tool_choice.function.name}"
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        tools = [{"type": "function", "function": t.function.model_dump(exclude_none=True)}
                 for t in self.tools or ()]
        return tools or None

    def template_messages(self) -> list[dict[str, Any]]:
        return [_template_message(m) for m in self.messages]


def _text(content: Content | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "\n".join(p.text or "" for p in content)


def _template_message(m: Message) -> dict[str, Any]:
    if isinstance(m, SystemMessage | DeveloperMessage):
        return {"role": "system", "content": _text(m.content)}
    if isinstance(m, UserMessage):
        return {"role": "user", "content": _text(m.content)}
    if isinstance(m, ToolMessage):
        return {"role": "tool", "tool_call_id": m.tool_call_id, "content": _text(m.content)}
    if isinstance(m, FunctionMessage):
        return {"role": "tool", "name": m.name, "content": m.content or ""}
    out: dict[str, Any] = {"role": "assistant", "content": _text(m.content)}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": c.function.arguments}} for c in m.tool_calls]
    return out


def parse_request(body: bytes) -> ChatRequest:
    """The validated request; `RequestError` (400) saying what is wrong and where."""
    if not body.strip():
        raise RequestError("the request body is empty: send a JSON chat completion request "
                           '({"model": "production", "messages": [...]})', code="invalid_json")
    try:
        request = ChatRequest.model_validate_json(body)
    except ValidationError as err:
        raise request_error(err) from None
    check_tool_choice(request)
    check_supported(request)
    if len(request.stops()) > MAX_STOP:
        raise RequestError(f"at most {MAX_STOP} stop sequences are allowed",
                           param="stop")
    return request


def check_tool_choice(request: ChatRequest) -> None:
    choice, names = request.choice(), [t.function.name for t in request.tools or ()]
    if choice in ("required",) or choice.startswith("function:"):
        if not names:
            raise RequestError(f"tool_choice {choice.split(':')[0]!r} needs `tools`: offer "
                               "the functions the model must call", param="tool_choice")
    if choice.startswith("function:") and choice[len("function:"):] not in names:
        raise RequestError(f"tool_choice names the function {choice[len('function:'):]!r}, "
                           f"which is not among the tools offered ({names})",
                           param="tool_choice.function.name")


def check_supported(request: ChatRequest) -> None:
    unsupported = {
        "logprobs": request.logprobs is True, "top_logprobs": bool(request.top_logprobs),
        "frequency_penalty": bool(request.frequency_penalty),
        "presence_penalty": bool(request.presence_penalty),
        "logit_bias": bool(request.logit_bias),
        "response_format": request.response_format is not None
        and request.response_format.get("type", "text") != "text"}
    for param, used in unsupported.items():
        if used:
            raise RequestError(f"{param} is not supported by this server (it would change the "
                               "answer, so it is refused rather than ignored); leave it out",
                               param=param, code="unsupported_parameter")


_FIELDS = frozenset(name for model in (
    ContentPart, FunctionCall, ToolCall, SystemMessage, DeveloperMessage, UserMessage,
    AssistantMessage, ToolMessage, FunctionMessage, FunctionDef, Tool, FunctionName,
    NamedToolChoice, StreamOptions, ChatRequest) for name in model.model_fields)


def param_path(loc: tuple[int | str, ...]) -> str | None:
    """A pydantic error location as OpenAI names a parameter (`messages[0].content`),
    without pydantic's union-member labels (`'user'`, `'str'`, `'list[ContentPart]'`)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELDS and not (part in ROLES and i >= 2 and loc[i - 2] == "messages"):
            out += f".{part}" if out else part
    return out or None


_CODES = {"missing": "missing_required_parameter", "json_invalid": "invalid_json",
          "model_type": "invalid_type", "dict_type": "invalid_type",
          "union_tag_invalid": "invalid_value", "union_tag_not_found": "missing_required_parameter"}


def request_error(err: ValidationError) -> RequestError:
    """The deepest problem of `err` (of a union, the alternative that got furthest is the
    one the client meant); alternatives failing at the same place are joined by "or"."""
    errors = err.errors(include_url=False)
    first = max(errors, key=lambda e: len(param_path(tuple(e["loc"])) or ""))
    param = param_path(tuple(first["loc"]))
    same = [e["msg"] for e in errors if param_path(tuple(e["loc"])) == param]
    msg = " or ".join(dict.fromkeys(same))
    kind = str(first["type"])
    code = _CODES.get(kind, "invalid_type" if kind.endswith("_type") else "invalid_value")
    if kind == "json_invalid":
        why = msg.removeprefix("Invalid JSON: ")
        return RequestError(f"the request body is not valid JSON ({why})", code=code)
    if kind == "model_type" and param is None:
        return RequestError("the request body must be a JSON object (a chat completion request)",
                            code=code)
    if "input" in first and kind != "missing" and not isinstance(first["input"], dict | list):
        msg += f" (got {first['input']!r:.60})"
    return RequestError(f"{param}: {msg}" if param else msg, param=param, code=code)
