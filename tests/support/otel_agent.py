"""A tiny tool-calling agent instrumented with the real OpenTelemetry SDK, as a team would
write it: an `invoke_agent` root span, a `chat` span per model call and an `execute_tool`
span per tool run, in one of three styles of recording content (the current GenAI
attributes, the older GenAI span events, OpenInference attributes). The model is any
OpenAI-compatible `/v1/chat/completions` (Flywheel's own in the end-to-end test)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, Literal

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

Style = Literal["genai", "events", "openinference"]
TOOLS = [{"type": "function", "function": {
    "name": "math.factorial", "description": "The factorial of a whole number",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}},
                   "required": ["n"]}}},
    {"type": "function", "function": {
        "name": "units:convert", "description": "Convert a length between units",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "number"}, "to": {"type": "string"}},
            "required": ["value", "to"]}}}]


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
    except ValueError:
        return json.dumps({"error": "arguments are not JSON"})
    if name == "math.factorial" and isinstance(args.get("n"), int) and 0 <= args["n"] < 50:
        return json.dumps({"result": math.factorial(args["n"])})
    return json.dumps({"error": f"cannot run {name} with {args}"})


def provider(service: str, processor: Callable[[SpanExporter], SpanProcessor],
             exporter: SpanExporter) -> TracerProvider:
    p = TracerProvider(resource=Resource.create({"service.name": service}))
    p.add_span_processor(processor(exporter))
    return p


def _parts(msg: dict[str, Any]) -> dict[str, Any]:
    """A Chat Completions message → the GenAI `{role, parts}` shape."""
    parts: list[dict[str, Any]] = []
    if msg.get("role") == "tool":
        return {"role": "tool", "parts": [{"type": "tool_call_response",
                                           "id": msg["tool_call_id"], "response": msg["content"]}]}
    if msg.get("content"):
        parts.append({"type": "text", "content": msg["content"]})
    for c in msg.get("tool_calls") or []:
        parts.append({"type": "tool_call", "id": c["id"], "name": c["function"]["name"],
                      "arguments": json.loads(c["function"]["arguments"] or "{}")})
    return {"role": msg["role"], "parts": parts}


def record_chat(span: Span, style: Style, messages: list[dict[str, Any]],
                answer: dict[str, Any], model: str, usage: dict[str, int]) -> None:
    if style == "genai":
        span.set_attribute("gen_ai.operation.name", "chat")
        span.set_attribute("gen_ai.request.model", model)
        span.set_attribute("gen_ai.input.messages", json.dumps([_parts(m) for m in messages]))
        span.set_attribute("gen_ai.output.messages", json.dumps([_parts(answer)]))
        span.set_attribute("gen_ai.tool.definitions", json.dumps(TOOLS))
        span.set_attribute("gen_ai.usage.input_tokens", usage["prompt_tokens"])
        span.set_attribute("gen_ai.usage.output_tokens", usage["completion_tokens"])
    elif style == "events":
        span.set_attribute("gen_ai.operation.name", "chat")
        span.set_attribute("gen_ai.request.model", model)
        span.set_attribute("gen_ai.tool.definitions", json.dumps(TOOLS))
        span.set_attribute("gen_ai.usage.prompt_tokens", usage["prompt_tokens"])  # older names
        span.set_attribute("gen_ai.usage.completion_tokens", usage["completion_tokens"])
        for m in messages:
            body: dict[str, Any] = {"content": m.get("content") or ""}
            if m.get("tool_calls"):
                body["tool_calls"] = json.dumps(m["tool_calls"])
            if m["role"] == "tool":
                body["id"] = m["tool_call_id"]
            span.add_event(f"gen_ai.{m['role']}.message", body)
        span.add_event("gen_ai.choice", {"index": 0, "message": json.dumps(answer)})
    else:
        span.set_attribute("openinference.span.kind", "LLM")
        span.set_attribute("llm.model_name", model)
        for i, t in enumerate(TOOLS):
            span.set_attribute(f"llm.tools.{i}.tool.json_schema", json.dumps(t))
        for direction, msgs in (("input", messages), ("output", [answer])):
            for i, m in enumerate(msgs):
                pre = f"llm.{direction}_messages.{i}.message."
                span.set_attribute(pre + "role", m["role"])
                if m.get("content"):
                    span.set_attribute(pre + "content", m["content"])
                if m.get("tool_call_id"):
                    span.set_attribute(pre + "tool_call_id", m["tool_call_id"])
                for j, c in enumerate(m.get("tool_calls") or []):
                    cp = f"{pre}tool_calls.{j}.tool_call."
                    span.set_attribute(cp + "id", c["id"])
                    span.set_attribute(cp + "function.name", c["function"]["name"])
                    span.set_attribute(cp + "function.arguments", c["function"]["arguments"])
        span.set_attribute("llm.token_count.prompt", usage["prompt_tokens"])
        span.set_attribute("llm.token_count.completion", usage["completion_tokens"])


def converse(tp: TracerProvider, chat: Callable[[dict[str, Any]], dict[str, Any]], *,
             style: Style, conversation: str, question: str, model: str = "production",
             agent: str = "calc-agent") -> dict[str, Any]:
    """One conversation: a model call that must call a tool, the tool run, a model call for
    the answer. `chat(body)` posts a Chat Completions request and returns the response."""
    tracer = tp.get_tracer("calc-agent")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a calculator. Use the tools."},
        {"role": "user", "content": question}]
    root_attrs = ({"openinference.span.kind": "AGENT", "session.id": conversation,
                   "agent.name": agent} if style == "openinference" else
                  {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent,
                   "gen_ai.conversation.id": conversation})
    with tracer.start_as_current_span(f"invoke_agent {agent}", attributes=root_attrs):
        for step, choice in enumerate(("required", "none")):
            body = {"model": model, "messages": messages, "tools": TOOLS,
                    "tool_choice": choice, "temperature": 0, "max_tokens": 40,
                    "parallel_tool_calls": False}
            with tracer.start_as_current_span(f"chat {model}", kind=SpanKind.CLIENT) as span:
                if style != "openinference":
                    span.set_attribute("gen_ai.conversation.id", conversation)
                response = chat(body)
                answer = {k: v for k, v in response["choices"][0]["message"].items()
                          if k in ("role", "content", "tool_calls") and v is not None}
                record_chat(span, style, messages, answer, response["model"], response["usage"])
            messages.append(answer)
            if step == 1:
                break
            for call in answer.get("tool_calls") or []:
                name = call["function"]["name"]
                with tracer.start_as_current_span(f"execute_tool {name}") as tool_span:
                    out = run_tool(name, call["function"]["arguments"])
                    if style == "openinference":
                        tool_span.set_attributes({"openinference.span.kind": "TOOL",
                                                  "tool.name": name, "tool_call.id": call["id"],
                                                  "input.value": call["function"]["arguments"],
                                                  "output.value": out})
                    else:
                        tool_span.set_attributes({
                            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
                            "gen_ai.tool.call.id": call["id"],
                            "gen_ai.tool.call.arguments": call["function"]["arguments"],
                            "gen_ai.tool.call.result": out})
                    if "error" in out:
                        tool_span.set_status(Status(StatusCode.ERROR, out))
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": out})
    return {"messages": messages}
