"""Multi-step sessions of an agent working on its own tools: the bundled `workplace` toolset
(`flywheel.environments.workplace_tools`, served over MCP or as a Python class and
registered as `workplace`), for `flywheel simulate --agents 4` and the episode tests.

A session is one conversation of two or three user requests (book a meeting, find a ticket
by its title and assign it, close one, open one, email someone, read a day's agenda). Every
tool result is what the world answers to the call, run on the state the agent logged in
`metadata.environment.initial_state` (90% of sessions log it; the others cannot be verified
as episodes without a toolset that goes live off the logged path, and must be counted so).
`metadata.toolset` names the toolset.

Failed sessions take the shapes agents fail in over several turns, in one turn of the
conversation (the others done right):

* `wrong_step`: a right tool with a wrong argument (another ticket, the next day, the wrong
  recipient or priority);
* `wrong_tool`: another tool than the request needs (a new ticket instead of an update);
* `loop`: the same lookup repeated until the agent's step limit, no answer (a timeout);
* `unsafe_midway`: the destructive `tickets_purge` half way through the work;
* `stops_early`: an answer that says the work is done without a call;
* `wrong_answer`: the right lookup, then an answer that misreads it (the last turn).

What shows the right behaviour, as for single steps (`flywheel.demo.simulate`): a reviewer's
correction of the whole conversation's calls, structured feedback (the conversation's expected
calls, or the content a right final answer holds), a successful retry later in
the same session, or nothing (unverifiable: counted with its reason, never guessed).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flywheel.environments.workplace_world import (
    WORKPLACE_TOOLS,
    State,
    apply_call,
    canonical_state,
)

TOOLSET = "workplace"
AGENT = "desk-agent"
SHAPES = ("wrong_step", "wrong_tool", "loop", "unsafe_midway", "stops_early", "wrong_answer")
PEOPLE = ["ana", "bo", "chen", "dee", "eli", "fay"]
DAYS = ["mon", "tue", "wed", "thu", "fri"]
THINGS = ["printer", "vpn", "laptop", "badge reader", "projector", "wifi", "mailbox"]
LOOP_STEPS = 6
Call = dict[str, Any]
Record = Callable[[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any],
                   dict[str, Any]], dict[str, Any]]


@dataclass
class _Request:
    text: str
    calls: list[Call]
    answer: str
    kind: str
    must_say: list[str] = field(default_factory=list)


def _initial(rng: random.Random) -> State:
    things = rng.sample(THINGS, rng.randrange(2, 5))
    tickets = [{"id": f"tkt-{n}", "title": f"{thing} broken", "priority": rng.randrange(1, 5),
                "status": rng.choice(["open", "open", "in_progress"]), "assignee": None}
               for n, thing in enumerate(things, start=1)]
    events = []
    for n in range(rng.randrange(0, 4)):
        day = rng.choice(DAYS[:3])
        events.append({"id": f"evt-{len(tickets) + n + 1}", "title": f"Standup {n + 1}",
                       "day": day, "start": f"{9 + n:02d}:00", "end": f"{9 + n:02d}:30",
                       "attendees": []})
    return {"calendar": {"events": events}, "email": {"inbox": [], "outbox": []},
            "tickets": {"items": tickets}, "next_id": len(tickets) + len(events) + 1}


def _request(rng: random.Random, state: State, kind: str, touched: set[str]) -> _Request:
    who = rng.choice(PEOPLE)
    # One request a ticket: a later change to it would hide whether an earlier one was made.
    tickets = [t for t in state["tickets"]["items"] if t["id"] not in touched]
    ticket = rng.choice(tickets) if tickets else None
    if kind == "book" or (ticket is None and kind in {"assign", "close", "find_assign"}):
        day = rng.choice(DAYS)
        args = {"title": f"Sync with {who}", "day": day, "start": "14:00", "end": "14:30",
                "attendees": [f"{who}@example.com"]}
        return _Request(f"Book 'Sync with {who}' on {day} 14:00-14:30 with "
                        f"{who}@example.com.", [{"name": "calendar_create_event",
                                                 "arguments": args}],
                        f"Booked the sync with {who} on {day}.", "book")
    if kind == "assign":
        assert ticket is not None
        return _Request(f"Mark {ticket['id']} as in progress and assign it to {who}.",
                        [{"name": "tickets_update", "arguments": {
                            "ticket_id": ticket["id"], "status": "in_progress",
                            "assignee": who}}],
                        f"{ticket['id']} is in progress with {who}.", "assign")
    if kind == "find_assign":
        assert ticket is not None
        return _Request(f"The {ticket['title']} ticket: give it to {who} and mark it in "
                        f"progress.",
                        [{"name": "tickets_list", "arguments": {}},
                         {"name": "tickets_update", "arguments": {
                             "ticket_id": ticket["id"], "status": "in_progress",
                             "assignee": who}}],
                        f"{ticket['id']} ({ticket['title']}) is with {who} now.", "find_assign")
    if kind == "close":
        assert ticket is not None
        return _Request(f"{ticket['id']} is fixed, please close it.",
                        [{"name": "tickets_update", "arguments": {
                            "ticket_id": ticket["id"], "status": "closed"}}],
                        f"Closed {ticket['id']}.", "close")
    if kind == "file":
        thing, priority = rng.choice(THINGS), rng.randrange(1, 5)
        return _Request(f"Open a P{priority} ticket: {thing} is down.",
                        [{"name": "tickets_create", "arguments": {
                            "title": f"{thing} is down", "priority": priority}}],
                        f"Opened a P{priority} ticket for the {thing}.", "file")
    if kind == "email":
        subject = f"{ticket['id']} update" if ticket else "Status"
        return _Request(f"Email {who}@example.com with the subject '{subject}' saying we are "
                        f"on it.",
                        [{"name": "email_send", "arguments": {
                            "to": f"{who}@example.com", "subject": subject,
                            "body": "We are on it."}}],
                        f"Emailed {who}.", "email")
    day = rng.choice(DAYS[:3])
    events = [e for e in state["calendar"]["events"] if e["day"] == day]
    count = f"{len(events)} event" + ("" if len(events) == 1 else "s")
    titles = ", ".join(sorted(e["title"] for e in events))
    return _Request(f"How many meetings do I have on {day}?",
                    [{"name": "calendar_list_events", "arguments": {"day": day}}],
                    f"You have {count} on {day}" + (f": {titles}." if titles else "."),
                    "agenda", must_say=[count])


def _wrong_step(rng: random.Random, state: State, req: _Request) -> list[Call]:
    """The request's calls with one argument wrong, as the world still accepts it."""
    calls = [dict(c, arguments=dict(c["arguments"])) for c in req.calls]
    last = calls[-1]["arguments"]
    if "ticket_id" in last:
        others = [t["id"] for t in state["tickets"]["items"] if t["id"] != last["ticket_id"]]
        if others:
            last["ticket_id"] = rng.choice(others)
        else:
            last["status"] = "closed" if last.get("status") != "closed" else "open"
    elif "day" in last:
        last["day"] = DAYS[(DAYS.index(last["day"]) + 1) % len(DAYS)]
    elif "to" in last:
        last["to"] = f"{rng.choice([p for p in PEOPLE if p + '@' not in last['to']])}" \
                     "@example.com"
    else:  # tickets_create
        last["priority"] = last["priority"] % 4 + 1
    return calls


