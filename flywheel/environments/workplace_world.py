"""The workplace world: calendar, email and tickets as JSON state, and its tools as pure functions.

State (JSON-serialisable):

    {"calendar": {"events": [{id, title, day, start, end, attendees}]},
     "email": {"inbox": [...], "outbox": [{to, subject, body}]},
     "tickets": {"items": [{id, title, priority, status, assignee}]},
     "next_id": int}

`apply_call` never mutates its input: it returns a new state and the observation the model
sees. An invalid call returns the unchanged state and an observation starting `error:` that
says how to call the tool correctly. Generated ids come from `next_id` (`evt-3`, `tkt-4`),
so a replay of the same calls gives the same ids. `canonical_state` forgets ids, `next_id`
and list order, so two ways to reach the same world compare equal.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flywheel.environments.matching import fold_ws

State = dict[str, Any]
_DAY = {"type": "string", "pattern": r"^(\d{4}-\d{2}-\d{2}|mon|tue|wed|thu|fri|sat|sun)$",
        "description": "a date YYYY-MM-DD or a weekday mon..sun"}
_TIME = {"type": "string", "pattern": r"^([01]\d|2[0-3]):[0-5]\d$", "description": "HH:MM, 24h"}
_STATUS = ["open", "in_progress", "closed"]


def _tool(name: str, description: str, props: dict[str, Any], required: list[str],
          **extra: Any) -> dict[str, Any]:
    return {"type": "function", "name": name, "description": description, **extra,
            "parameters": {"type": "object", "properties": props, "required": required,
                           "additionalProperties": False}}


WORKPLACE_TOOLS: list[dict[str, Any]] = [
    _tool("calendar_create_event", "Create a calendar event.",
          {"title": {"type": "string"}, "day": _DAY, "start": _TIME, "end": _TIME,
           "attendees": {"type": "array", "items": {"type": "string"}, "uniqueItems": True,
                         "default": []}},
          ["title", "day", "start", "end"]),
    _tool("calendar_delete_event", "Delete a calendar event by id.",
          {"event_id": {"type": "string"}}, ["event_id"]),
    _tool("calendar_list_events", "List calendar events, optionally of one day.",
          {"day": _DAY}, []),
    _tool("email_send", "Send an email.",
          {"to": {"type": "string"}, "subject": {"type": "string"},
           "body": {"type": "string", "default": ""}},
          ["to", "subject"]),
    _tool("email_list_inbox", "List the emails in the inbox.", {}, []),
    _tool("tickets_create", "Create a ticket (priority 1 = highest, 4 = lowest).",
          {"title": {"type": "string"},
           "priority": {"type": "integer", "minimum": 1, "maximum": 4}},
          ["title", "priority"]),
    _tool("tickets_update", "Change a ticket's status, priority or assignee.",
          {"ticket_id": {"type": "string"}, "status": {"type": "string", "enum": _STATUS},
           "priority": {"type": "integer", "minimum": 1, "maximum": 4},
           "assignee": {"type": "string"}},
          ["ticket_id"]),
    _tool("tickets_list", "List tickets, optionally with one status.",
          {"status": {"type": "string", "enum": _STATUS}}, []),
    _tool("tickets_purge", "Delete every ticket. Irreversible.", {}, [], **{"x-unsafe": True}),
]
_SCHEMAS = {t["name"]: t["parameters"] for t in WORKPLACE_TOOLS}


class CallError(ValueError):
    """An invalid call; the message becomes the `error:` observation."""


def _coerce(key: str, value: Any, prop: Mapping[str, Any]) -> Any:
    kind = prop.get("type")
    if kind == "integer":
        if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
            value = int(value)
        elif isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise CallError(f"{key!r} must be an integer, got {value!r}")
        if not prop.get("minimum", value) <= value <= prop.get("maximum", value):
            raise CallError(f"{key!r} must be between {prop['minimum']} and {prop['maximum']}")
    elif kind == "string":
        if not isinstance(value, str):
            raise CallError(f"{key!r} must be a string, got {value!r}")
        value = value.strip()
        if "pattern" in prop and not re.fullmatch(prop["pattern"], value, re.I):
            raise CallError(f"{key!r} must look like {prop.get('description', prop['pattern'])}"
                            f", got {value!r}")
    elif kind == "array":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise CallError(f"{key!r} must be a list of strings, got {value!r}")
        value = [v.strip() for v in value]
    if "enum" in prop and value not in prop["enum"]:
        raise CallError(f"{key!r} must be one of {prop['enum']}, got {value!r}")
    return value


def check_arguments(name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """Arguments validated and coerced against tool `name`'s schema; null means absent."""
    schema = _SCHEMAS[name]
    props: Mapping[str, Any] = schema["properties"]
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        raise CallError(f"{name} takes no argument(s) {unknown}; its arguments are "
                        f"{sorted(props) or 'none'}")
    args = {k: v for k, v in arguments.items() if v is not None}
    missing = [k for k in schema["required"] if k not in args]
    if missing:
        raise CallError(f"{name} needs argument(s) {missing}")
    return {k: _coerce(k, v, props[k]) for k, v in args.items()}


def initial_next_id(state: Mapping[str, Any]) -> int:
    """1 + the largest numeric id suffix in the state: new ids never clash with old ones."""
    found = [int(m.group(1)) for m in re.finditer(r'"[a-z]+-(\d+)"', json.dumps(state))]
    return max(found, default=0) + 1


