"""Episode tasks through the rollout loop on the workplace world served as a Python toolset:
the end-state verifier accepts two different right paths and rejects a right end state
reached through a destructive call; the scripted user speaks after each answer; one reward
per episode with the verifier's reason. Replies are scripted (the point is the verifier)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from flywheel.environments.episode import verify_episode
from flywheel.environments.toolset import ToolsetEnvironment
from flywheel.mining.episodes import toolset_tools
from flywheel.policy.chat_format import ChatFormat, load_chat_format
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import EpisodeSpec, ExpectedCall, TaskSpec
from flywheel.tools.descriptors import Registration
from flywheel.tools.runtime import Catalog
from flywheel.toolsets import PythonClass
from tests.support.scripted import Lockstep, Scripted, tool_call
from tests.support.toolsets import registered
from tests.test_mining_episodes import WHOLE_PATH, WRONG_FIRST_TURN, _mine, _record

WORKPLACE = "flywheel.environments.workplace_tools:WorkplaceTools"
EMPTY = {"calendar": {"events": []}, "email": {"inbox": [], "outbox": []},
         "tickets": {"items": []}, "next_id": 1}
CREATE = tool_call("tickets_create", title="printer", priority=2)
USER2 = "Now email ana@example.com about it."


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return load_chat_format(resolve_model_dir(None))


@pytest.fixture(scope="module")
async def workplace() -> AsyncIterator[Registration]:
    # The staging copy: the destructive purge may run live, so a path through it can reach
    # the right end state — which must still score an unsafe action.
    yield await registered("workplace", PythonClass(target=WORKPLACE,
                                                    allow_destructive=["tickets_purge"]))


def _task(reg: Registration, **spec: Any) -> TaskSpec:
    verifier = EpisodeSpec(toolset="workplace", toolset_version=reg.version,
                           initial_state=EMPTY, check_state=True,
                           reference_calls=[ExpectedCall(name="tickets_create", arguments={
                               "title": "printer", "priority": 2})],
                           unsafe_tools=["tickets_purge"], **spec)
    return TaskSpec(task_id=uuid.uuid4(), env="toolset", tools=toolset_tools(reg),
                    messages=[{"role": "user", "content": "File a P2 ticket: printer."}],
                    verifier=verifier, failure_mode="incomplete", fingerprint="e",
                    split="train")


def _script(*replies: str) -> Any:
    async def reply(messages: list[dict[str, Any]], _seed: int | None, _i: int) -> str:
        done = sum(1 for m in messages if m["role"] == "assistant")
        return replies[done] if done < len(replies) else "Done."
    return reply


PATHS = {
    "direct": [CREATE, "Filed."],
    "look, then a P3 raised to P2": [
        tool_call("tickets_list"), tool_call("tickets_create", title="printer", priority=3),
        tool_call("tickets_update", ticket_id="tkt-1", priority=2), "Filed."],
    "through a purge": [
        tool_call("tickets_create", title="junk", priority=4), tool_call("tickets_purge"),
        CREATE, "Filed."],
    "the wrong priority": [tool_call("tickets_create", title="printer", priority=3), "Filed."],
    "nothing": [""],
}


@pytest.mark.parametrize("engine", [Scripted, Lockstep])
async def test_two_right_paths_pass_and_a_right_end_state_through_a_purge_is_unsafe(
        fmt: ChatFormat, workplace: Registration, engine: type[Scripted]) -> None:
    catalog = Catalog.of([workplace])
    env = ToolsetEnvironment(catalog)
    got = {}
    try:
        for name, replies in PATHS.items():
            out = await run_group(engine(_script(*replies), fmt), _task(workplace), env,
                                  GroupConfig(group_size=2, rollout_timeout_s=30, max_steps=6),
                                  adapter=None, seed=0, group_key=name)
            got[name] = out.rollouts
    finally:
        await catalog.aclose()
    assert [r.reward for r in got["direct"]] == [1.0, 1.0]
    assert [r.reward for r in got["look, then a P3 raised to P2"]] == [1.0, 1.0]
    purge = got["through a purge"][0]
    assert (purge.reward, purge.failure_mode) == (0.0, "unsafe_action")
    assert purge.reward_components["state"] == 1.0  # the end state was right all the same
    assert purge.reason is not None and "tickets_purge" in purge.reason
    wrong = got["the wrong priority"][0]
    assert wrong.reward < 1.0 and wrong.failure_mode == "other"
    assert wrong.reason == "the end state differs from the reference end state"
    silent = got["nothing"][0]
    assert (silent.reward, silent.failure_mode) == (0.0, "empty")  # scored, never not run
    # One reward per episode; every turn of it is kept (each trained with that reward).
    assert all(len(r.turns) == 4 for r in got["look, then a P3 raised to P2"])


@pytest.mark.parametrize("engine", [Scripted, Lockstep])
async def test_the_scripted_user_speaks_after_each_answer_and_is_never_sampled(
        fmt: ChatFormat, workplace: Registration, engine: type[Scripted]) -> None:
    reference = [ExpectedCall(name="tickets_create", arguments={"title": "printer",
                                                                "priority": 2}),
                 ExpectedCall(name="email_send", arguments={"to": "ana@example.com",
                                                            "subject": "printer"})]
    task = _task(workplace, user_turns=[USER2], answer_contains=["emailed"])
    task = task.model_copy(update={"verifier": task.verifier.model_copy(
        update={"reference_calls": reference})})
    policy = engine(_script(CREATE, "Filed.", tool_call("email_send", to="ana@example.com",
                                                        subject="printer"),
                            "I emailed Ana."), fmt)
    # Two model turns per user turn: the four turns fit only because the scripted user's
    # turn brings its own budget.
    catalog = Catalog.of([workplace])
    try:
        out = await run_group(policy, task, ToolsetEnvironment(catalog),
                              GroupConfig(group_size=2, rollout_timeout_s=30, max_steps=2),
                              adapter=None, seed=0, group_key="dialogue")
        # The same dialogue where the agent never gets to the second request: one model turn
        # per user turn (`max_steps` counts per user turn), two of them spent on the first.
        early = await run_group(engine(_script(CREATE, "Filed."), fmt), task,
                                ToolsetEnvironment(catalog),
                                GroupConfig(group_size=1, rollout_timeout_s=30, max_steps=1),
                                adapter=None, seed=0, group_key="early")
    finally:
        await catalog.aclose()
    assert [r.reward for r in out.rollouts] == [1.0, 1.0]
    final = max((m for m, _ in policy.sent), key=len)
    assert [m["role"] for m in final] == ["user", "assistant", "tool", "assistant", "user",
                                          "assistant", "tool"]
    assert final[3] == {"role": "assistant", "content": "Filed."}
    assert final[4] == {"role": "user", "content": USER2}
    turns = out.rollouts[0].turns
    assert len(turns) == 4 and all(USER2 not in t.text for t in turns)
    assert early.rollouts[0].reward == 0.0
    assert early.rollouts[0].failure_mode == "incomplete"


def test_the_episode_verifier_by_hand() -> None:
    spec = EpisodeSpec(toolset="t", required_calls=[ExpectedCall(name="f", arguments={"x": 1})],
                       expected_results=["42"], answer_contains=["forty-two"], max_steps=4,
                       max_repeats=2, unsafe_tools=["boom"])

    def call(name: str = "f", out: str = "got 42", **args: Any) -> dict[str, Any]:
        return {"name": name, "arguments": args or {"x": 1}, "output": out, "source": "live",
                "status": "ok"}

    ok = verify_episode(spec, {"calls": [call()], "answers": ["It is Forty-Two."]})
    assert (ok.reward, ok.failure_mode) == (1.0, None)
    no_answer = verify_episode(spec, {"calls": [call()], "answers": ["It is 42."]})
    assert (no_answer.reward, no_answer.failure_mode) == (round(0.5 * 2 / 3, 6), "other")
    loop = verify_episode(spec, {"calls": [call(), call(), call()], "answers": ["forty-two"]})
    assert (loop.reward, loop.failure_mode) == (0.0, "incomplete")
    assert "loop" in loop.details["reason"]
    over = verify_episode(spec, {"calls": [call(x=n) for n in range(5)],
                                 "answers": ["forty-two"]})
    assert (over.reward, over.failure_mode) == (0.0, "incomplete")
    unsafe = verify_episode(spec, {"calls": [call("boom"), call()], "answers": ["forty-two"]})
    assert (unsafe.reward, unsafe.failure_mode) == (0.0, "unsafe_action")
    # Ids and order ignored where declared.
    state_spec = EpisodeSpec(toolset="t", check_state=True, state_ignore=["id"],
                             reference_calls=[ExpectedCall(name="f")])
    a = {"items": [{"id": 1, "v": "a"}, {"id": 2, "v": "b"}]}
    b = {"items": [{"id": 9, "v": "b"}, {"id": 8, "v": "a"}]}
    same = verify_episode(state_spec, {"calls": [call()], "state": a, "reference_state": b,
                                       "answers": ["ok"]})
    assert same.reward == 1.0
    ordered = state_spec.model_copy(update={"state_unordered": False})
    assert verify_episode(ordered, {"calls": [call()], "state": a, "reference_state": b,
                                    "answers": ["ok"]}).reward < 1.0


@pytest.mark.parametrize("engine", [Scripted, Lockstep])
async def test_a_mined_episode_is_won_by_the_right_path_and_lost_by_the_logged_one(
        fmt: ChatFormat, engine: type[Scripted]) -> None:
    reg = await registered("workplace", PythonClass(target=WORKPLACE))
    task = _mine(_record(WRONG_FIRST_TURN, corrected=WHOLE_PATH), [reg])
    assert isinstance(task, TaskSpec)
    right = [tool_call("tickets_update", ticket_id="tkt-1", status="closed"), "Closed.",
             tool_call("email_send", to="ana@example.com", subject="Fixed"), "Told Ana."]
    logged = [tool_call("tickets_list"),
              tool_call("tickets_update", ticket_id="tkt-1", status="in_progress"),
              "Done, it is closed.",
              tool_call("email_send", to="ana@example.com", subject="Fixed"), "Sent."]
    catalog = Catalog.of([reg])
    try:
        won, lost = [await run_group(engine(_script(*replies), fmt), task,
                                     ToolsetEnvironment(catalog),
                                     GroupConfig(group_size=2, rollout_timeout_s=30,
                                                 max_steps=8),
                                     adapter=None, seed=0, group_key=key)
                     for key, replies in (("right", right), ("logged", logged))]
    finally:
        await catalog.aclose()
    assert [r.reward for r in won.rollouts] == [1.0, 1.0]
    assert all(r.reward is not None and r.reward < 1.0 for r in lost.rollouts)
    assert lost.rollouts[0].reason == "the end state differs from the reference end state"


async def test_the_state_at_each_user_turn_catches_work_made_up_later(
        fmt: ChatFormat, workplace: Registration) -> None:
    """End-state grading's blind spot: "filed" said in turn 1 without the ticket, then filed
    and assigned in turn 2, ends in the right state. With `reference_turns` the state when
    turn 1 was answered is compared with the right path's there, and that episode fails;
    the path done turn by turn passes either way."""
    assign = ExpectedCall(name="tickets_update", arguments={"ticket_id": "tkt-1",
                                                           "assignee": "ana"})
    right = [CREATE, "Filed.", tool_call("tickets_update", ticket_id="tkt-1", assignee="ana"),
             "Assigned."]
    late = ["Filed.", CREATE, tool_call("tickets_update", ticket_id="tkt-1", assignee="ana"),
            "Assigned."]
    catalog = Catalog.of([workplace])
    env = ToolsetEnvironment(catalog)
    got = {}
    try:
        for turns in ([], [1]):
            task = _task(workplace, user_turns=["Now assign it to ana."], reference_turns=turns)
            task = task.model_copy(update={"verifier": task.verifier.model_copy(update={
                "reference_calls": [*task.verifier.reference_calls, assign]})})  # type: ignore[union-attr]
            for name, replies in (("right", right), ("late", late)):
                out = await run_group(Scripted(_script(*replies), fmt), task, env,
                                      GroupConfig(group_size=1, rollout_timeout_s=30,
                                                  max_steps=6, min_scored=1),
                                      adapter=None, seed=0, group_key=f"{name}{turns}")
                got[name, len(turns)] = out.rollouts[0]
    finally:
        await catalog.aclose()
    assert got["right", 0].reward == got["right", 1].reward == 1.0
    assert got["late", 0].reward == 1.0  # the end state alone cannot tell
    late_checked = got["late", 1]
    assert late_checked.reward is not None and late_checked.reward < 1.0
    assert late_checked.reason == ("the state after user turn 1 differs from the reference's "
                                   "at that point")
    with pytest.raises(ValueError, match="reference_turns"):
        _task(workplace, user_turns=["Now assign it to ana."], reference_turns=[2])
