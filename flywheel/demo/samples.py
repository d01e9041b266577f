"""Sample agent trajectories (both wire formats) and deliberately bad payloads.

Used by `make demo`, the ingest benchmark and the tests. Deterministic for a given seed.
The full agent simulator with every failure mode builds on this (`flywheel simulate`).
"""

from __future__ import annotations

import json
import random
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "get_weather", "description": "Current weather for a city",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
         "required": ["city"]}},
    {"type": "function", "name": "create_ticket", "description": "Open a support ticket",
     "parameters": {"type": "object", "properties": {
         "title": {"type": "string"}, "priority": {"type": "integer", "minimum": 1,
                                                   "maximum": 4}},
         "required": ["title", "priority"]}},
    {"type": "function", "name": "send_email", "description": "Send an email",
     "parameters": {"type": "object", "properties": {
         "to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
         "required": ["to", "subject"]}},
]
CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Pune", "Quito", "Austin", "Cairo",
          "Dublin", "Hanoi", "Kyiv", "Lisbon", "Nairobi", "Perth", "Seoul", "Tunis", "Vienna",
          "Accra", "Bogota", "Denver", "Havana", "Riga", "Zurich"]
UNITS = {"c": "Celsius", "f": "Fahrenheit"}
RECIPIENTS = ["ana", "bo", "chen", "dee", "eli", "femi", "gus", "hana"]
MESSAGES = [("Release moved", "It is Friday now."),
            ("Office closed", "The office is closed on Monday."),
            ("Demo at 3pm", "The demo starts at 3pm in room 2."),
            ("Laptop ready", "Your new laptop is at the front desk.")]
AGENTS = ["support-bot", "ops-assistant", "travel-helper"]


def _request(rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    kind = rng.randrange(3)
    # Every expected argument is stated in the request: a task whose right answer the prompt
    # does not determine (a random priority, an unstated unit) is one no policy can learn.
    # Each tool's requests vary as much as the others' (a tool with a handful of distinct
    # requests dedupes to a handful of tasks and demonstrations, and a policy trained on
    # that mix learns one tool for everything).
    if kind == 0:
        city, unit = rng.choice(CITIES), rng.choice(sorted(UNITS))
        return (f"What's the weather in {city}, in {UNITS[unit]}?", "get_weather",
                {"city": city, "unit": unit})
    if kind == 1:
        n, priority = rng.randrange(1000, 9999), rng.randint(1, 4)
        return (f"Printer {n} on floor 3 is jammed again, please open a ticket "
                f"titled 'Printer {n} jammed' with priority {priority}.",
                "create_ticket", {"title": f"Printer {n} jammed", "priority": priority})
    who, (subject, body) = rng.choice(RECIPIENTS), rng.choice(MESSAGES)
    return (f"Email {who}@example.com with the subject '{subject}' and the text '{body}'",
            "send_email", {"to": f"{who}@example.com", "subject": subject, "body": body})


def make_trajectory(rng: random.Random, *, failure_rate: float = 0.3,
                    chat_format: bool = False, with_id: bool = True) -> dict[str, Any]:
    """One realistic single-task tool-using trajectory as a JSON-ready dict."""
    prompt, tool, args = _request(rng)
    failed = rng.random() < failure_rate
    call_args = dict(args)
    if failed:
        call_args.pop(next(iter(call_args)))  # a missing required argument
    start = datetime(2026, 11, 1, tzinfo=UTC) + timedelta(seconds=rng.randrange(10**7))
    call_id = f"call_{rng.randrange(16**8):08x}"
    output = ("error: missing required argument" if failed else json.dumps({"ok": True}))
    outcome: dict[str, Any] = {"status": "failure" if failed else "success",
                               "reward": 0.0 if failed else 1.0}
    if failed:
        outcome["error"] = "tool rejected the call"
    base: dict[str, Any] = {
        "agent": rng.choice(AGENTS),
        "session_id": f"s-{rng.randrange(10**6)}",
        "model": "smollm2-135m-instruct",
        "started_at": start.isoformat(),
        "ended_at": (start + timedelta(milliseconds=rng.randrange(300, 4000))).isoformat(),
        "tools": TOOLS,
        "outcome": outcome,
        "usage": {"input_tokens": rng.randrange(200, 900), "output_tokens": rng.randrange(20, 90)},
    }
    if with_id:
        base["trajectory_id"] = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    system = "You are a helpful assistant. Use the tools when needed."
    if chat_format:
        base["messages"] = [
            {"role": "system", "content": system},
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": tool, "arguments": json.dumps(call_args)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": output},
            {"role": "assistant", "content": "Done." if not failed else "Sorry, that failed."},
        ]
    else:
        base["items"] = [
            {"type": "message", "role": "system", "content": system},
            {"type": "message", "role": "user", "content": prompt},
            {"type": "function_call", "call_id": call_id, "name": tool,
             "arguments": json.dumps(call_args)},
            {"type": "function_call_output", "call_id": call_id, "output": output,
             "status": "error" if failed else "ok"},
            {"type": "message", "role": "assistant",
             "content": "Done." if not failed else "Sorry, that failed."},
        ]
    return base


def bad_payloads(rng: random.Random, n: int, *, max_bytes: int = 1_048_576) -> list[bytes]:
    """`n` payloads that ingest must dead-letter: not JSON, schema violations, oversized,
    and JSON that Postgres cannot store (a NUL character, NaN)."""
    out: list[bytes] = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            out.append(b"{not json" + str(rng.random()).encode())
        elif kind == 1:
            t = make_trajectory(rng)
            t["outcome"] = {"status": "exploded"}
            out.append(json.dumps(t).encode())
        elif kind == 2:
            t = make_trajectory(rng)
            t["agent"] = ""  # an agent may be left out (then derived), never empty
            out.append(json.dumps(t).encode())
        elif kind == 3:
            t = make_trajectory(rng)
            t["metadata"] = {"blob": "x" * (max_bytes + 1)}
            out.append(json.dumps(t).encode())
        elif kind == 4:
            t = make_trajectory(rng)
            t["items"][1]["content"] += "\u0000"
            out.append(json.dumps(t).encode())
        else:
            t = make_trajectory(rng)
            t["outcome"]["reward"] = float("nan")
            out.append(json.dumps(t).encode())  # json.dumps writes a bare NaN
    return out
