"""Toolset sessions against real servers: MCP over stdio and streamable HTTP (the `mcp` SDK's
own server side, tests/support/mcp_toolserver.py, in processes of their own) and a Python
class. Many episodes in flight, each on its own state; faults split between what the
infrastructure failed to do (not run) and what the model did wrong (a tool error message).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from flywheel.tasks import RolloutNotRun
from flywheel.tools.descriptors import Registration
from flywheel.tools.runtime import Slots, ToolsetRuntime
from flywheel.tools.session import EpisodePlan, ToolSession
from flywheel.toolsets import McpHttp, PythonClass
from tests.support import py_toolset
from tests.support.toolsets import http_server, python, received, registered, stdio

IN_FLIGHT = 32


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("toolserver") / "calls.jsonl"


@pytest.fixture(scope="module")
def http(log: Path) -> Iterator[McpHttp]:
    with http_server(log) as (config, _proc):
        yield config


@pytest.fixture(scope="module")
async def kinds(log: Path, http: McpHttp) -> AsyncIterator[dict[str, Registration]]:
    yield {"stdio": await registered("notes-stdio", stdio(log, sessions="shared")),
           "http": await registered("notes-http", http),
           "python": await registered("notes-py", python())}


async def _open(runtime: ToolsetRuntime, n: int, initial: list[dict[str, object]] | None = None
                ) -> list[ToolSession]:
    plans = [EpisodePlan(key=f"t-{uuid.uuid4().hex[:8]}-{i}",
                         initial_state=None if initial is None else initial[i])
             for i in range(n)]
    opened = await runtime.open_sessions(plans)
    assert all(isinstance(s, ToolSession) for s in opened), opened
    return opened  # type: ignore[return-value]


def _mine(i: int, initial: bool) -> dict[str, object]:
    """What episode i's world must be after `_interleaved`, and nothing else."""
    start = [f"start-{i}"] if initial else []
    return {"notes": [*start, f"{i}-0", f"{i}-1", f"{i}-2"],
            "counter": (i if initial else 0) + 3 * (i + 1)}


async def _interleaved(runtime: ToolsetRuntime, n: int, initial: bool = True
                       ) -> tuple[list[str], list[dict[str, object] | None]]:
    """n episodes in flight, interleaved call by call: what each lists, and its end state."""
    sessions = await _open(runtime, n, [{"notes": [f"start-{i}"], "counter": i}
                                        for i in range(n)] if initial else None)
    try:
        for r in range(3):
            await asyncio.gather(*(s.call("add_note", {"text": f"{i}-{r}"})
                                   for i, s in enumerate(sessions)),
                                 *(s.call("bump", {"by": i + 1})
                                   for i, s in enumerate(sessions)))
        listed = await asyncio.gather(*(s.call("list_notes", {}) for s in sessions))
        snaps = await asyncio.gather(*(s.snapshot() for s in sessions))
    finally:
        await asyncio.gather(*(runtime.close_session(s) for s in sessions))
    return [json.dumps(json.loads(x.observation)) for x in listed], list(snaps)


async def _each_on_its_own_state(runtime: ToolsetRuntime, n: int) -> None:
    """Each episode sees only its own world — fails the moment two episodes share state."""
    listed, snaps = await _interleaved(runtime, n)
    for i, (seen, snap) in enumerate(zip(listed, snaps, strict=True)):
        assert seen == json.dumps(_mine(i, True)["notes"])
        assert snap == _mine(i, True)
    assert runtime.slots.free == runtime.slots.total


@pytest.mark.parametrize("kind", ["stdio", "http", "python"])
async def test_32_episodes_in_flight_each_on_its_own_state(
        kinds: dict[str, Registration], kind: str) -> None:
    runtime = ToolsetRuntime(kinds[kind])
    try:
        await _each_on_its_own_state(runtime, IN_FLIGHT)
    finally:
        await runtime.aclose()


async def test_a_server_process_per_episode(log: Path) -> None:
    """stdio with sessions=process: every episode has a server of its own (its own pid),
    even for a server that keeps one world for every caller and no reset protocol."""
    reg = await registered("notes-proc", stdio(log, sessions="process",
                                               env={"TOOLSERVER_KEYLESS": "1"}))
    runtime = ToolsetRuntime(reg)
    sessions = await _open(runtime, 4)
    try:
        pids = await asyncio.gather(*(s.call("whoami", {}) for s in sessions))
        await asyncio.gather(*(s.call("add_note", {"text": f"n{i}"})
                               for i, s in enumerate(sessions)))
        listed = await asyncio.gather(*(s.call("list_notes", {}) for s in sessions))
    finally:
        await asyncio.gather(*(runtime.close_session(s) for s in sessions))
    assert len({p.observation for p in pids}) == 4
    assert [x.observation for x in listed] == [f'["n{i}"]' for i in range(4)]
    for p in pids:  # closing the episode stopped its server
        with pytest.raises(ProcessLookupError):
            os.kill(int(p.observation), 0)


