"""The simulated helpdesk agent (`flywheel simulate --agents 4`): multi-turn conversations on
its registered `workplace` toolset, mined into episode tasks (counted by failure mode, the
unverifiable ones by reason), and every mined episode won by the conversation done right and
lost by the conversation as it was logged — through the rollout loop on the toolset, replies
scripted (the point is the simulator, the miner and the verifier together, not a model)."""

from __future__ import annotations

import json
import random
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

from flywheel.bench.episode_learning import split_episodes
from flywheel.bench.episodes import mine_failure, paired_tasks
from flywheel.demo import simulate_episodes as desk
from flywheel.demo.simulate import _Session, simulate
from flywheel.environments.toolset import ToolsetEnvironment
from flywheel.environments.workplace_world import apply_call
from flywheel.mining.build import split_of
from flywheel.mining.demos import Candidate, Demonstration, HeldOut, holdout_episode_prompt
from flywheel.mining.mine_batch import MineStats
from flywheel.policy.chat_format import ChatFormat, load_chat_format
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import EpisodeSpec, TaskSpec
from flywheel.tools.descriptors import Registration
from flywheel.tools.runtime import Catalog
from flywheel.toolsets import PythonClass
from flywheel.trajectory import FunctionCallItem, MessageItem, parse_trajectory
from tests.support.scripted import Scripted, tool_call
from tests.support.toolsets import registered

WORKPLACE = "flywheel.environments.workplace_tools:WorkplaceTools"


@pytest.fixture(scope="module")
async def workplace() -> AsyncIterator[Registration]:
    yield await registered(desk.TOOLSET, PythonClass(target=WORKPLACE))


def test_simulated_helpdesk_logs_are_multi_step_and_replay_as_they_happened() -> None:
    records = [r for r in simulate(1600, agents=4, failure_rate=0.4, seed=11)
               if r["agent"] == desk.AGENT]
    assert len(records) >= 300
    logs = [parse_trajectory(r) for r in records]
    users = [sum(1 for i in t.items if isinstance(i, MessageItem) and i.role == "user")
             for t in logs]
    assert min(users) >= 2 and max(users) == 3
    assert all(t.metadata["toolset"] == desk.TOOLSET for t in logs)
    logged_state = sum(1 for t in logs if "environment" in t.metadata)
    assert 0.8 * len(logs) < logged_state < len(logs)  # some agents do not log their state
    # Every logged result is the world's answer to the call on the logged state.
    for t in (t for t in logs if "environment" in t.metadata):
        state = t.metadata["environment"]["initial_state"]
        outputs = {i.call_id: i.output for i in t.items if i.type == "function_call_output"}
        for item in t.items:
            if isinstance(item, FunctionCallItem):
                state, observation = apply_call(state, item.name, item.arguments)
                assert outputs[item.call_id] == observation


def test_simulated_failures_mine_into_episodes_by_failure_mode_and_unverifiable_by_reason(
        workplace: Registration) -> None:
    logs = [parse_trajectory(r) for r in simulate(1600, agents=4, failure_rate=0.4, seed=11)
            if r["agent"] == desk.AGENT]
    failed = [t for t in logs if not t.is_success]
    stats, modes = MineStats(), Counter[str]()
    per_turn = 0
    for t in failed:
        task = mine_failure(t, logs, [workplace], stats)
        if isinstance(task, TaskSpec) and isinstance(task.verifier, EpisodeSpec):
            modes[task.failure_mode] += 1
            per_turn += bool(task.verifier.reference_turns)
    unverifiable = stats.episode_unverifiable
    # Episodes with later user turns whose correction or retry shows where each request
    # ended check the state at each of those turns (36 of them at this seed).
    assert per_turn >= 30
    print(f"{len(logs)} logs, {len(failed)} failed: {stats.episodes} episodes "
          f"{dict(modes)}; unverifiable {dict(unverifiable)}")
    # Each failure is an episode or is counted with its reason; none is dropped or guessed.
    assert stats.episodes + sum(unverifiable.values()) == len(failed)
    assert stats.episodes >= 0.6 * len(failed)
    assert set(modes) == {"bad_arguments", "wrong_tool", "timeout", "unsafe_action",
                          "incomplete", "other"}
    reasons = {r.split(":")[0].split(",")[0] for r in unverifiable}
    assert reasons == {"no expected path or outcome", "no initial state logged",
                       "the expected calls are the ones the agent made from the failed turn on"}


def _replies(items: list[dict[str, Any]], turn: int) -> list[str]:
    """What the agent said from user turn `turn` on (logged items), as a model writes it."""
    users = [n for n, i in enumerate(items) if i.get("role") == "user"]
    out = []
    for item in items[users[turn]:]:
        if item["type"] == "function_call":
            out.append(tool_call(item["name"], **json.loads(item["arguments"])))
        elif item.get("role") == "assistant":
            out.append(str(item["content"]))
    return out


def _script(replies: list[str], before: int) -> Any:
    async def reply(messages: list[dict[str, Any]], _seed: int | None, _i: int) -> str:
        done = sum(1 for m in messages if m["role"] == "assistant") - before
        return replies[done] if done < len(replies) else ""
    return reply