def _wrong_tool(req: _Request) -> list[Call]:
    last = req.calls[-1]
    name, args = last["name"], last["arguments"]
    if name == "tickets_update":
        other = {"name": "tickets_create", "arguments": {
            "title": f"{args['ticket_id']} {args.get('status', 'update')}", "priority": 2}}
    elif name == "calendar_create_event":
        other = {"name": "email_send", "arguments": {
            "to": args["attendees"][0], "subject": args["title"],
            "body": f"{args['day']} {args['start']}-{args['end']}"}}
    elif name == "email_send":
        other = {"name": "tickets_create", "arguments": {"title": args["subject"],
                                                          "priority": 3}}
    elif name == "tickets_create":
        other = {"name": "email_send", "arguments": {"to": "helpdesk@example.com",
                                                     "subject": args["title"]}}
    else:  # calendar_list_events
        other = {"name": "email_list_inbox", "arguments": {}}
    return [*req.calls[:-1], other]


class _Conversation:
    """Items of one logged conversation, each call run on the world for its result."""

    def __init__(self, rng: random.Random, state: State) -> None:
        self.rng, self.state = rng, state
        self.items: list[dict[str, Any]] = [
            {"type": "message", "role": "system",
             "content": "You are the helpdesk's assistant. Use the tools; never purge tickets."}]

    def say(self, role: str, text: str) -> None:
        self.items.append({"type": "message", "role": role, "content": text})

    def call(self, call: Call) -> None:
        call_id = f"call_{self.rng.randrange(16**8):08x}"
        self.state, output = apply_call(self.state, call["name"], call["arguments"])
        self.items += [{"type": "function_call", "call_id": call_id, "name": call["name"],
                        "arguments": json.dumps(call["arguments"])},
                       {"type": "function_call_output", "call_id": call_id, "output": output,
                        "status": "error" if output.startswith("error:") else "ok"}]

    def turn(self, req: _Request, calls: list[Call] | None = None,
             answer: str | None = None) -> None:
        self.say("user", req.text)
        for c in req.calls if calls is None else calls:
            self.call(c)
        self.say("assistant", req.answer if answer is None else answer)


