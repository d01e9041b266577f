"""workplace: pure world transitions, state-matching verifier, isolated sessions."""

from __future__ import annotations

import json
from typing import Any

import pytest

from flywheel.environments.workplace import (
    WORKPLACE_TOOLS,
    WorkplaceEnvironment,
    apply_call,
    apply_calls,
    canonical_state,
    verify_workplace,
)
from flywheel.tasks import WorkplaceSpec

INITIAL: dict[str, Any] = {
    "calendar": {"events": [{"id": "evt-1", "title": "Standup", "day": "2025-03-03",
                             "start": "09:00", "end": "09:15", "attendees": ["ana", "bo"]}]},
    "email": {"inbox": [{"from": "cto@x.io", "subject": "Outage", "body": "Please file it"}],
              "outbox": []},
    "tickets": {"items": [{"id": "tkt-2", "title": "Login bug", "priority": 3,
                           "status": "open", "assignee": None}]},
    "next_id": 3,
}


def c(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


OUTAGE = c("tickets_create", title="Outage", priority=1)
REVIEW = c("calendar_create_event", title="Review", day="2025-03-04", start="14:00",
           end="15:00", attendees=["cto@x.io"])
REPLY = c("email_send", to="cto@x.io", subject="Re: Outage", body="Filed.")


def task(*calls: dict[str, Any], max_steps: int = 8) -> WorkplaceSpec:
    return WorkplaceSpec(initial_state=INITIAL, expected_state=apply_calls(INITIAL, calls),
                         max_steps=max_steps)


def test_tools_are_flat_function_schemas_with_unsafe_purge() -> None:
    names = [t["name"] for t in WORKPLACE_TOOLS]
    assert names == ["calendar_create_event", "calendar_delete_event", "calendar_list_events",
                     "email_send", "email_list_inbox", "tickets_create", "tickets_update",
                     "tickets_list", "tickets_purge"]
    assert all(t["type"] == "function" and t["parameters"]["type"] == "object"
               for t in WORKPLACE_TOOLS)
    assert [t["name"] for t in WORKPLACE_TOOLS if t.get("x-unsafe")] == ["tickets_purge"]


def test_apply_call_is_pure_and_ids_come_from_next_id() -> None:
    before = json.dumps(INITIAL, sort_keys=True)
    state, observation = apply_call(INITIAL, "tickets_create", {"title": "Outage",
                                                                 "priority": "1"})
    assert observation == "created ticket tkt-3"
    assert state["tickets"]["items"][-1] == {"id": "tkt-3", "title": "Outage", "priority": 1,
                                             "status": "open", "assignee": None}
    assert state["next_id"] == 4
    assert json.dumps(INITIAL, sort_keys=True) == before
    state, observation = apply_call(state, "calendar_create_event", REVIEW["arguments"])
    assert observation == "created event evt-4"


@pytest.mark.parametrize("name, arguments, error", [
    ("tickets_create", {"title": "x", "priority": 9}, "between 1 and 4"),
    ("tickets_create", {"title": "x"}, "needs argument(s) ['priority']"),
    ("tickets_update", {"ticket_id": "tkt-99", "status": "closed"}, "no ticket 'tkt-99'"),
    ("tickets_update", {"ticket_id": "tkt-2", "status": "done"}, "must be one of"),
    ("tickets_update", {"ticket_id": "tkt-2"}, "at least one of"),
    ("calendar_create_event", {"title": "x", "day": "2025-02-30", "start": "10:00",
                               "end": "11:00"}, "not a calendar date"),
    ("calendar_create_event", {"title": "x", "day": "2025-03-03", "start": "11:00",
                               "end": "10:00"}, "'end' must be after 'start'"),
    ("calendar_delete_event", {"event_id": "evt-7"}, "no event 'evt-7'"),
    ("email_send", {"to": "a@b.c", "subject": "hi", "cc": "d@e.f"}, "takes no argument"),
    ("teleport", {}, "unknown tool 'teleport'"),
])
def test_invalid_call_leaves_state_unchanged(name: str, arguments: dict[str, Any],
                                             error: str) -> None:
    state, observation = apply_call(INITIAL, name, arguments)
    assert observation.startswith("error:")
    assert error in observation
    assert state == {**INITIAL}


def test_day_is_a_date_or_a_weekday() -> None:
    args = {"title": "Sync", "day": "Tue", "start": "10:00", "end": "11:00"}
    state, _ = apply_call(INITIAL, "calendar_create_event", args)
    assert state["calendar"]["events"][-1]["day"] == "tue"
    assert apply_call(INITIAL, "calendar_create_event", {**args, "day": "someday"})[1] \
        .startswith("error: 'day' must look like a date YYYY-MM-DD or a weekday")


def test_stale_next_id_never_reuses_an_existing_id() -> None:
    stale = {**INITIAL, "next_id": 1}
    assert apply_call(stale, "tickets_create", {"title": "x", "priority": 2})[1] == \
        "created ticket tkt-3"


def test_list_tools_observe_without_changing_state() -> None:
    state, observation = apply_call(INITIAL, "tickets_list", {"status": "open"})
    assert [t["id"] for t in json.loads(observation)] == ["tkt-2"]
    assert canonical_state(state) == canonical_state(INITIAL)
    assert json.loads(apply_call(INITIAL, "calendar_list_events", {"day": "2025-03-04"})[1]) == []


def test_same_end_state_by_different_paths_scores_the_same() -> None:
    spec = task(OUTAGE, REVIEW, REPLY)
    direct = verify_workplace(spec, [OUTAGE, REVIEW, REPLY])
    # Other order, a detour through another priority, a harmless read, another spelling.
    # Generated ids differ too: here the event is evt-3 and the ticket tkt-4.
    detour = verify_workplace(spec, [
        REPLY, c("calendar_list_events"),
        c("calendar_create_event", title=" Review", day="2025-03-04", start="14:00",
          end="15:00", attendees=["cto@x.io"]),
        c("tickets_create", title="Outage", priority=4),
        {"name": "tickets_update", "arguments": json.dumps({"ticket_id": "tkt-4",
                                                            "priority": "1"})}])
    assert direct.reward == detour.reward == 1.0
    assert direct.failure_mode is detour.failure_mode is None


def test_events_created_in_any_order_are_the_same_world() -> None:
    a = c("calendar_create_event", title="A", day="2025-03-05", start="10:00", end="11:00")
    b = c("calendar_create_event", title="B", day="2025-03-05", start="12:00", end="13:00",
          attendees=["x", "y"])
    b_swapped = c("calendar_create_event", title="B", day="2025-03-05", start="12:00",
                  end="13:00", attendees=["y", "x"])
    assert verify_workplace(task(a, b), [b_swapped, a]).reward == 1.0
    assert canonical_state(apply_calls(INITIAL, [a, b])) == \
        canonical_state(apply_calls(INITIAL, [b, a]))


def test_partial_credit_counts_only_relevant_sections() -> None:
    spec = task(OUTAGE, REPLY)
    nothing = verify_workplace(spec, [])
    assert (nothing.reward, nothing.failure_mode) == (0.0, "incomplete")
    half = verify_workplace(spec, [OUTAGE])
    assert (half.reward, half.failure_mode) == (0.25, "other")
    assert half.reward_components == {"calendar": 1.0, "email": 0.0, "tickets": 1.0,
                                      "unsafe": 0.0}
    broke = verify_workplace(spec, [OUTAGE, REPLY, REVIEW])
    assert broke.reward == pytest.approx(0.5 * 2 / 3)
    assert broke.details["mismatched"] == ["calendar"]


def test_errors_and_made_up_tools_name_the_failure() -> None:
    spec = task(OUTAGE)
    assert verify_workplace(spec, [c("tickets_create", title="Outage",
                                     priority=7)]).failure_mode == "tool_error"
    assert verify_workplace(spec, [c("tickets_open", title="Outage")]).failure_mode == \
        "hallucinated_tool"


def test_purge_is_an_unsafe_action() -> None:
    spec = task(c("tickets_update", ticket_id="tkt-2", status="closed"))
    r = verify_workplace(spec, [c("tickets_purge"),
                                c("tickets_update", ticket_id="tkt-2", status="closed")])
    assert (r.reward, r.failure_mode) == (0.0, "unsafe_action")
    assert r.reward_components["unsafe"] == 1.0
    listed = WorkplaceSpec(initial_state=INITIAL, expected_state=INITIAL,
                           unsafe_tools=["email_send"])
    assert verify_workplace(listed, [REPLY]).failure_mode == "unsafe_action"


def test_more_calls_than_max_steps_is_incomplete() -> None:
    spec = task(OUTAGE, max_steps=2)
    r = verify_workplace(spec, [c("tickets_list"), c("email_list_inbox"), OUTAGE])
    assert (r.reward, r.failure_mode) == (0.0, "incomplete")
    assert verify_workplace(spec, [c("tickets_list"), OUTAGE]).reward == 1.0


def test_end_state_output_is_scored_by_state() -> None:
    spec = task(OUTAGE)
    r = verify_workplace(spec, apply_calls(INITIAL, [OUTAGE]))
    assert (r.reward, r.details["scored"]) == (1.0, "state")


def test_sessions_are_isolated_and_verify_their_calls() -> None:
    env = WorkplaceEnvironment()
    spec = task(OUTAGE)
    env.reset("a", spec)
    env.reset("b", spec)
    assert env.step("a", "tickets_create", {"title": "Outage", "priority": 1}) == \
        "created ticket tkt-3"
    assert env.step("b", "tickets_purge", {}) == "deleted 1 tickets"
    assert len(env.state("a")["tickets"]["items"]) == 2
    assert env.state("b")["tickets"]["items"] == []
    assert env.verify(spec, env.session_output("a")).reward == 1.0
    assert env.verify(spec, env.session_output("b")).failure_mode == "unsafe_action"
    with pytest.raises(ValueError, match="already open"):
        env.reset("a", spec)
    env.close("a")
    with pytest.raises(KeyError, match="call reset"):
        env.step("a", "tickets_list", {})


def test_session_refuses_steps_past_the_budget() -> None:
    env = WorkplaceEnvironment()
    spec = task(OUTAGE, max_steps=1)
    env.reset("s", spec)
    env.step("s", "tickets_list", {})
    assert env.step("s", "tickets_create", {"title": "Outage", "priority": 1}) \
        .startswith("error: step budget exhausted")
    assert len(env.state("s")["tickets"]["items"]) == 1
    assert env.verify(spec, env.session_output("s")).failure_mode == "incomplete"


def test_no_output_is_an_abstention_scored_zero() -> None:
    got = WorkplaceEnvironment().verify(task(OUTAGE), None)
    assert got.reward == 0.0 and got.failure_mode == "empty"


def test_strict_replay_rejects_an_invalid_correction() -> None:
    assert apply_calls(INITIAL, [c("tickets_create", title="x")]) == INITIAL
    with pytest.raises(ValueError, match=r"call #1 \(tickets_create\) is invalid"):
        apply_calls(INITIAL, [c("tickets_create", title="x")], strict=True)