def normalize_state(state: Mapping[str, Any]) -> State:
    """A deep copy of `state` with every section present (missing ones empty)."""
    new: State = copy.deepcopy(dict(state))
    for section, lists in (("calendar", ("events",)), ("email", ("inbox", "outbox")),
                           ("tickets", ("items",))):
        part = new.setdefault(section, {})
        if not isinstance(part, dict):
            raise ValueError(f"workplace state: {section!r} must be an object")
        for key in lists:
            if not isinstance(part.setdefault(key, []), list):
                raise ValueError(f"workplace state: '{section}.{key}' must be a list")
    given = new.get("next_id")
    floor = initial_next_id({k: v for k, v in new.items() if k != "next_id"})
    # A stale counter would hand out an id that already exists; never go below the floor.
    new["next_id"] = max(given, floor) if isinstance(given, int) else floor
    return new


def _new_id(state: State, prefix: str) -> str:
    ident = f"{prefix}-{state['next_id']}"
    state["next_id"] += 1
    return ident


def _create_event(s: State, a: dict[str, Any]) -> str:
    day = a["day"].lower()
    if day[:1].isdigit():
        try:
            dt.date.fromisoformat(day)
        except ValueError:
            raise CallError(f"'day' {day!r} is not a calendar date") from None
    if a["end"] <= a["start"]:
        raise CallError("'end' must be after 'start'")
    ident = _new_id(s, "evt")
    s["calendar"]["events"].append({"id": ident, "title": a["title"], "day": day,
                                    "start": a["start"], "end": a["end"],
                                    "attendees": a.get("attendees", [])})
    return f"created event {ident}"


def _delete_event(s: State, a: dict[str, Any]) -> str:
    events = s["calendar"]["events"]
    kept = [e for e in events if e.get("id") != a["event_id"]]
    if len(kept) == len(events):
        raise CallError(f"no event {a['event_id']!r}; calendar_list_events shows the ids")
    s["calendar"]["events"] = kept
    return f"deleted event {a['event_id']}"


def _list_events(s: State, a: dict[str, Any]) -> str:
    return json.dumps([e for e in s["calendar"]["events"]
                       if "day" not in a or e.get("day") == a["day"].lower()])


def _send(s: State, a: dict[str, Any]) -> str:
    s["email"]["outbox"].append({"to": a["to"], "subject": a["subject"],
                                 "body": a.get("body", "")})
    return f"sent email to {a['to']}"


def _create_ticket(s: State, a: dict[str, Any]) -> str:
    ident = _new_id(s, "tkt")
    s["tickets"]["items"].append({"id": ident, "title": a["title"], "priority": a["priority"],
                                  "status": "open", "assignee": None})
    return f"created ticket {ident}"


def _update_ticket(s: State, a: dict[str, Any]) -> str:
    changes = {k: v for k, v in a.items() if k != "ticket_id"}
    if not changes:
        raise CallError("tickets_update needs at least one of status, priority, assignee")
    for item in s["tickets"]["items"]:
        if item.get("id") == a["ticket_id"]:
            item.update(changes)
            return f"updated ticket {a['ticket_id']}"
    raise CallError(f"no ticket {a['ticket_id']!r}; tickets_list shows the ids")


def _list_tickets(s: State, a: dict[str, Any]) -> str:
    return json.dumps([t for t in s["tickets"]["items"]
                       if "status" not in a or t.get("status") == a["status"]])


def _purge(s: State, a: dict[str, Any]) -> str:
    count = len(s["tickets"]["items"])
    s["tickets"]["items"] = []
    return f"deleted {count} tickets"


_HANDLERS: dict[str, Callable[[State, dict[str, Any]], str]] = {
    "calendar_create_event": _create_event, "calendar_delete_event": _delete_event,
    "calendar_list_events": _list_events, "email_send": _send,
    "email_list_inbox": lambda s, a: json.dumps(s["email"]["inbox"]),
    "tickets_create": _create_ticket, "tickets_update": _update_ticket,
    "tickets_list": _list_tickets, "tickets_purge": _purge,
}


def apply_call(state: Mapping[str, Any], name: str,
               arguments: Mapping[str, Any] | str | None) -> tuple[State, str]:
    """(new state, observation) after one call; invalid calls leave the state unchanged."""
    new = normalize_state(state)
    if name not in _HANDLERS:
        return new, f"error: unknown tool {name!r}; the tools are {sorted(_HANDLERS)}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return new, f"error: arguments are not valid JSON: {exc}"
    if not isinstance(arguments, Mapping | None):
        return new, "error: arguments must be a JSON object"
    try:
        args = check_arguments(name, arguments or {})
        return new, _HANDLERS[name](new, args)
    except CallError as exc:
        return normalize_state(state), f"error: {exc}"


def apply_calls(state: Mapping[str, Any], calls: Iterable[Mapping[str, Any]], *,
                strict: bool = False) -> State:
    """The state after replaying `calls` (`{"name", "arguments"}` each) on `state`.

    `strict=True` raises on the first invalid call instead of skipping it, for callers that
    must not build on a call that did nothing (an expected state from a bad correction).
    """
    current = normalize_state(state)
    for n, call in enumerate(calls):
        current, observation = apply_call(current, str(call.get("name")), call.get("arguments"))
        if strict and observation.startswith("error:"):
            raise ValueError(f"call #{n + 1} ({call.get('name')}) is invalid: {observation}")
    return current


def _canon(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _canon(v) for k, v in value.items() if k != "id" and v is not None}
    if isinstance(value, list):
        return sorted((_canon(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, str):
        return fold_ws(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def canonical_state(state: Mapping[str, Any]) -> State:
    """`state` without ids, `next_id` and null fields, strings whitespace-folded, lists sorted.

    All lists in this world are sets (events, emails, tickets, attendees), so order carries
    no meaning; ids are generated, so they depend on the path, not on the world.
    """
    canon: State = _canon({k: v for k, v in normalize_state(state).items() if k != "next_id"})
    return canon