def _plan(rng: random.Random, state: State, shape: str | None) -> list[_Request]:
    """Two or three requests, made on the state each earlier request left."""
    kinds = ["book", "assign", "find_assign", "close", "file", "email", "agenda"]
    n = rng.randrange(2, 4)
    plan: list[_Request] = []
    current, touched = state, set[str]()
    for k in range(n):
        kind = rng.choice(kinds)
        if shape == "wrong_answer" and k == n - 1:
            kind = "agenda"
        elif shape == "loop" and k == n - 1 and kind == "agenda":
            kind = "find_assign"
        if (shape not in {None, "wrong_answer", "loop"} and k == n - 1
                and all(r.kind == "agenda" for r in plan)):
            kind = "file"  # a turn that changes the world, for the failure to be seen in
        req, after = _acted(rng, current, kind, touched)
        while req.kind != "agenda" and canonical_state(after) == canonical_state(current):
            # Nobody asks for what is already so (a ticket already in progress with them).
            req, after = _acted(rng, current, "file", touched)
        touched |= {c["arguments"]["ticket_id"] for c in req.calls
                    if "ticket_id" in c["arguments"]}
        plan.append(req)
        current = after
    return plan


def _acted(rng: random.Random, state: State, kind: str, touched: set[str]
           ) -> tuple[_Request, State]:
    req = _request(rng, state, kind, touched)
    for c in req.calls:
        state, _ = apply_call(state, c["name"], c["arguments"])
    return req, state


@dataclass
class Planned:
    """A session before it is logged: the world, the requests, how (and where) it fails."""
    initial: State
    requests: list[_Request]
    metadata: dict[str, Any]
    shape: str | None
    failed_at: int | None

    def right_conversation(self, rng: random.Random) -> list[dict[str, Any]]:
        """The items of the conversation done right (every request's calls, its answer)."""
        right = _Conversation(rng, self.initial)
        for req in self.requests:
            right.turn(req)
        return right.items


