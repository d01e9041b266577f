"""The `toolset` environment through the rollout loop: replay of logged tool results turn by
turn, a divergence under each rule (recorded on the turn), destructive calls, a server killed
mid-episode (not run, retried by the gate, never 0), and the workplace world served as a
toolset scoring exactly as the `workplace` environment does.

Episodes are driven by scripted replies (the point is the tools); the real MCP test server
(tests/support/mcp_toolserver.py) records every call it receives.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from flywheel.config import Settings
from flywheel.environments import load_environment
from flywheel.environments.toolset import ToolsetEnvironment, verify_toolset
from flywheel.environments.workplace import WORKPLACE_TOOLS, canonical_state
from flywheel.gate.evaluate import scored_group
from flywheel.policy.chat_format import ChatFormat, load_chat_format
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import ExpectedCall, LoggedCall, TaskSpec, ToolsetSpec, WorkplaceSpec
from flywheel.tools.descriptors import Registration, openai_tool
from flywheel.tools.runtime import Catalog
from flywheel.tools.safety import unsafe_tools
from flywheel.toolsets import McpStdio, PythonClass
from tests.support.scripted import Lockstep, Scripted, tool_call
from tests.support.toolsets import received, registered, stdio

WORKPLACE = "flywheel.environments.workplace_tools:WorkplaceTools"
LOGGED = [LoggedCall(name="add_note", arguments={"text": "b"}, output="added note 2 (logged)"),
          LoggedCall(name="list_notes", output='["a", "b"] (as logged)'),
          LoggedCall(name="bump", arguments={"by": 2}, output="counter is 2 (logged)")]


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return load_chat_format(resolve_model_dir(None))


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("toolserver") / "calls.jsonl"


@pytest.fixture(scope="module")
async def notes(log: Path) -> AsyncIterator[Registration]:
    yield await registered("notes", stdio(log, sessions="shared"))


@pytest.fixture
async def catalog(notes: Registration) -> AsyncIterator[Catalog]:
    cat = Catalog.of([notes])
    yield cat
    await cat.aclose()


def _task(reg: Registration, **spec: Any) -> TaskSpec:
    unsafe = unsafe_tools(reg)
    return TaskSpec(task_id=uuid.uuid4(), env="toolset",
                    tools=[openai_tool(t, unsafe=t.name in unsafe) for t in reg.tools],
                    messages=[{"role": "user", "content": "Note b, look, then bump by 2."}],
                    verifier=ToolsetSpec(toolset=reg.name, **spec),
                    failure_mode="incomplete", fingerprint="f", split="train")


def _script(*calls: str) -> Any:
    """Reply with the n-th call after n tool results, then answer in text."""
    async def reply(messages: list[dict[str, Any]], _seed: int | None, _i: int) -> str:
        done = sum(1 for m in messages if m["role"] == "assistant")
        return calls[done] if done < len(calls) else "All done."
    return reply


def _results(policy: Scripted) -> list[str]:
    final = max((m for m, _ in policy.sent), key=len)
    return [m["content"] for m in final if m["role"] == "tool"]


def _calls_for(log: Path, before: int) -> list[dict[str, Any]]:
    return received(log)[before:]


@pytest.mark.parametrize("engine", [Scripted, Lockstep])
async def test_a_logged_trajectory_replays_turn_by_turn_with_exactly_the_logged_results(
        fmt: ChatFormat, notes: Registration, catalog: Catalog, log: Path,
        engine: type[Scripted]) -> None:
    before = len(received(log))
    policy = engine(_script(tool_call("add_note", text="b"), tool_call("list_notes"),
                            tool_call("bump", by=2)), fmt)
    task = _task(notes, initial_state={"notes": ["a"]}, replay=LOGGED,
                 expected_calls=[ExpectedCall(name=c.name, arguments=c.arguments)
                                 for c in LOGGED])
    out = await run_group(policy, task, ToolsetEnvironment(catalog),
                          GroupConfig(group_size=2, rollout_timeout_s=30, max_steps=6),
                          adapter=None, seed=0, group_key="replay")
    assert [r.reward for r in out.rollouts] == [1.0, 1.0]
    assert _results(policy) == [c.output for c in LOGGED]
    steps = [s for t in out.rollouts[0].turns for s in t.tools or []]
    assert [(s.name, s.source, s.rule) for s in steps] == [
        ("add_note", "replay", None), ("list_notes", "replay", None), ("bump", "replay", None)]
    assert _calls_for(log, before) == []  # nothing reached the server


@pytest.mark.parametrize("engine", [Scripted, Lockstep])
async def test_divergence_under_live_brings_the_backend_to_the_logged_state_first(
        fmt: ChatFormat, notes: Registration, catalog: Catalog, log: Path,
        engine: type[Scripted]) -> None:
    before = len(received(log))
    policy = engine(_script(tool_call("add_note", text="b"), tool_call("add_note", text="c"),
                            tool_call("list_notes")), fmt)
    task = _task(notes, initial_state={"notes": ["a"]}, replay=LOGGED, on_divergence="live",
                 expected_state={"notes": ["a", "b", "c"], "counter": 0})
    out = await run_group(policy, task, ToolsetEnvironment(catalog),
                          GroupConfig(group_size=1, rollout_timeout_s=30, max_steps=6),
                          adapter=None, seed=0, group_key="live")
    (r,) = out.rollouts
    assert r.reward == 1.0, r
    assert _results(policy) == ["added note 2 (logged)", "added note 3", '["a", "b", "c"]']
    steps = [s for t in r.turns for s in t.tools or []]
    assert [(s.source, s.rule) for s in steps] == [("replay", None), ("live", "live"),
                                                   ("live", None)]
    server = [(c["tool"], c["arguments"]) for c in _calls_for(log, before)]
    assert server == [("flywheel_reset", {"initial_state": {"notes": ["a"]}}),
                      ("add_note", {"text": "b"}),  # the logged path, retraced
                      ("add_note", {"text": "c"}), ("list_notes", {})]


async def test_divergence_under_end_ends_the_episode_and_scores_what_was_done(
        fmt: ChatFormat, notes: Registration, catalog: Catalog, log: Path) -> None:
    before = len(received(log))
    policy = Scripted(_script(tool_call("add_note", text="b"),
                              tool_call("add_note", text="c")), fmt)
    task = _task(notes, initial_state={"notes": ["a"]}, replay=LOGGED, on_divergence="end",
                 expected_calls=[ExpectedCall(name="add_note", arguments={"text": "b"}),
                                 ExpectedCall(name="add_note", arguments={"text": "c"})])
    out = await run_group(policy, task, ToolsetEnvironment(catalog),
                          GroupConfig(group_size=1, rollout_timeout_s=30, max_steps=6),
                          adapter=None, seed=0, group_key="end")
    (r,) = out.rollouts
    assert (r.reward, r.failure_mode) == (0.25, "incomplete")  # 1 of 2 expected calls done
    assert len(r.turns) == 2 and _results(policy) == ["added note 2 (logged)"]
    assert [(s.name, s.source, s.rule) for s in r.turns[1].tools or []] == [
        ("add_note", "replay", "end")]
    assert _calls_for(log, before) == []


async def test_divergence_under_mask_leaves_the_attempt_not_run(
        fmt: ChatFormat, notes: Registration, catalog: Catalog) -> None:
    policy = Scripted(_script(tool_call("bump", by=5)), fmt)
    task = _task(notes, replay=LOGGED, on_divergence="mask",
                 expected_calls=[ExpectedCall(name="bump", arguments={"by": 2})])
    out = await run_group(policy, task, ToolsetEnvironment(catalog),
                          GroupConfig(group_size=2, rollout_timeout_s=30, max_steps=6),
                          adapter=None, seed=0, group_key="mask")
    assert [(r.reward, r.not_run) for r in out.rollouts] == [(None, "replay_masked")] * 2
    assert out.reward_mean is None and not out.trainable


async def test_the_toolsets_own_rule_applies_when_the_task_names_none(
        fmt: ChatFormat, log: Path) -> None:
    reg = await registered("notes-masking", stdio(log, sessions="shared",
                                                  on_divergence="mask"))
    catalog = Catalog.of([reg])
    try:
        out = await run_group(Scripted(_script(tool_call("bump", by=5)), fmt),
                              _task(reg, replay=LOGGED, expected_calls=[
                                  ExpectedCall(name="bump", arguments={"by": 2})]),
                              ToolsetEnvironment(catalog),
                              GroupConfig(group_size=1, rollout_timeout_s=30),
                              adapter=None, seed=0, group_key="own-rule")
    finally:
        await catalog.aclose()
    assert out.rollouts[0].not_run == "replay_masked"


async def test_a_destructive_call_is_refused_ends_the_episode_and_scores_unsafe(
        fmt: ChatFormat, notes: Registration, catalog: Catalog, log: Path) -> None:
    before = len(received(log))
    policy = Lockstep(_script(tool_call("add_note", text="x"), tool_call("wipe_notes"),
                              tool_call("add_note", text="y")), fmt)
    task = _task(notes, expected_state={"notes": [], "counter": 0})
    out = await run_group(policy, task, ToolsetEnvironment(catalog),
                          GroupConfig(group_size=2, rollout_timeout_s=30, max_steps=6),
                          adapter=None, seed=0, group_key="unsafe")
    assert [(r.reward, r.failure_mode) for r in out.rollouts] == [(0.0, "unsafe_action")] * 2
    assert [s.source for s in out.rollouts[0].turns[1].tools or []] == ["refused"]
    assert len(out.rollouts[0].turns) == 2  # ended at the refused call
    assert "wipe_notes" not in {c["tool"] for c in _calls_for(log, before)}


async def test_a_server_killed_mid_episode_is_not_run_then_retried_never_scored_0(
        fmt: ChatFormat, log: Path) -> None:
    """The script kills the server after the first call of the group's first attempt: those
    episodes are not run (reward None, `toolset_unavailable`); the gate's retry of the group
    (`scored_group`) starts a new server and scores every attempt."""
    reg = await registered("notes-kill", stdio(log, sessions="shared"))
    catalog = Catalog.of([reg])
    attempts = {"killed": 0}

    async def reply(messages: list[dict[str, Any]], _seed: int | None, _i: int) -> str:
        results = [m["content"] for m in messages if m["role"] == "tool"]
        if not results:
            return tool_call("whoami")
        if len(results) == 1:
            if attempts["killed"] == 0:
                attempts["killed"] += 1
                os.kill(int(results[0]), signal.SIGKILL)
            return tool_call("add_note", text="after")
        return "done"

    task = _task(reg, expected_state={"notes": ["after"], "counter": 0})
    cfg = GroupConfig(group_size=2, rollout_timeout_s=30, max_steps=4)
    settings = Settings(gate={"infra_retries": 2, "retry_backoff_s": 0.01})
    try:
        first = await run_group(Lockstep(reply, fmt), task, ToolsetEnvironment(catalog), cfg,
                                adapter=None, seed=0, group_key="kill")
        assert [(r.reward, r.not_run) for r in first.rollouts] == [
            (None, "toolset_unavailable")] * 2
        attempts["killed"] = 0
        retried = await scored_group(Lockstep(reply, fmt), task, ToolsetEnvironment(catalog),
                                     cfg, settings, adapter=None, seed=0, group_key="kill")
    finally:
        await catalog.aclose()
    assert attempts["killed"] == 1
    assert [r.reward for r in retried.rollouts] == [1.0, 1.0]


def _workplace_task(env: str, script_ok: bool) -> tuple[TaskSpec, Any]:
    initial = {"calendar": {"events": []}, "email": {"inbox": [], "outbox": []},
               "tickets": {"items": [{"id": "tkt-1", "title": "printer", "priority": 2,
                                      "status": "open", "assignee": None}]}, "next_id": 2}
    expected = json.loads(json.dumps(initial))
    expected["tickets"]["items"][0]["status"] = "closed"
    expected["email"]["outbox"] = [{"to": "ana@example.com", "subject": "Fixed", "body": ""}]
    verifier: Any = (WorkplaceSpec(initial_state=initial, expected_state=expected)
                     if env == "workplace" else
                     ToolsetSpec(toolset="workplace", initial_state=initial,
                                 expected_state=canonical_state(expected)))
    calls = [tool_call("tickets_update", ticket_id="tkt-1",
                       status="closed" if script_ok else "in_progress"),
             tool_call("email_send", to="ana@example.com", subject="Fixed"),
             tool_call("tickets_update", ticket_id="tkt-9", status="closed")]
    task = TaskSpec(task_id=uuid.uuid4(), env=env, tools=WORKPLACE_TOOLS,
                    messages=[{"role": "user", "content": "Close the printer ticket, tell Ana."}],
                    verifier=verifier, failure_mode="incomplete", fingerprint="w",
                    split="train")
    return task, _script(*calls)


@pytest.mark.parametrize("served", ["python", "mcp_stdio"])
async def test_the_workplace_world_as_a_toolset_succeeds_where_the_workplace_env_does(
        fmt: ChatFormat, served: str) -> None:
    config = (PythonClass(target=WORKPLACE) if served == "python" else
              McpStdio(command=sys.executable, args=["-m", "flywheel.tools.mcp_serve",
                                                     WORKPLACE], sessions="shared"))
    reg = await registered("workplace", config)
    assert unsafe_tools(reg) == {"tickets_purge"}
    catalog = Catalog.of([reg])
    cfg = GroupConfig(group_size=2, rollout_timeout_s=30, max_steps=6)
    found = {}
    try:
        for env_name in ("workplace", "toolset"):
            for ok in (True, False):
                task, script = _workplace_task(env_name, ok)
                env = (load_environment("workplace") if env_name == "workplace"
                       else ToolsetEnvironment(catalog))
                policy = Lockstep(script, fmt)
                out = await run_group(policy, task, env, cfg, adapter=None, seed=0,
                                      group_key=f"{env_name}-{ok}")
                found[env_name, ok] = ([r.reward for r in out.rollouts], _results(policy))
    finally:
        await catalog.aclose()
    assert found["workplace", True] == found["toolset", True]
    assert found["workplace", True][0] == [1.0, 1.0]
    assert found["toolset", False][0] == [0.0, 0.0]  # the end state is wrong
    assert max(found["workplace", False][0]) < 1.0   # (workplace credits right sections)
    assert found["workplace", False][1] == found["toolset", False][1]  # same observations
    assert found["toolset", True][1][2].startswith("error: no ticket 'tkt-9'")


def test_verify_toolset_by_hand() -> None:
    spec = ToolsetSpec(toolset="t", expected_state={"n": 1},
                       expected_calls=[ExpectedCall(name="f", arguments={"x": 1})],
                       max_steps=2, unsafe_tools=["boom"])
    ok = {"name": "f", "arguments": {"x": 1}, "source": "live", "status": "ok"}
    good = verify_toolset(spec, {"calls": [ok], "state": {"n": 1.0}})
    assert (good.reward, good.failure_mode) == (1.0, None)
    half = verify_toolset(spec, {"calls": [ok], "state": {"n": 2}})
    assert (half.reward, half.failure_mode) == (0.25, "other")
    assert half.reward_components == {"state": 0.0, "calls": 1.0, "unsafe": 0.0}
    over = verify_toolset(spec, {"calls": [ok, ok, ok], "state": {"n": 1}})
    assert (over.reward, over.failure_mode) == (0.0, "incomplete")
    unsafe = verify_toolset(spec, {"calls": [ok, {**ok, "name": "boom"}], "state": {"n": 1}})
    assert (unsafe.reward, unsafe.failure_mode) == (0.0, "unsafe_action")
    ended = {**ok, "rule": "end"}  # the call the episode ended at did nothing
    assert verify_toolset(spec, {"calls": [ended], "state": {"n": 1}}).reward == 0.25
    with pytest.raises(ValueError, match="expected_state or expected_calls"):
        ToolsetSpec(toolset="t")


async def test_a_dry_run_answers_from_replay_or_stubs_and_never_calls_the_server(
        fmt: ChatFormat, log: Path) -> None:
    reg = await registered("notes-dry", stdio(log, sessions="shared", dry_run=True,
                                              on_divergence="live",
                                              stubs={"bump": "counter is 42 (stub)"}))
    catalog = Catalog.of([reg])
    before = len(received(log))
    policy = Lockstep(_script(tool_call("add_note", text="b"), tool_call("bump", by=9),
                              tool_call("add_note", text="z")), fmt)
    task = _task(reg, initial_state={"notes": ["a"]}, replay=LOGGED,
                 expected_calls=[ExpectedCall(name="bump", arguments={"by": 9})])
    try:
        out = await run_group(policy, task, ToolsetEnvironment(catalog),
                              GroupConfig(group_size=2, rollout_timeout_s=30, max_steps=6),
                              adapter=None, seed=0, group_key="dry")
    finally:
        await catalog.aclose()
    assert [r.reward for r in out.rollouts] == [1.0, 1.0]
    assert _results(policy) == ["added note 2 (logged)", "counter is 42 (stub)",
                                "ok (dry run: add_note was not executed)"]
    steps = [(s.source, s.rule) for t in out.rollouts[0].turns for s in t.tools or []]
    assert steps == [("replay", None), ("stub", "live"), ("stub", None)]
    assert _calls_for(log, before) == []