async def test_server_processes_start_one_at_a_time_and_the_wait_is_not_open_time(
        log: Path, tmp_path: Path) -> None:
    """3 episodes whose servers take over 1 s to start, one spawned at a time
    (`max_starting` 1; unbounded, all 3 start at once). Each is allowed 4 s to open; the last
    is open > 4 s after the first began, and none fails: waiting for a turn is not the
    session's open time."""
    starts = tmp_path / "starts.jsonl"
    reg = await registered("notes-slow", stdio(
        log, sessions="process", max_starting=1, open_timeout_s=4.0,
        env={"TOOLSERVER_START_DELAY": "1.0", "TOOLSERVER_STARTS": str(starts)}))
    runtime = ToolsetRuntime(reg)
    assert runtime.backend.start_bound == 1  # type: ignore[attr-defined]
    starts.unlink(missing_ok=True)  # registering started one to read its tools
    sessions = await _open(runtime, 3)
    await asyncio.gather(*(runtime.close_session(s) for s in sessions))
    spans = sorted((x["began"], x["ready"]) for x in map(
        json.loads, starts.read_text().splitlines()))
    assert len(spans) == 3
    assert max(sum(b <= t < r for b, r in spans) for t, _ in spans) == 1  # at once
    assert spans[-1][1] - spans[0][0] > 4.0  # longer than any one session may take


def test_only_per_episode_server_processes_are_bounded() -> None:
    from flywheel.tools.mcp_backend import McpBackend

    log = Path("/dev/null")
    assert McpBackend("a", stdio(log, sessions="process")).start_bound == len(
        os.sched_getaffinity(0))
    assert McpBackend("b", stdio(log, sessions="process", max_starting=3)).start_bound == 3
    assert McpBackend("c", stdio(log, sessions="shared")).start_bound is None
    assert McpBackend("d", McpHttp(url="http://127.0.0.1:1/mcp")).start_bound is None


async def test_a_shared_server_that_cannot_keep_episodes_apart_is_refused(log: Path) -> None:
    reg = await registered("notes-keyless", stdio(log, sessions="shared",
                                                  env={"TOOLSERVER_KEYLESS": "1"}))
    runtime = ToolsetRuntime(reg)
    try:
        (refused,) = await runtime.open_sessions([EpisodePlan(key="k")])
    finally:
        await runtime.aclose()
    assert isinstance(refused, RolloutNotRun) and refused.kind == "toolset_unavailable"
    assert "would share state" in refused.message
    assert runtime.slots.free == runtime.slots.total


@pytest.mark.parametrize("kind", ["stdio", "http", "python"])
async def test_model_mistakes_come_back_as_tool_error_messages(
        kinds: dict[str, Registration], kind: str) -> None:
    runtime = ToolsetRuntime(kinds[kind])
    (s,) = await _open(runtime, 1)
    try:
        wrong_type = await s.call("bump", {"by": "three"})
        missing = await s.call("add_note", {})
        unknown = await s.call("delete_everything", {})
        fine = await s.call("bump", {"by": 2})
    finally:
        await runtime.close_session(s)
        await runtime.aclose()
    assert wrong_type.step.status == missing.step.status == unknown.step.status == "error"
    assert "by" in wrong_type.observation and "text" in missing.observation
    assert unknown.step.source == "invalid" and "unknown tool" in unknown.observation
    assert not (wrong_type.end or missing.end or unknown.end)
    assert fine.observation == "counter is 2"  # the episode went on


@pytest.mark.parametrize("kind", ["stdio", "http", "python"])
async def test_a_hanging_tool_times_out_and_the_episode_goes_on(
        kinds: dict[str, Registration], kind: str) -> None:
    reg = kinds[kind]
    reg = reg.model_copy(update={"config": reg.config.model_copy(
        update={"call_timeout_s": 0.5})})
    runtime = ToolsetRuntime(reg)
    (s,) = await _open(runtime, 1)
    try:
        hung = await asyncio.wait_for(s.call("sleep", {"seconds": 30}), 10)
        after = await s.call("add_note", {"text": "still here"})
    finally:
        await runtime.close_session(s)
        await runtime.aclose()
    assert hung.step.status == "timeout" and "0.5s" in hung.observation
    assert hung.step.ms < 5000
    assert after.observation == "added note 1"