def plan_session(rng: random.Random, shape: str | None) -> Planned:
    initial = _initial(rng)
    plan = _plan(rng, initial, shape)
    meta: dict[str, Any] = {"toolset": TOOLSET}
    if rng.random() < 0.9:
        meta["environment"] = {"initial_state": initial}
    # A wrong lookup leaves the world as it was, so only turns that change it fail here
    # (a misread lookup is `wrong_answer`, seen by the feedback on the final answer).
    acting = [k for k, r in enumerate(plan) if r.kind != "agenda"]
    failed_at = None if shape is None else (
        len(plan) - 1 if shape in {"wrong_answer", "loop"} else rng.choice(acting))
    return Planned(initial, plan, meta, shape, failed_at)


def session(rng: random.Random, record: Record, shape: str | None,
            planned: Planned | None = None) -> list[dict[str, Any]]:
    """One session's trajectories (via `record(tools, items, outcome, metadata)`): the
    conversation, and when it fails and a retry follows, the successful retry."""
    p = planned or plan_session(rng, shape)
    if p.shape is None or p.failed_at is None:
        return [record(WORKPLACE_TOOLS, p.right_conversation(rng), {"status": "success"},
                       p.metadata)]
    shape, failed_at = p.shape, p.failed_at
    log = _Conversation(rng, p.initial)
    status, extra = "failure", dict[str, Any]()
    for k, req in enumerate(p.requests):
        if k < failed_at:
            log.turn(req)
            continue
        if k > failed_at:
            if shape == "loop":
                break
            log.turn(req)
            continue
        if shape == "wrong_step":
            log.turn(req, _wrong_step(rng, log.state, req), req.answer)
        elif shape == "wrong_tool":
            log.turn(req, _wrong_tool(req), req.answer)
        elif shape == "unsafe_midway":
            purge = {"name": "tickets_purge", "arguments": {}}
            log.turn(req, [*req.calls[:-1], purge, req.calls[-1]], "Done (cleared old tickets).")
        elif shape == "stops_early":
            log.turn(req, [], "Done, that is taken care of.")
        elif shape == "loop":
            log.say("user", req.text)
            lookup = {"name": "tickets_list", "arguments": {}}
            for _ in range(LOOP_STEPS):
                log.call(lookup)
            status, extra = "timeout", {"error": f"agent stopped at its {LOOP_STEPS}-step limit"}
        else:  # wrong_answer: the right lookup, a misread answer
            wrong = "You have no meetings then." if req.must_say[0] != "0 events" else \
                "You have 2 events then."
            log.turn(req, None, wrong)
    outcome = {"status": status, "reward": 0.0, **extra}
    verify, retry = _verification(rng, p.requests, failed_at, shape)
    out = [record(WORKPLACE_TOOLS, log.items, {**outcome, **verify}, p.metadata)]
    if retry:
        out.append(record(WORKPLACE_TOOLS, p.right_conversation(rng), {"status": "success"},
                          p.metadata))
    return out


def _verification(rng: random.Random, plan: list[_Request], failed_at: int, shape: str
                  ) -> tuple[dict[str, Any], bool]:
    """What shows the right behaviour (module doc), and whether a successful retry follows."""
    r = rng.random()
    if shape == "wrong_answer":
        if r < 0.6:
            return {"feedback": json.dumps({"final_answer_contains": plan[-1].must_say})}, False
        return ({}, True) if r < 0.8 else ({}, False)
    if r < 0.45:
        corrected: list[dict[str, Any]] = []
        for n, req in enumerate(plan):
            corrected += [{"type": "function_call", "call_id": f"fix{n}-{m}", "name": c["name"],
                           "arguments": json.dumps(c["arguments"])}
                          for m, c in enumerate(req.calls)]
            corrected.append({"type": "message", "role": "assistant", "content": req.answer})
        return {"human_intervention": {"by": "reviewer", "corrected_items": corrected}}, False
    if r < 0.6:
        path = [c for req in plan for c in req.calls]
        return {"feedback": json.dumps({"expected_calls": path})}, False
    if r < 0.85:
        return {}, True
    return {}, False
