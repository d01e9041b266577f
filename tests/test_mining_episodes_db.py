"""Episode tasks stored like every task (real Postgres): the miner reads the registered
toolsets, a failed multi-step trajectory on one becomes an `episode` task, the same failure
again joins it, and an episode it cannot verify is counted by reason."""

from __future__ import annotations

import copy
import uuid
from typing import Any

import pytest
from sqlalchemy import text

from flywheel.config import Topics
from flywheel.db.engine import make_engine
from flywheel.mining.demos import load_demonstrations, read_candidates
from flywheel.mining.mine_batch import MineStats, mine_batch
from flywheel.tasks import EpisodeSpec, TaskSpec
from flywheel.tools.registry import register
from flywheel.toolsets import PythonClass
from flywheel.trajectory import parse_trajectory
from tests.support.toolsets import registered
from tests.test_mining_episodes import (
    ASK,
    THEN,
    WHOLE_PATH,
    WORKPLACE,
    WRONG_FIRST_TURN,
    _record,
    _say,
)

pytestmark = [pytest.mark.postgres]
TOPICS = Topics.for_prefix("t")


async def _mine(db_url: str, records: list[dict[str, Any]]) -> MineStats:
    engine = make_engine(db_url)
    try:
        async with engine.begin() as conn:
            return await mine_batch(conn, [parse_trajectory(r) for r in records],
                                    holdout_fraction=0.2, topics=TOPICS)
    finally:
        await engine.dispose()


async def _register_workplace(db_url: str) -> None:
    """The workplace example registered as a toolset, as `flywheel tools add` does."""
    engine = make_engine(db_url)
    try:
        async with engine.begin() as conn:
            await register(conn, await registered("workplace", PythonClass(target=WORKPLACE)),
                           actor="test", topics=TOPICS)
    finally:
        await engine.dispose()


async def test_a_failed_episode_is_stored_as_an_episode_task_and_deduplicated(
        db_url: str) -> None:
    failed = _record(WRONG_FIRST_TURN, corrected=WHOLE_PATH)
    before = await _mine(db_url, [failed])  # no toolset registered yet: a single step
    assert before.episodes == 0
    await _register_workplace(db_url)
    again = [copy.deepcopy(failed), copy.deepcopy(failed)]
    for r in again:
        r["trajectory_id"] = str(uuid.uuid4())
    unverifiable = _record(WRONG_FIRST_TURN)
    stats = await _mine(db_url, [*again, unverifiable])
    assert (stats.episodes, stats.tasks_created, stats.tasks_joined) == (2, 1, 1)
    assert list(stats.episode_unverifiable.values()) == [1]
    assert next(iter(stats.episode_unverifiable)).startswith("no expected path or outcome")
    engine = make_engine(db_url)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(text(
                "SELECT env, split, spec FROM tasks WHERE env = 'toolset'"))).all()
            sources = (await conn.execute(text("""
                SELECT count(*) FROM task_sources s JOIN tasks t USING (task_id)
                WHERE t.env = 'toolset'"""))).scalar_one()
    finally:
        await engine.dispose()
    assert len(rows) == 1 and sources == 2
    task = TaskSpec.model_validate(rows[0].spec)
    assert isinstance(task.verifier, EpisodeSpec) and task.verifier.user_turns == [THEN]
    assert task.split == rows[0].split


async def test_a_logged_episode_success_is_read_as_demonstrations_turn_by_turn(
        db_url: str) -> None:
    await _register_workplace(db_url)
    items = [_say("user", ASK), *WHOLE_PATH[:2], _say("assistant", "Closed."),
             _say("user", THEN), *WHOLE_PATH[2:4], _say("assistant", "Told Ana.")]
    await _mine(db_url, [_record(items, status="success")])
    engine = make_engine(db_url)
    try:
        async with engine.connect() as conn:
            found = await read_candidates(conn)
            single_step = await load_demonstrations(conn, envs=["tool_call"])
            everything = await load_demonstrations(conn)
    finally:
        await engine.dispose()
    demos = [c.demo for c in found if c.demo.env == "toolset"]
    assert [d.reply.get("content") for d in demos] == [None, "Closed.", None, "Told Ana."]
    # A policy trained on tool_call tasks only gets no episode turns for its warm start.
    assert {d.env for d in everything} == {"toolset"} and single_step == []


async def test_no_demonstration_continues_a_holdout_episode_from_another_session(
        db_url: str) -> None:
    """A success of another session that opens with a holdout episode's request teaches that
    very conversation: the store's holdout guard refuses its turns (fingerprints never meet:
    the task's holds its verifier, a demonstration's the conversation's opening)."""
    await _register_workplace(db_url)
    items = [_say("user", ASK), *WHOLE_PATH[:2], _say("assistant", "Closed."),
             _say("user", THEN), *WHOLE_PATH[2:4], _say("assistant", "Told Ana.")]
    success = _record(items, status="success")
    success["session_id"] = "another-session"
    await _mine(db_url, [success, _record(WRONG_FIRST_TURN, corrected=WHOLE_PATH)])
    engine = make_engine(db_url)
    try:
        async with engine.begin() as conn:
            before = [d for d in await load_demonstrations(conn) if d.env == "toolset"]
            await conn.execute(text("UPDATE tasks SET split = 'holdout' WHERE env = 'toolset'"))
            after = [d for d in await load_demonstrations(conn) if d.env == "toolset"]
    finally:
        await engine.dispose()
    assert len(before) >= 4  # the success's turns (and the correction's) while train
    assert after == []
