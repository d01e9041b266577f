"""Episode tasks mined from failed multi-step trajectories on a registered toolset (pure: no
database), the reasons an episode is not verifiable, and episode demonstrations."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from flywheel.environments.workplace_world import WORKPLACE_TOOLS
from flywheel.mining.build import Unverifiable
from flywheel.mining.classify import classify_failure
from flywheel.mining.demos import from_turn, success_demonstrations
from flywheel.mining.episode_demos import corrected_episode_demonstrations
from flywheel.mining.episodes import build_episode
from flywheel.mining.expected import expected_calls
from flywheel.mining.mine_batch import MineStats, _build
from flywheel.tasks import EpisodeSpec, TaskSpec
from flywheel.tools.descriptors import Registration
from flywheel.toolsets import PythonClass
from flywheel.trajectory import Trajectory, parse_trajectory
from tests.support.toolsets import registered

WORKPLACE = "flywheel.environments.workplace_tools:WorkplaceTools"
INITIAL = {"calendar": {"events": []}, "email": {"inbox": [], "outbox": []},
           "tickets": {"items": [{"id": "tkt-1", "title": "printer", "priority": 2,
                                  "status": "open", "assignee": None}]}, "next_id": 2}
ASK = "Close the printer ticket."
THEN = "Then email ana@example.com that it is fixed."


@pytest.fixture(scope="module")
async def workplace() -> AsyncIterator[Registration]:
    yield await registered("workplace", PythonClass(target=WORKPLACE))


def _call(n: int, name: str, output: str = "ok", **args: Any) -> list[dict[str, Any]]:
    return [{"type": "function_call", "call_id": f"c{n}", "name": name,
             "arguments": json.dumps(args)},
            {"type": "function_call_output", "call_id": f"c{n}", "output": output}]


def _say(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": text}


def _record(items: list[dict[str, Any]], *, status: str = "failure",
            corrected: list[dict[str, Any]] | None = None, meta: dict[str, Any] | None = None,
            feedback: Any = None) -> dict[str, Any]:
    outcome: dict[str, Any] = {"status": status}
    if corrected is not None:
        outcome["human_intervention"] = {"corrected_items": corrected}
    if feedback is not None:
        outcome["feedback"] = feedback
    metadata = {"toolset": "workplace", "environment": {"initial_state": INITIAL}} \
        if meta is None else meta
    return {"trajectory_id": str(uuid.uuid4()), "agent": "helpdesk", "session_id": "s1",
            "tools": [{k: v for k, v in t.items() if k != "x-unsafe"} for t in WORKPLACE_TOOLS],
            "items": items, "outcome": outcome, "metadata": metadata}


WRONG_FIRST_TURN = [_say("user", ASK), *_call(1, "tickets_list", "[tkt-1 printer open]"),
                    *_call(2, "tickets_update", "updated", ticket_id="tkt-1",
                           status="in_progress"),
                    _say("assistant", "Done, it is closed."), _say("user", THEN),
                    *_call(3, "email_send", "sent", to="ana@example.com", subject="Fixed"),
                    _say("assistant", "Sent.")]
WHOLE_PATH = [*_call(7, "tickets_update", "updated", ticket_id="tkt-1", status="closed"),
              *_call(8, "email_send", "sent", to="ana@example.com", subject="Fixed"),
              _say("assistant", "Closed and Ana is told.")]


def _mine(record: dict[str, Any], regs: list[Registration]) -> TaskSpec | Unverifiable | None:
    t = parse_trajectory(record)
    found = expected_calls(t)
    return build_episode(t, classify_failure(t, found[0] if found else None), regs)


def test_a_failed_two_user_turn_conversation_becomes_one_episode_with_a_scripted_user(
        workplace: Registration) -> None:
    task = _mine(_record(WRONG_FIRST_TURN, corrected=WHOLE_PATH), [workplace])
    assert isinstance(task, TaskSpec) and task.env == "toolset"
    spec = task.verifier
    assert isinstance(spec, EpisodeSpec)
    # The prompt ends at the first user turn the agent failed; the later one is scripted.
    assert task.messages == [{"role": "user", "content": ASK}]
    assert spec.user_turns == [THEN]
    assert (spec.toolset, spec.toolset_version, spec.initial_state) == ("workplace", 1, INITIAL)
    assert spec.check_state and spec.required_calls == [] and spec.setup == []
    assert [(c.name, c.arguments) for c in spec.reference_calls] == [
        ("tickets_update", {"ticket_id": "tkt-1", "status": "closed"}),
        ("email_send", {"to": "ana@example.com", "subject": "Fixed"})]
    assert spec.unsafe_tools == ["tickets_purge"]
    assert [t["name"] for t in task.tools if t.get("x-unsafe")] == ["tickets_purge"]
    # Dedup and the split work as for single steps: the same failure again is the same task.
    again = _mine(_record(WRONG_FIRST_TURN, corrected=WHOLE_PATH), [workplace])
    assert isinstance(again, TaskSpec)
    assert (again.fingerprint, again.task_id, again.split) == (
        task.fingerprint, task.task_id, task.split)


def test_a_failure_in_the_second_turn_keeps_the_first_in_the_prompt_and_runs_its_calls(
        workplace: Registration) -> None:
    items = [_say("user", ASK),
             *_call(1, "tickets_update", "updated", ticket_id="tkt-1", status="closed"),
             _say("assistant", "Closed."), _say("user", THEN),
             *_call(2, "email_send", "sent", to="bob@example.com", subject="Fixed"),
             _say("assistant", "Sent.")]
    task = _mine(_record(items, corrected=WHOLE_PATH), [workplace])
    assert isinstance(task, TaskSpec)
    spec = task.verifier
    assert isinstance(spec, EpisodeSpec)
    assert [m["role"] for m in task.messages] == ["user", "assistant", "tool", "assistant",
                                                  "user"]
    assert task.messages[-1]["content"] == THEN and spec.user_turns == []
    assert [c.name for c in spec.setup] == ["tickets_update"]  # run before the episode
    assert [c.name for c in spec.reference_calls] == ["tickets_update", "email_send"]


def test_an_answer_without_the_work_in_an_earlier_turn_starts_the_episode_there(
        workplace: Registration) -> None:
    # No single call is to blame (the classifier says `incomplete`, no step): the episode
    # starts at the first turn that left the corrected path, not at the last user turn —
    # from there the right path would have to redo a turn the prompt says is done.
    items = [_say("user", ASK), _say("assistant", "Done, it is closed."), _say("user", THEN),
             *_call(2, "email_send", "sent", to="ana@example.com", subject="Fixed"),
             _say("assistant", "Sent.")]
    task = _mine(_record(items, corrected=WHOLE_PATH), [workplace])
    assert isinstance(task, TaskSpec) and task.failure_mode == "incomplete"
    spec = task.verifier
    assert isinstance(spec, EpisodeSpec)
    assert task.messages == [{"role": "user", "content": ASK}] and spec.user_turns == [THEN]
    assert spec.setup == [] and [c.name for c in spec.reference_calls] == [
        "tickets_update", "email_send"]


def test_a_retry_with_the_calls_the_agent_made_shows_nothing_to_check(
        workplace: Registration) -> None:
    # The right calls and a wrong answer, then a successful retry making the same calls: the
    # calls cannot tell the failure from the success, and nothing else is expected.
    done = [_say("user", ASK),
            *_call(1, "tickets_update", "updated", ticket_id="tkt-1", status="closed"),
            _say("assistant", "Closed."), _say("user", THEN),
            *_call(2, "email_send", "sent", to="ana@example.com", subject="Fixed")]
    failed = parse_trajectory(_record([*done, _say("assistant", "I could not send it.")]))
    retry = parse_trajectory(_record([*done, _say("assistant", "Sent.")], status="success"))
    found = expected_calls(failed, retry)
    assert found is not None
    built = build_episode(failed, classify_failure(failed, found[0]), [workplace], retry=retry)
    assert isinstance(built, Unverifiable)
    assert built.reason.startswith("the expected calls are the ones the agent made")


def test_without_a_logged_state_the_episode_replays_results_and_requires_the_calls(
        workplace: Registration) -> None:
    record = _record(WRONG_FIRST_TURN, corrected=WHOLE_PATH, meta={"toolset": "workplace"})
    # Off the logged path the toolset ends the episode: the right path could never succeed.
    ends = _mine(record, [workplace])
    assert isinstance(ends, Unverifiable)
    assert "answers a call off the logged path with 'end'" in ends.reason
    live = workplace.model_copy(update={"config": workplace.config.model_copy(
        update={"on_divergence": "live"})})
    task = _mine(record, [live])
    assert isinstance(task, TaskSpec)
    spec = task.verifier
    assert isinstance(spec, EpisodeSpec)
    assert not spec.check_state and spec.initial_state is None
    assert [c.name for c in spec.required_calls] == ["tickets_update", "email_send"]
    assert spec.replay is not None and [c.output for c in spec.replay] == [
        "[tkt-1 printer open]", "updated", "sent"]


def test_the_toolset_is_found_by_its_tool_names_when_metadata_names_none(
        workplace: Registration) -> None:
    meta = {"environment": {"initial_state": INITIAL}}
    task = _mine(_record(WRONG_FIRST_TURN, corrected=WHOLE_PATH, meta=meta), [workplace])
    assert isinstance(task, TaskSpec) and isinstance(task.verifier, EpisodeSpec)
    twin = workplace.model_copy(update={"name": "workplace-staging"})
    both = _mine(_record(WRONG_FIRST_TURN, corrected=WHOLE_PATH, meta=meta), [workplace, twin])
    assert isinstance(both, Unverifiable) and "match 2 registered toolsets" in both.reason


def test_unverifiable_episodes_say_why_and_are_counted(workplace: Registration) -> None:
    purge = [*_call(9, "tickets_purge", "purged"), *WHOLE_PATH]
    cases = {
        "no expected path or outcome": _record(WRONG_FIRST_TURN),
        "destructive tool tickets_purge": _record(WRONG_FIRST_TURN, corrected=purge),
        "names toolset 'crm', which is not registered": _record(
            WRONG_FIRST_TURN, corrected=WHOLE_PATH, meta={"toolset": "crm"}),
    }
    stats = MineStats()
    for why, record in cases.items():
        got = _mine(record, [workplace])
        assert isinstance(got, Unverifiable) and why in got.reason, (why, got)
        t = parse_trajectory(record)
        found = expected_calls(t)
        _build(t, classify_failure(t, found[0] if found else None), None, [workplace], stats,
               0.2, True)
    assert sum(stats.episode_unverifiable.values()) == 3 and stats.episodes == 0
    assert any("destructive" in reason for reason in stats.episode_unverifiable)
    # A single call with no answer is no episode: the single-step path applies.
    single = _record([_say("user", ASK), *_call(1, "tickets_update", "x", ticket_id="tkt-1",
                                                   status="open")], corrected=WHOLE_PATH[:2])
    assert _mine(single, [workplace]) is None


def test_feedback_outcomes_alone_make_a_verifiable_episode(workplace: Registration) -> None:
    fb = {"expected_results": ["tkt-1"], "final_answer_contains": ["closed"]}
    task = _mine(_record(WRONG_FIRST_TURN, feedback=fb), [workplace])
    assert isinstance(task, TaskSpec) and isinstance(task.verifier, EpisodeSpec)
    assert task.verifier.expected_results == ["tkt-1"]
    assert task.verifier.answer_contains == ["closed"]
    assert not task.verifier.check_state


def _turns(t: Trajectory) -> int:
    return sum(1 for i in t.items if getattr(i, "role", None) == "assistant") + sum(
        1 for n, i in enumerate(t.items) if i.type == "function_call"
        and (n == 0 or t.items[n - 1].type != "function_call"))


def test_a_logged_success_gives_one_demonstration_per_assistant_turn(
        workplace: Registration) -> None:
    items = [_say("user", ASK), *WHOLE_PATH[:2], _say("assistant", "Closed."),
             _say("user", THEN), *WHOLE_PATH[2:4], _say("assistant", "Told Ana.")]
    record = _record(items, status="success")
    demos = success_demonstrations(parse_trajectory(record), [workplace])
    assert len(demos) == _turns(parse_trajectory(record)) == 4
    replies = [d.reply for d in demos]
    assert [r.get("content") for r in replies] == [None, "Closed.", None, "Told Ana."]
    assert replies[2]["tool_calls"][0]["function"]["name"] == "email_send"
    assert all(d.env == "toolset" and d.fingerprint == demos[0].fingerprint for d in demos)
    # Each turn's prompt is the whole conversation before it; the user's words are prompt.
    assert demos[3].messages[-1] == {"role": "tool", "tool_call_id": "call_0",
                                     "content": "sent"}
    assert {"role": "user", "content": THEN} in demos[2].messages
    assert all(THEN not in json.dumps(r) for r in replies)
    # A success through a destructive tool teaches nothing.
    bad = copy.deepcopy(record)
    bad["items"][1:1] = _call(9, "tickets_purge", "purged")
    assert success_demonstrations(parse_trajectory(bad), [workplace]) == []


def test_a_correction_with_the_whole_path_demonstrates_every_turn(
        workplace: Registration) -> None:
    # Without the later user message where it came, the path is not the episode's dialogue.
    record = _record(WRONG_FIRST_TURN, corrected=WHOLE_PATH)
    task = _mine(record, [workplace])
    assert isinstance(task, TaskSpec)
    assert corrected_episode_demonstrations(task, parse_trajectory(record)) == []
    path = [*WHOLE_PATH[:2], _say("assistant", "Closed."), _say("user", THEN),
            *WHOLE_PATH[2:]]
    record = _record(WRONG_FIRST_TURN, corrected=path)
    task = _mine(record, [workplace])
    assert isinstance(task, TaskSpec)
    demos = [from_turn(d) for d in corrected_episode_demonstrations(
        task, parse_trajectory(record))]
    assert [d.reply.get("content") for d in demos] == [None, "Closed.", None,
                                                       "Closed and Ana is told."]
    assert demos[0].messages == task.messages
    assert demos[2].messages[-1] == {"role": "user", "content": THEN}
    assert demos[3].messages[-1]["content"] == "sent"


def test_where_the_right_path_stands_at_each_later_user_turn() -> None:
    """`reference_turns` from the path's own items: calls before each later user message,
    else by the answers that ended the requests before them; nothing when they disagree."""
    from flywheel.mining.episodes import _turn_counts
    from flywheel.trajectory import FunctionCallItem, MessageItem

    def call(name: str) -> FunctionCallItem:
        return FunctionCallItem(call_id=name, name=name, arguments="{}")

    def say(role: str, text: str) -> MessageItem:
        return MessageItem(role=role, content=text)

    with_users = [call("a"), say("assistant", "A."), say("user", "two"), call("b"),
                  call("c"), say("assistant", "B."), say("user", "three"), call("d"),
                  say("assistant", "C.")]
    assert _turn_counts(with_users, ["two", "three"], 4, 0) == [1, 3]
    assert _turn_counts(with_users, ["three"], 4, 2) == [5]           # path from turn 2 on
    assert _turn_counts(with_users, ["two", "four"], 4, 0) == []      # other requests
    assert _turn_counts(with_users, ["two", "three"], 5, 0) == []     # not the path's calls
    answers_only = [i for i in with_users if not (isinstance(i, MessageItem)
                                                  and i.role == "user")]
    assert _turn_counts(answers_only, ["two", "three"], 4, 0) == [1, 3]
    assert _turn_counts(answers_only, ["three"], 4, 0) == [3]
    assert _turn_counts(answers_only[:-1], ["two", "three"], 4, 0) == []  # too few answers
