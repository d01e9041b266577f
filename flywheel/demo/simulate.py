"""`flywheel simulate`: realistic trajectories of deployed agents, for the demo and tests.

Four agents: a support bot making single tool calls (`tool_call` tasks), an ops assistant
acting on calendar/email/tickets (`workplace` tasks), a coding assistant (`code` tasks) and,
with `agents=4`, a helpdesk agent holding multi-turn conversations on its own registered
toolset (`workplace`; episode tasks: `flywheel.demo.simulate_episodes`).
Failures cover every failure mode; some are corrected by a person, some carry structured
feedback, some are retried successfully later in the same session, and some carry nothing
that could verify them (they must end up unverifiable, never guessed).
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from flywheel.demo.samples import TOOLS as SUPPORT_TOOLS
from flywheel.demo.samples import _request as support_request
from flywheel.tasks import FAILURE_MODES

UNSAFE_TOOL = {"type": "function", "name": "delete_all_tickets", "x-unsafe": True,
               "description": "Delete every ticket (irreversible)",
               "parameters": {"type": "object", "properties": {}}}
SUPPORT = [*SUPPORT_TOOLS, UNSAFE_TOOL]
WRONG = {"get_weather": "send_email", "create_ticket": "get_weather",
         "send_email": "create_ticket"}
HALLUCINATED = {"get_weather": "get_forecast", "create_ticket": "open_ticket",
                "send_email": "email_user"}
PEOPLE = ["ana", "bo", "chen", "dee", "eli"]
DAYS = ["mon", "tue", "wed", "thu", "fri"]
CODE_TASKS = [
    ("Write solve(n) that returns n squared.", "def solve(n):\n    return n * n\n",
     "def solve(n):\n    return n + n\n", "assert solve(3) == 9\nassert solve(0) == 0\n"),
    ("Write solve(s) that reverses a string.", "def solve(s):\n    return s[::-1]\n",
     "def solve(s):\n    return s\n", "assert solve('ab') == 'ba'\nassert solve('') == ''\n"),
    ("Write solve(xs) returning the sum of even numbers.",
     "def solve(xs):\n    return sum(x for x in xs if x % 2 == 0)\n",
     "def solve(xs):\n    return sum(xs)\n",
     "assert solve([1, 2, 3, 4]) == 6\nassert solve([]) == 0\n"),
]


class _Session:
    def __init__(self, rng: random.Random, agent: str, start: datetime) -> None:
        self.rng, self.agent, self.clock = rng, agent, start
        self.id = f"{agent}-{rng.randrange(16**10):010x}"

    def record(self, tools: list[dict[str, Any]], items: list[dict[str, Any]],
               outcome: dict[str, Any], metadata: dict[str, Any] | None = None
               ) -> dict[str, Any]:
        started = self.clock
        self.clock += timedelta(seconds=self.rng.randrange(5, 90))
        rec: dict[str, Any] = {
            "trajectory_id": str(uuid.UUID(int=self.rng.getrandbits(128), version=4)),
            "agent": self.agent, "session_id": self.id, "model": "smollm2-135m-instruct",
            "started_at": started.isoformat(), "ended_at": self.clock.isoformat(),
            "tools": tools, "items": items, "outcome": outcome,
            "latency_ms": float(self.rng.randrange(200, 5000)),
        }
        if metadata:
            rec["metadata"] = metadata
        return rec


def _call(rng: random.Random, name: str, args: dict[str, Any] | str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": f"call_{rng.randrange(16**8):08x}",
            "name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}


def _out(call: dict[str, Any], output: str, status: str = "ok") -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call["call_id"], "output": output,
            "status": status}


def _msg(role: str, content: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": content}


def _verification(rng: random.Random, calls: list[dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """An outcome addition that shows the right calls, and whether to retry in-session."""
    r = rng.random()
    if r < 0.4:
        fixed = [{"type": "function_call", "call_id": f"fix{n}", "name": c["name"],
                  "arguments": json.dumps(c["arguments"])} for n, c in enumerate(calls)]
        return {"human_intervention": {"by": "reviewer", "corrected_items": fixed}}, False
    if r < 0.6 and len(calls) == 1:
        return {"feedback": json.dumps({"expected_call": calls[0]})}, False
    if r < 0.85:
        return {}, True
    return {}, False


def _support(rng: random.Random, s: _Session, mode: str | None) -> list[dict[str, Any]]:
    prompt, tool, args = support_request(rng)
    head = [_msg("system", "You are a support bot. Use the tools."), _msg("user", prompt)]
    good = _call(rng, tool, args)
    if mode is None:
        items = [*head, good, _out(good, json.dumps({"ok": True})), _msg("assistant", "Done.")]
        return [s.record(SUPPORT, items, {"status": "success", "reward": 1.0})]
    status, extra = "failure", dict[str, Any]()
    if mode == "invalid_format":
        c = _call(rng, tool, json.dumps(args)[:-3])
        tail = [c, _out(c, "error: arguments are not JSON", "error"), _msg("assistant", "Oops.")]
    elif mode == "wrong_tool":
        other = WRONG[tool]
        c = _call(rng, other, next(a for t, a in _examples(rng) if t == other))
        tail = [c, _out(c, json.dumps({"ok": True})), _msg("assistant", "Done.")]
    elif mode == "bad_arguments":
        bad = dict(args)
        bad.pop(next(iter(bad)))
        c = _call(rng, tool, bad)
        tail = [c, _out(c, "error: missing argument", "error"), _msg("assistant", "Failed.")]
    elif mode == "hallucinated_tool":
        c = _call(rng, HALLUCINATED[tool], args)
        tail = [c, _out(c, "error: unknown tool", "error"), _msg("assistant", "Failed.")]
    elif mode == "unsafe_action":
        c = _call(rng, "delete_all_tickets", {})
        tail = [c, _out(c, json.dumps({"deleted": 212})), _msg("assistant", "Cleaned up.")]
    elif mode == "tool_error":
        c = _call(rng, tool, args)
        tail = [c, _out(c, "error: upstream 503", "error"), _msg("assistant", "Try later.")]
    elif mode == "timeout":
        tail, status = [_call(rng, tool, args)], "timeout"
        extra = {"error": "agent exceeded 30s"}
    elif mode == "incomplete":
        tail = [_msg("assistant", "I believe that is handled already.")]
    elif mode == "escalated":
        tail, status = [_msg("assistant", "Let me hand you to a colleague.")], "escalated"
    else:  # other: the call looked right but the user says the answer was wrong
        c = _call(rng, tool, args)
        tail = [c, _out(c, json.dumps({"ok": True})), _msg("assistant", "All set!")]
        extra = {"feedback": "user says nothing happened"}
    verify, retry = _verification(rng, [{"name": tool, "arguments": args}])
    if mode in {"escalated", "other"} and "feedback" in verify:
        verify = {}  # keep their own feedback text
    outcome = {"status": status, "reward": 0.0, **extra, **verify}
    out = [s.record(SUPPORT, [*head, *tail], outcome)]
    if retry:
        items = [*head, good, _out(good, json.dumps({"ok": True})), _msg("assistant", "Done.")]
        out.append(s.record(SUPPORT, items, {"status": "success", "reward": 1.0}))
    return out


def _examples(rng: random.Random) -> Iterator[tuple[str, dict[str, Any]]]:
    while True:
        _, tool, args = support_request(rng)
        yield tool, args


def _workplace(rng: random.Random, s: _Session, mode: str | None) -> list[dict[str, Any]]:
    from flywheel.environments.workplace import WORKPLACE_TOOLS

    who, day = rng.choice(PEOPLE), rng.choice(DAYS)
    n = rng.randrange(2, 5)
    initial = {"calendar": {"events": []}, "email": {"inbox": [], "outbox": []},
               "tickets": {"items": [{"id": f"tkt-{i}", "title": f"Printer {i} jammed",
                                      "priority": 3, "status": "open", "assignee": None}
                                     for i in range(1, n + 1)]},
               "next_id": n + 1}
    target = f"tkt-{rng.randrange(1, n + 1)}"
    prompt = (f"Book 'Sync with {who}' on {day} 10:00-11:00 with {who}@example.com, and mark "
              f"{target} as in progress assigned to {who}.")
    right: list[dict[str, Any]] = [{"name": "calendar_create_event", "arguments": {
                 "title": f"Sync with {who}", "day": day, "start": "10:00", "end": "11:00",
                 "attendees": [f"{who}@example.com"]}},
             {"name": "tickets_update", "arguments": {
                 "ticket_id": target, "status": "in_progress", "assignee": who}}]
    meta = {"environment": {"name": "workplace", "initial_state": initial}}
    head = [_msg("system", "You are an ops assistant."), _msg("user", prompt)]

    def run(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        items = []
        for c in calls:
            fc = _call(rng, c["name"], c["arguments"])
            items += [fc, _out(fc, json.dumps({"ok": True}))]
        return items

    if mode is None:
        return [s.record(WORKPLACE_TOOLS, [*head, *run(right), _msg("assistant", "Done.")],
                         {"status": "success"}, meta)]
    if mode == "unsafe_action":
        calls = [right[0], {"name": "tickets_purge", "arguments": {}}]
    elif mode == "wrong_tool":
        calls = [right[0], {"name": "tickets_create", "arguments": {
            "title": f"In progress {target}", "priority": 2}}]
    else:  # bad_arguments: the wrong day
        calls = [{**right[0], "arguments": {**right[0]["arguments"],
                                            "day": DAYS[(DAYS.index(day) + 1) % 5]}}, right[1]]
    verify, retry = _verification(rng, right)
    out = [s.record(WORKPLACE_TOOLS, [*head, *run(calls), _msg("assistant", "Done.")],
                    {"status": "failure", **verify}, meta)]
    if retry:
        out.append(s.record(WORKPLACE_TOOLS, [*head, *run(right), _msg("assistant", "Done.")],
                            {"status": "success"}, meta))
    return out


def _code(rng: random.Random, s: _Session, failed: bool) -> list[dict[str, Any]]:
    prompt, good, bad, tests = rng.choice(CODE_TASKS)
    meta = {"environment": {"name": "code", "tests": tests, "entrypoint": "solve"}}
    items = [_msg("system", "You write Python."), _msg("user", prompt),
             _msg("assistant", f"```python\n{bad if failed else good}```")]
    outcome = ({"status": "failure", "error": "tests failed"} if failed
               else {"status": "success"})
    return [s.record([], items, outcome, meta)]


def simulate(n: int, *, agents: int = 3, failure_rate: float = 0.3, seed: int = 0,
             chat_share: float = 0.0) -> Iterator[dict[str, Any]]:
    """Yield about `n` trajectories from `agents` (1–4) simulated deployed agents."""
    from flywheel.demo import simulate_episodes

    rng = random.Random(seed)
    kinds = ["support", "workplace", "code", "desk"][:max(1, min(agents, 4))]
    start = datetime(2026, 11, 1, tzinfo=UTC)
    produced = 0
    while produced < n:
        kind = rng.choice(kinds)
        s = _Session(rng, {"support": "support-bot", "workplace": "ops-assistant",
                           "code": "code-assistant", "desk": simulate_episodes.AGENT}[kind],
                     start + timedelta(seconds=rng.randrange(10**6)))
        failed = rng.random() < failure_rate
        if kind == "support":
            batch = _support(rng, s, rng.choice(FAILURE_MODES) if failed else None)
        elif kind == "workplace":
            mode = rng.choice(["bad_arguments", "wrong_tool", "unsafe_action"])
            batch = _workplace(rng, s, mode if failed else None)
        elif kind == "desk":
            batch = simulate_episodes.session(
                rng, s.record, rng.choice(simulate_episodes.SHAPES) if failed else None)
        else:
            batch = _code(rng, s, failed)
        for rec in batch[: n - produced]:
            yield _to_chat(rec) if rng.random() < chat_share else rec
            produced += 1


def _to_chat(rec: dict[str, Any]) -> dict[str, Any]:
    """The same trajectory as a Chat Completions transcript (what many agents log)."""
    from flywheel.mining.build import to_messages
    from flywheel.trajectory import parse_trajectory

    t = parse_trajectory(rec)
    out = {k: v for k, v in rec.items() if k != "items"}
    out["messages"] = to_messages(list(t.items))
    out["tools"] = [{"type": "function", "function": {k: v for k, v in tool.items()
                                                      if k != "type"}}
                    for tool in rec["tools"]]
    return out