@pytest.mark.parametrize("kind", ["stdio", "http", "python"])
async def test_a_destructive_tool_never_runs_without_the_allowance(
        kinds: dict[str, Registration], kind: str, log: Path) -> None:
    """The server records every call it receives: the refused call never reached it; with
    the toolset's allowance it runs."""
    reg = kinds[kind]
    before = [c for c in received(log) if c["tool"] == "wipe_notes"]
    py_toolset.RECEIVED.clear()
    runtime = ToolsetRuntime(reg)
    (s,) = await _open(runtime, 1, [{"notes": ["keep me"]}])
    try:
        refused = await s.call("wipe_notes", {})
        snap = await s.snapshot()
    finally:
        await runtime.close_session(s)
        await runtime.aclose()
    assert refused.end and refused.step.source == "refused" and refused.step.unsafe
    assert snap == {"notes": ["keep me"], "counter": 0}
    assert [c for c in received(log) if c["tool"] == "wipe_notes"] == before
    assert not [c for c in py_toolset.RECEIVED if c[1] == "wipe_notes"]

    allowed = ToolsetRuntime(reg.model_copy(update={"config": reg.config.model_copy(
        update={"allow_destructive": ["wipe_notes"]})}))
    (s,) = await _open(allowed, 1, [{"notes": ["go"]}])
    try:
        ran = await s.call("wipe_notes", {})
    finally:
        await allowed.close_session(s)
        await allowed.aclose()
    assert ran.observation == "deleted 1 notes" and not ran.step.unsafe
    reached = ([c for c in received(log) if c["tool"] == "wipe_notes"] if kind != "python"
               else [c for c in py_toolset.RECEIVED if c[1] == "wipe_notes"])
    assert len(reached) == len(before) + 1 if kind != "python" else len(reached) == 1


@pytest.mark.parametrize("kind", ["stdio", "http"])
async def test_an_unannotated_mcp_tool_is_destructive_unless_the_toolset_says_otherwise(
        kinds: dict[str, Registration], kind: str, log: Path) -> None:
    """MCP's own reading: a tool whose server says nothing of its side effects may be
    destructive, so by default it never reaches the server; `unannotated_destructive=False`
    runs it."""
    reg = kinds[kind]
    assert reg.tool("clear_counter") is not None and not reg.tool("clear_counter").annotated
    before = [c for c in received(log) if c["tool"] == "clear_counter"]
    for lenient in (False, True):
        runtime = ToolsetRuntime(reg if not lenient else reg.model_copy(update={
            "config": reg.config.model_copy(update={"unannotated_destructive": False})}))
        (s,) = await _open(runtime, 1, [{"counter": 5}])
        try:
            out = await s.call("clear_counter", {})
            snap = await s.snapshot()
        finally:
            await runtime.close_session(s)
            await runtime.aclose()
        reached = [c for c in received(log) if c["tool"] == "clear_counter"]
        if lenient:
            assert out.observation == "counter is 0" and not out.step.unsafe
            assert snap is not None and snap["counter"] == 0
            assert len(reached) == len(before) + 1
        else:
            assert out.step.source == "refused" and out.step.unsafe
            assert snap is not None and snap["counter"] == 5 and reached == before


async def test_a_killed_server_leaves_its_episodes_not_run_and_the_next_one_starts(
        log: Path, kinds: dict[str, Registration]) -> None:
    """Shared stdio server killed with episodes in flight: each of their next calls is
    `toolset_unavailable` (never a tool message the model is scored on); a new episode
    gets a new server."""
    runtime = ToolsetRuntime(kinds["stdio"])
    sessions = await _open(runtime, 3)
    pid = int((await sessions[0].call("whoami", {})).observation)
    os.kill(pid, signal.SIGKILL)
    for s in sessions:
        with pytest.raises(RolloutNotRun) as lost:
            await s.call("add_note", {"text": "after the kill"})
        assert lost.value.kind == "toolset_unavailable"
        await runtime.close_session(s)
    (fresh,) = await _open(runtime, 1)
    try:
        assert int((await fresh.call("whoami", {})).observation) != pid
        assert (await fresh.call("add_note", {"text": "x"})).observation == "added note 1"
    finally:
        await runtime.close_session(fresh)
        await runtime.aclose()