async def test_every_mined_episode_is_won_by_the_right_conversation_and_lost_by_the_logged_one(
        workplace: Registration) -> None:
    fmt: ChatFormat = load_chat_format(resolve_model_dir(None))
    catalog, outcomes = Catalog.of([workplace]), Counter[tuple[str, str]]()
    config = GroupConfig(group_size=2, rollout_timeout_s=30, max_steps=8)
    try:
        for shape in desk.SHAPES:
            for n in range(10):
                rng = random.Random(f"{shape}-{n}")
                planned = desk.plan_session(rng, shape)
                session = _Session(rng, desk.AGENT, datetime(2026, 11, 1, tzinfo=UTC))
                records = desk.session(rng, session.record, shape, planned)
                logs = [parse_trajectory(r) for r in records]
                task = mine_failure(logs[0], logs, [workplace], MineStats())
                if not (isinstance(task, TaskSpec) and isinstance(task.verifier, EpisodeSpec)):
                    continue
                turn = sum(1 for m in task.messages if m["role"] == "user") - 1
                before = sum(1 for m in task.messages if m["role"] == "assistant")
                right = _replies(planned.right_conversation(rng), turn)
                logged = _replies(records[0]["items"], turn)
                won, lost = [await run_group(Scripted(_script(replies, before), fmt), task,
                                             ToolsetEnvironment(catalog), config, adapter=None,
                                             seed=0, group_key=f"{key}-{shape}-{n}")
                             for key, replies in (("right", right), ("logged", logged))]
                context = (shape, n, task.failure_mode, lost.rollouts[0].reason)
                assert [r.reward for r in won.rollouts] == [1.0, 1.0], (context, won.rollouts)
                assert all(r.reward is not None and r.reward < 1.0 for r in lost.rollouts), \
                    context
                outcomes[shape, str(lost.rollouts[0].reason).split(":")[0]] += 1
    finally:
        await catalog.aclose()
    print(dict(outcomes))
    by_shape = Counter(shape for shape, _ in outcomes.elements())
    assert all(by_shape[shape] >= 4 for shape in desk.SHAPES), by_shape


def test_the_episode_bench_pairs_each_failure_mined_both_ways(workplace: Registration) -> None:
    pairs = paired_tasks(workplace, 6, seed=5)
    assert len(pairs) == 6
    for episode, single in pairs:
        assert episode.env == "toolset" and single.env == "tool_call"
        assert isinstance(episode.verifier, EpisodeSpec)
        # The same conversation (where each cuts it is its own rule).
        assert single.messages[:2] == episode.messages[:2]
        assert single.messages[1]["role"] == "user"


def test_episode_learning_never_teaches_a_holdout_session(workplace: Registration) -> None:
    """`flywheel bench episode-learning`'s split: holdout episodes by the miner's fingerprint
    split, and no demonstration (a correction's or a success's turn) from a session that holds
    one — a held-out conversation's own right turns would be shown to SFT otherwise."""
    train, holdout, demos, counts = split_episodes(workplace, 1600, 11, 0.2)
    assert counts["episodes_train"] == len(train) and counts["episodes_holdout"] == len(holdout)
    assert len(holdout) >= 10 and len(train) >= 3 * len(holdout)
    assert all(split_of(t.fingerprint, 0.2) == "holdout" for t in holdout)
    assert not {t.fingerprint for t in train} & {t.fingerprint for t in holdout}
    assert counts["demonstrations"]["from_corrections"] > 0
    assert counts["demonstrations"]["from_successes"] > 0
    logs = [parse_trajectory(r) for r in simulate(1600, agents=4, failure_rate=0.4, seed=11)
            if r["agent"] == desk.AGENT]
    held_prompts = {json.dumps(t.messages) for t in holdout}
    held_sessions = set()
    for t in (t for t in logs if not t.is_success):
        task = mine_failure(t, logs, [workplace], MineStats())
        if isinstance(task, TaskSpec) and json.dumps(task.messages) in held_prompts:
            held_sessions.add(t.session_id)
    assert len(held_sessions) >= len(holdout) // 2
    by_id = {t.trajectory_id: t.session_id for t in logs}
    assert all(by_id[d.source_trajectory_id] not in held_sessions for d in demos)


def test_a_demonstration_continuing_a_holdout_episode_prompt_is_refused(
        workplace: Registration) -> None:
    """Another session's turn whose prompt starts with a holdout episode's prompt (call ids
    drawn anew, whitespace aside) teaches that very conversation: `HeldOut` refuses it; a
    prompt that differs in one argument is another question and is admitted."""
    _train, holdout, _demos, _counts = split_episodes(workplace, 1600, 11, 0.2)
    task = next(t for t in holdout if any(m.get("tool_calls") for m in t.messages))
    entry = holdout_episode_prompt(task)
    assert entry is not None
    held = HeldOut(episode_prompts=frozenset({entry}))

    def demo(messages: list[dict[str, Any]]) -> Demonstration:
        return Demonstration(messages=messages, tools=[dict(t) for t in task.tools],
                             reply={"role": "assistant", "content": "Done."},
                             source_trajectory_id=uuid.uuid4(), fingerprint="f" * 64,
                             env="toolset")

    same = json.loads(json.dumps(task.messages).replace("call_", "call_x"))
    same[-1]["content"] = "  " + same[-1]["content"] + " "
    later = [*same, {"role": "assistant", "content": "On it."},
             {"role": "user", "content": "And one more thing."}]
    assert not held.admits(Candidate(demo(same), (uuid.uuid4(),), ()))
    assert not held.admits(Candidate(demo(later), (uuid.uuid4(),), ()))
    other = json.loads(json.dumps(task.messages))
    call = next(m for m in other if m.get("tool_calls"))["tool_calls"][0]["function"]
    call["arguments"] = json.dumps({**json.loads(call["arguments"]), "zzz": 1})
    assert held.admits(Candidate(demo(other), (uuid.uuid4(),), ()))
    assert held.admits(Candidate(demo(same[:-1]), (uuid.uuid4(),), ()))  # shorter: no leak
