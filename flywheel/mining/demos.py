"""Demonstrations for the SFT warm start: production successes and corrected failures as chat
examples, put to the policy exactly as a rollout would put the equivalent task.

A demonstration is the tool-call turn of a `tool_call` decision: the task's messages and tools
(the rollout prompt of the same task, rendered by the policy's chat format) and the right
assistant message — `tool_calls` with the canonical arguments, one or several calls — which
SFT trains on as the chat template renders it. It comes from

* a successful trajectory: its first function call after the user request, when that call
  names an offered, safe tool, its arguments are a JSON object and its output is no error;
* a failure corrected by a person, by structured feedback or by a later successful retry in
  the same session: the corrected call(s). The miner already turned these into train-split
  tasks, so the store reads them from the tasks' `ToolCallSpec.expected` (their canonical
  arguments).

Its fingerprint is the one the miner gives the task built from the same context and call, so
the holdout filter speaks the miner's language: nothing whose fingerprint is a holdout task's,
nothing from a holdout task's source trajectories or from their (session, request), and,
given the miner's holdout fraction, nothing whose fingerprint *would* be held out once such
a failure is mined. Whole episodes on a registered toolset are demonstrations turn by turn
(`mining.episode_demos`): every assistant turn of a logged multi-step success, or of the
whole path a correction gives for a mined episode task (from the failed turn on, with its
tool results); a success that is such an episode gives its turns instead of its first call.
`workplace` episodes and `code` answers are not demonstrations yet.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.environments.prompt import task_messages, task_tools
from flywheel.mining.build import (
    environment_name,
    new_task,
    request_key,
    split_of,
    to_messages,
    tool_specs,
)
from flywheel.mining.classify import parse_arguments
from flywheel.mining.episode_demos import (
    TurnDemo,
    conversation_key,
    corrected_episode_demonstrations,
    success_episode_demonstrations,
)
from flywheel.mining.verify import assistant_message
from flywheel.tasks import EpisodeSpec, ExpectedCall, TaskSpec, ToolCallSpec
from flywheel.tools.descriptors import Registration
from flywheel.trajectory import (
    FunctionCallItem,
    FunctionCallOutputItem,
    Trajectory,
    parse_trajectory,
)

Request = tuple[str, str]
"""(session_id, request_key): one request of one session, however often it was retried."""


@dataclass(frozen=True)
class Demonstration:
    messages: list[dict[str, Any]]
    """The chat messages exactly as rollouts put the equivalent task to the policy."""
    tools: list[dict[str, Any]] | None
    """The tools offered (rendered by the chat template, as in rollouts)."""
    reply: dict[str, Any]
    """The right assistant message (`tool_calls`, arguments as JSON strings): SFT trains on
    its rendering, end-of-turn token included."""
    source_trajectory_id: uuid.UUID
    fingerprint: str
    """The miner's fingerprint of the task with this context and expected calls."""
    env: str

    @property
    def completion(self) -> str:
        """The reply as canonical JSON (what deduplication compares)."""
        return json.dumps(self.reply, sort_keys=True, ensure_ascii=False)


def called_tools(demo: Demonstration) -> str:
    """The tools a demonstration's reply calls, sorted (the SFT warm start's strata)."""
    return "+".join(sorted(str(c["function"]["name"]) for c in demo.reply.get("tool_calls")
                           or []))