async def test_a_server_that_is_down_does_not_start_sessions(log: Path) -> None:
    reg = await registered("notes-gone", stdio(log, sessions="process"))
    gone = reg.model_copy(update={"config": reg.config.model_copy(
        update={"command": "/nonexistent/mcp-server"})})
    runtime = ToolsetRuntime(gone)
    opened = await runtime.open_sessions([EpisodePlan(key="a"), EpisodePlan(key="b")])
    assert [type(o) for o in opened] == [RolloutNotRun, RolloutNotRun]
    assert all(o.kind == "toolset_unavailable" and "could not be started" in o.message
               for o in opened if isinstance(o, RolloutNotRun))
    assert runtime.slots.free == runtime.slots.total


async def test_session_slots_bound_a_toolset_and_a_group_takes_its_slots_together() -> None:
    slots = Slots(4)
    await slots.acquire(3)
    waiting = asyncio.create_task(slots.acquire(2))  # needs 2, 1 free: waits
    later = asyncio.create_task(slots.acquire(1))    # fits, but must not overtake
    await asyncio.sleep(0.01)
    assert not waiting.done() and not later.done() and slots.free == 1
    slots.release(3)
    await asyncio.wait_for(asyncio.gather(waiting, later), 1)
    assert slots.free == 1
    with pytest.raises(ValueError, match="max_sessions"):
        await slots.acquire(5)


async def test_python_tools_come_from_signatures_or_an_entry_point() -> None:
    notes = await registered("notes-py", python())
    add = notes.tool("add_note")
    assert add is not None and add.description == "Add a note."  # the first paragraph
    assert add.parameters["properties"] == {"text": {"type": "string"}}
    assert add.parameters["required"] == ["text"]
    assert notes.tool("reset") is None and notes.tool("state") is None
    assert [t.name for t in notes.tools if t.marked_destructive] == ["wipe_notes"]
    assert notes.protocol_tools == ["flywheel_reset", "flywheel_state"]
    shipped = await registered("wp", PythonClass(target="workplace"))  # flywheel.toolsets
    assert len(shipped.tools) == 9 and shipped.has_state
    assert [t.name for t in shipped.tools if t.marked_destructive] == ["tickets_purge"]


async def test_a_reference_end_state_from_calls_on_a_fresh_session(
        kinds: dict[str, Registration]) -> None:
    """What an end-state verifier compares against: the expected calls run on a fresh
    session of the toolset; a call that did nothing is refused, not built on."""
    for kind in ("python", "stdio"):
        runtime = ToolsetRuntime(kinds[kind])
        try:
            state = await runtime.end_state({"notes": ["a"]}, [
                {"name": "add_note", "arguments": {"text": "b"}},
                {"name": "bump", "arguments": {"by": 4}}])
            assert state == {"notes": ["a", "b"], "counter": 4}
            with pytest.raises(ValueError, match=r"reference call 1 \(wipe_notes\)"):
                await runtime.end_state(None, [{"name": "wipe_notes"}])
            with pytest.raises(ValueError, match=r"reference call 1 \(bump\)"):
                await runtime.end_state(None, [{"name": "bump", "arguments": {"by": "x"}}])
        finally:
            await runtime.aclose()
        assert runtime.slots.free == runtime.slots.total


async def test_the_isolation_check_catches_episodes_that_share_state(log: Path) -> None:
    """The same interleaving on a server that keeps one world for every caller, reached by
    pretending its tools are read-only (which gets past the shared-server refusal): every
    episode sees the others' notes, which is what the check above would catch."""
    reg = await registered("notes-leaky", stdio(log, sessions="shared",
                                                env={"TOOLSERVER_KEYLESS": "1"}))
    pretending = reg.model_copy(update={"tools": [
        t.model_copy(update={"annotations": {"readOnlyHint": True}}) for t in reg.tools]})
    runtime = ToolsetRuntime(pretending)
    try:
        listed, _snaps = await _interleaved(runtime, 4, initial=False)
    finally:
        await runtime.aclose()
    assert all(seen != json.dumps(_mine(i, False)["notes"]) for i, seen in enumerate(listed))
    assert all(len(json.loads(seen)) == 12 for seen in listed)  # 4 episodes × 3 notes