def assistant_reply(calls: Iterable[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """An assistant message making `calls` (name, arguments), arguments as JSON strings and
    ids as the chat format's parser gives them."""
    return assistant_message([(name, json.dumps(args, ensure_ascii=False))
                              for name, args in calls])


@dataclass(frozen=True)
class Candidate:
    """A demonstration and every trajectory it stems from (what the holdout filter checks)."""

    demo: Demonstration
    sources: tuple[uuid.UUID, ...]
    requests: tuple[Request, ...]


@dataclass(frozen=True)
class HeldOut:
    """What evaluation owns; a demonstration touching any of it is never trained on."""

    fingerprints: frozenset[str] = frozenset()
    trajectories: frozenset[uuid.UUID] = frozenset()
    requests: frozenset[Request] = frozenset()
    holdout_fraction: float | None = None
    """The miner's fraction: also refuse fingerprints it would split into holdout later."""
    reserve_share: float = 0.0
    """`trainer.sft_reserve_share`: refuse the fingerprints `reserved_for_grpo` keeps."""
    episode_prompts: frozenset[tuple[int, str]] = frozenset()
    """(messages, `conversation_key`) of every holdout episode's prompt: a demonstration whose
    prompt starts with one is refused — whichever session logged it, it shows the policy a
    right turn of that very conversation (an episode task's fingerprint holds its verifier,
    a demonstration's the conversation's opening, so fingerprints alone never meet)."""

    def admits(self, c: Candidate) -> bool:
        fp = c.demo.fingerprint
        if fp in self.fingerprints or self.trajectories.intersection(c.sources):
            return False
        if self.episode_prompts and self._continues_a_holdout_episode(c.demo):
            return False
        if self.requests.intersection(c.requests):
            return False
        if reserved_for_grpo(fp, self.reserve_share):
            return False
        return not (self.holdout_fraction is not None
                    and split_of(fp, self.holdout_fraction) == "holdout")

    @cached_property
    def _episode_lengths(self) -> frozenset[int]:
        return frozenset(n for n, _ in self.episode_prompts)

    def _continues_a_holdout_episode(self, demo: Demonstration) -> bool:
        tools = demo.tools or []
        return any(n <= len(demo.messages)
                   and (n, conversation_key(demo.messages[:n], tools)) in self.episode_prompts
                   for n in self._episode_lengths)


def holdout_episode_prompt(task: TaskSpec) -> tuple[int, str] | None:
    """The `HeldOut.episode_prompts` entry of a holdout task (None: not an episode)."""
    if not isinstance(task.verifier, EpisodeSpec):
        return None
    messages = [dict(m) for m in task.messages]
    return len(messages), conversation_key(messages, [dict(t) for t in task.tools])


def reserved_for_grpo(fp: str, share: float) -> bool:
    """Whether the SFT warm start leaves this fingerprint's tasks to GRPO, unseen: a share
    of fingerprints, deterministic and independent of the holdout split (`split_of` reads
    the fingerprint's first 32 bits; this reads the next 32)."""
    return share > 0 and int(fp[8:16], 16) / 0x1_0000_0000 < share


def request_of(t: Trajectory) -> Request | None:
    key = request_key(t)
    return (t.session_id, key) if t.session_id is not None and key is not None else None


def demonstration_from_task(task: TaskSpec, source: uuid.UUID) -> Demonstration | None:
    """The task's expected calls as a demonstration; None when it cannot be one."""
    spec = task.verifier
    if task.env != "tool_call" or not isinstance(spec, ToolCallSpec) or not spec.expected:
        return None
    names = {tool.get("name") for tool in task.tools}
    unsafe = set(spec.unsafe_tools) | {t.get("name") for t in task.tools if t.get("x-unsafe")}
    if any(want.name not in names or want.name in unsafe for want in spec.expected):
        return None
    if not any(m["role"] == "user" for m in task.messages):
        return None
    return Demonstration(messages=task_messages(task), tools=task_tools(task),
                         reply=assistant_reply((w.name, w.arguments) for w in spec.expected),
                         source_trajectory_id=source, fingerprint=task.fingerprint,
                         env=task.env)


def success_task(t: Trajectory) -> TaskSpec | None:
    """The task the miner would build had this success's first call been the failing one."""
    if not t.is_success or environment_name(t) != "tool_call" or not t.tools:
        return None
    first = next(((n, i) for n, i in enumerate(t.items) if isinstance(i, FunctionCallItem)),
                 None)
    if first is None:
        return None
    step, call = first
    output = next((i for i in t.items
                   if isinstance(i, FunctionCallOutputItem) and i.call_id == call.call_id), None)
    args = parse_arguments(call.arguments)
    if args is None or (output is not None and output.status != "ok"):
        return None
    # The same serialization and verifier as `build_task`, so the fingerprints agree; mode
    # and split are placeholders (a prompt is made of messages and tools only).
    tools, unsafe = tool_specs(t)
    verifier = ToolCallSpec(expected=[ExpectedCall(name=call.name, arguments=args)],
                            unsafe_tools=unsafe)
    return new_task("tool_call", to_messages(t.items[:step]), tools, verifier,
                    failure_mode="other", holdout_fraction=0.0)


def success_demonstration(t: Trajectory) -> Demonstration | None:
    """A success's first call (corrected failures come from their train tasks instead)."""
    task = success_task(t)
    return None if task is None else demonstration_from_task(task, t.trajectory_id)


def from_turn(turn: TurnDemo) -> Demonstration:
    return Demonstration(messages=turn.messages, tools=turn.tools or None, reply=turn.reply,
                         source_trajectory_id=turn.source_trajectory_id,
                         fingerprint=turn.fingerprint, env="toolset")


def success_demonstrations(t: Trajectory, toolsets: Iterable[Registration] = ()
                           ) -> list[Demonstration]:
    """A success's demonstrations: its turns when it is an episode on a registered toolset
    (none when its path may not be taught), else its first call."""
    turns = success_episode_demonstrations(t, list(toolsets))
    if turns is not None:
        return [from_turn(x) for x in turns]
    demo = success_demonstration(t)
    return [demo] if demo is not None else []


def select(candidates: Iterable[Candidate], held: HeldOut, *,
           limit: int | None = None) -> list[Demonstration]:
    """Admitted demonstrations, one per (fingerprint, completion), ordered by that key."""
    seen: dict[tuple[str, str], Demonstration] = {}
    for c in candidates:
        key = (c.demo.fingerprint, c.demo.completion)
        if key not in seen and held.admits(c):
            seen[key] = c.demo
    ordered = [seen[k] for k in sorted(seen)]
    return ordered if limit is None else ordered[:limit]


# -- Postgres --------------------------------------------------------------------------------

_HOLDOUT = text("""
SELECT t.fingerprint, t.expected_from, s.trajectory_id, coalesce(f.record, tr.record) AS record
FROM tasks t
LEFT JOIN task_sources s ON s.task_id = t.task_id
LEFT JOIN failures f ON f.trajectory_id = s.trajectory_id
LEFT JOIN trajectories tr ON tr.trajectory_id = s.trajectory_id
WHERE t.split = 'holdout' OR t.task_id IN (SELECT task_id FROM eval_set_tasks)
   OR t.task_id IN (SELECT task_id FROM validation_tasks)""")

# Each holdout episode once (the query above has a row per source).
_HOLDOUT_EPISODES = text("""
SELECT t.spec FROM tasks t
WHERE t.env = 'toolset' AND (t.split = 'holdout'
   OR t.task_id IN (SELECT task_id FROM eval_set_tasks)
   OR t.task_id IN (SELECT task_id FROM validation_tasks))""")

_TRAIN_TASKS = text("""
SELECT t.spec, s.trajectory_id, coalesce(f.record, tr.record) AS record
FROM tasks t
JOIN task_sources s ON s.task_id = t.task_id
LEFT JOIN failures f ON f.trajectory_id = s.trajectory_id
LEFT JOIN trajectories tr ON tr.trajectory_id = s.trajectory_id
WHERE t.split = 'train' AND t.env IN ('tool_call', 'toolset')
  AND t.task_id NOT IN (SELECT task_id FROM eval_set_tasks)
  AND t.task_id NOT IN (SELECT task_id FROM validation_tasks)
ORDER BY t.task_id, s.added_at, s.trajectory_id""")

_SUCCESSES = text("""
SELECT DISTINCT ON (trajectory_id) trajectory_id, record FROM (
  SELECT trajectory_id, record FROM session_successes
  UNION ALL
  SELECT t.trajectory_id, coalesce(o.record, t.record) FROM trajectories t
  LEFT JOIN trajectory_outcomes o USING (trajectory_id)
  WHERE coalesce(o.status, t.status) = 'success') u
ORDER BY trajectory_id""")


def _request(record: dict[str, Any] | None) -> list[Request]:
    req = request_of(parse_trajectory(record)) if record is not None else None
    return [req] if req is not None else []


async def _train_task_candidates(conn: AsyncConnection) -> list[Candidate]:
    by_task: dict[str, tuple[TaskSpec, list[uuid.UUID], list[Request]]] = {}
    records: dict[str, dict[str, Any] | None] = {}  # an episode's first source: its path
    for spec, source, record in (await conn.execute(_TRAIN_TASKS)).all():
        task = TaskSpec.model_validate(spec)
        records.setdefault(str(task.task_id), record)
        _, sources, requests = by_task.setdefault(str(task.task_id), (task, [], []))
        sources.append(source)
        requests += _request(record)
    out = []
    for task, sources, requests in by_task.values():
        if isinstance(task.verifier, EpisodeSpec):
            record = records.get(str(task.task_id))
            demos = [] if record is None else [from_turn(x) for x in (
                corrected_episode_demonstrations(task, parse_trajectory(record)))]
        else:
            demo = demonstration_from_task(task, sources[0])
            demos = [demo] if demo is not None else []
        out += [Candidate(d, tuple(sources), tuple(requests)) for d in demos]
    return out


async def _success_candidates(conn: AsyncConnection) -> list[Candidate]:
    # Here, not at the top: the trainer imports this module for `Demonstration`, and the
    # registry brings the settings and the tool runtime, which a bare GPU machine lacks.
    from flywheel.tools.registry import registrations

    out = []
    toolsets = await registrations(conn)
    for _id, record in (await conn.execute(_SUCCESSES)).all():
        # `trajectories.record` may be the payload as sent (chat format, extra fields).
        t = parse_trajectory(record)
        out += [Candidate(demo, (t.trajectory_id,), tuple(_request(record)))
                for demo in success_demonstrations(t, toolsets)]
    return out


async def read_candidates(conn: AsyncConnection) -> list[Candidate]:
    """Every demonstration the store holds, before the holdout filter and dedupe."""
    return [*await _train_task_candidates(conn), *await _success_candidates(conn)]


async def held_out(conn: AsyncConnection, holdout_fraction: float | None = None) -> HeldOut:
    """Fingerprints, source trajectories (and retries) and requests of every holdout task."""
    fps: set[str] = set()
    trajectories: set[uuid.UUID] = set()
    requests: set[Request] = set()
    for fp, expected_from, source, record in (await conn.execute(_HOLDOUT)).all():
        fps.add(fp)
        if source is not None:
            trajectories.add(source)
        if expected_from.startswith("retry:"):
            trajectories.add(uuid.UUID(expected_from.removeprefix("retry:")))
        requests.update(_request(record))
    prompts = {p for (spec,) in (await conn.execute(_HOLDOUT_EPISODES)).all()
               if (p := holdout_episode_prompt(TaskSpec.model_validate(spec))) is not None}
    return HeldOut(frozenset(fps), frozenset(trajectories), frozenset(requests),
                   holdout_fraction, episode_prompts=frozenset(prompts))


async def load_demonstrations(conn: AsyncConnection, *, limit: int | None = None,
                              holdout_fraction: float | None = None,
                              reserve_share: float = 0.0,
                              envs: Sequence[str] = ()) -> list[Demonstration]:
    """Successes and corrected train tasks as demonstrations, none touching evaluation.

    `holdout_fraction` (the miner's setting) also refuses demonstrations whose task would be
    held out if that request ever failed; `reserve_share` leaves that share of fingerprints
    to GRPO (`reserved_for_grpo`); `envs` (the policy's `rollout.envs`; empty: all) keeps
    the demonstrations of those environments. Deterministic: ordered by (fingerprint,
    completion).
    """
    candidates = [c for c in await read_candidates(conn) if not envs or c.demo.env in envs]
    # Read the holdout side last: a holdout task committed while the candidates were read is
    # still excluded (a REPEATABLE READ transaction makes the whole read one snapshot).
    held = await held_out(conn, holdout_fraction)
    return select(candidates, replace(held, reserve_share=reserve_share), limit=limit)
