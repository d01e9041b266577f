"""Episode tasks (pure): a failed multi-step trajectory on a registered toolset → one whole
episode to roll out, or the reason it cannot be verified (docs/EPISODES.md).

A failure is an episode candidate when it is multi-step (two or more assistant turns —
call turns and answers — or two or more user messages) and its toolset is registered:
named in `metadata.toolset` (`"crm"` or `{"name": "crm"}`), or else the one registered
toolset whose tools have exactly the trajectory's tool names. A candidate becomes an
`EpisodeSpec` task on env `toolset`:

* the prompt is the conversation up to and including the first user message of the turn
  the agent failed (the turn holding the classifier's failing decision; the last turn when
  no single step is to blame); the later user messages are the scripted user;
* the session starts on `metadata.environment.initial_state` when the agent logged it,
  with the calls of the earlier turns run first (`setup`); otherwise the episode replays
  the logged results (`replay`, from the failed turn on) — only on a toolset whose rule off
  the logged path is `live` (a live session brought there by `setup` and the calls
  replayed): under `end` or `mask` the right path, which leaves the failed one, could never
  succeed;
* the verifier comes from the correction, feedback or a successful retry
  (`mining.expected`): its calls are the right path — the whole conversation's calls, or
  only those from the failed turn on (the earlier turns' calls are put before them). With an
  initial state and a toolset that keeps a state snapshot, the end state is checked against
  the state that path reaches (`check_state`: any path to the same state passes) — and, when
  a correction or retry gives the path with the later user messages where they came (or
  with the answers that ended the requests before them), the state at each of those turns
  against the path's there (`reference_turns`); otherwise
  the path's calls from the failed turn on are required (a multiset). Structured feedback
  may add `expected_results` (texts that must appear among the episode's tool results) and
  `final_answer_contains` (texts the final answer must hold). `metadata.environment.
  state_ignore` (keys, e.g. ids) and `state_ordered` (lists in order) declare how end
  states compare.

Not guessed: no expected path or outcome, a path through a tool the toolset does not offer
or a destructive one, no initial state on a toolset that does not go live off the logged
path, a later user message that is not text, or several toolsets matching
is `Unverifiable` with the reason. A trajectory that is no candidate gives None (the
single-step path applies).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from flywheel.mining.build import Unverifiable, new_task, to_messages
from flywheel.mining.classify import Classification, parse_arguments
from flywheel.mining.expected import call_turns, expected_actions
from flywheel.tasks import EpisodeSpec, ExpectedCall, LoggedCall, TaskSpec
from flywheel.tools.descriptors import Registration, openai_tool
from flywheel.tools.safety import is_destructive
from flywheel.trajectory import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    Trajectory,
)

TOOLSET_KEY = "toolset"
"""The `metadata` key naming the trajectory's registered toolset."""
ENV = "toolset"


def multi_step(t: Trajectory) -> bool:
    answers = sum(1 for i in t.items if isinstance(i, MessageItem) and i.role == "assistant")
    users = sum(1 for i in t.items if isinstance(i, MessageItem) and i.role == "user")
    return len(call_turns(t.items)) + answers >= 2 or users >= 2


def registered_toolset(t: Trajectory, registrations: Sequence[Registration]
                       ) -> Registration | Unverifiable | None:
    """The trajectory's toolset among `registrations` (module doc), or None."""
    named = t.metadata.get(TOOLSET_KEY)
    if isinstance(named, dict):
        named = named.get("name")
    if isinstance(named, str):
        found = next((r for r in registrations if r.name == named), None)
        return found or Unverifiable(f"metadata.{TOOLSET_KEY} names toolset {named!r}, which "
                                     f"is not registered (flywheel tools add)")
    names = {tool.name for tool in t.tools}
    if not names:
        return None
    matches = [r for r in registrations if {x.name for x in r.tools} == names]
    if len(matches) > 1:
        return Unverifiable(f"the trajectory's tools match {len(matches)} registered toolsets "
                            f"({', '.join(sorted(r.name for r in matches))}); name one in "
                            f"metadata.{TOOLSET_KEY}")
    return matches[0] if matches else None


def toolset_tools(reg: Registration) -> list[dict[str, Any]]:
    """The toolset's tools as an episode task offers them, destructive ones `x-unsafe`."""
    return [openai_tool(x, unsafe=is_destructive(x, reg.config)) for x in reg.tools]


def logged_calls(items: Sequence[Any]) -> list[LoggedCall] | None:
    """The calls of `items` with the results logged for them (None: arguments that are not
    a JSON object)."""
    indexed = _indexed_calls(items)
    return None if indexed is None else [call for _, call in indexed]


def _indexed_calls(items: Sequence[Any]) -> list[tuple[int, LoggedCall]] | None:
    """`logged_calls`, each with the index of its item."""
    outputs = {i.call_id: i for i in items if isinstance(i, FunctionCallOutputItem)}
    out = []
    for n, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            args = parse_arguments(item.arguments)
            if args is None:
                return None
            res = outputs.get(item.call_id)
            out.append((n, LoggedCall(name=item.name, arguments=args,
                                      output=res.output if res else "",
                                      status=res.status if res else "ok")))
    return out


def _texts(feedback: object, key: str) -> list[str]:
    fb = feedback
    if isinstance(fb, str):
        try:
            fb = json.loads(fb)
        except json.JSONDecodeError:
            return []
    raw = fb.get(key) if isinstance(fb, dict) else None
    return [str(x) for x in raw if str(x).strip()] if isinstance(raw, list) else []


def _path(prefix: list[LoggedCall], found: list[ExpectedCall]
          ) -> tuple[list[ExpectedCall], list[ExpectedCall]]:
    """(the whole right path, its part from the failed turn on)."""
    head = [ExpectedCall(name=c.name, arguments=c.arguments) for c in prefix]
    starts = len(found) >= len(head) and all(
        f.name == h.name and f.arguments == h.arguments for f, h in zip(found, head, strict=False))
    return (found, found[len(head):]) if starts else ([*head, *found], found)


def _same_calls(a: Sequence[ExpectedCall | LoggedCall], b: Sequence[ExpectedCall | LoggedCall]
                ) -> bool:
    return [(x.name, x.arguments) for x in a] == [(x.name, x.arguments) for x in b]


def _left_path(items: Sequence[Any], users: list[int], calls: list[tuple[int, LoggedCall]],
               expected: list[ExpectedCall]) -> int:
    """The first user turn (of those starting at item indices `users`) at which the agent
    left `expected` when that is the whole conversation's path: the turn's calls are not the
    path's next ones, or it made none and answered while the path goes on. The last turn when
    it never left, or when `expected` does not start with the first turn's calls (it is the
    path from the failed turn on, which the classifier places)."""
    at = 0
    for k, start in enumerate(users):
        end = users[k + 1] if k + 1 < len(users) else len(items)
        made = [c for n, c in calls if start <= n < end]
        if not _same_calls(made, expected[at:at + len(made)]):
            return k if k > 0 or not made else len(users) - 1
        if not made and at < len(expected) and any(
                isinstance(i, MessageItem) and i.role == "assistant" for i in items[start:end]):
            return k
        at += len(made)
    return len(users) - 1


def _turn_counts(items: Sequence[Any], later: list[str], calls: int, offset: int) -> list[int]:
    """Where the right path stands at each later user message: the calls `items` (a
    correction or a retry giving the path, `calls` of them) make before each of its last
    `len(later)` user messages — or, in items with no user message, by each of the answers
    that end the requests before them (an assistant message with no call ends a turn, as in
    the rollout loop) — plus `offset` (the path's calls before its first item). Empty when
    the user messages are not `later`, there are too few answers, or the calls are not the
    path's."""
    made, users, answers = 0, [], []
    for item in items:
        if isinstance(item, FunctionCallItem):
            made += 1
        elif isinstance(item, MessageItem) and item.role == "user":
            users.append((item.content, made))
        elif isinstance(item, MessageItem) and item.role == "assistant":
            answers.append(made)
    if made != calls or not later:
        return []
    if users:
        tail = users[len(users) - len(later):] if len(users) >= len(later) else []
        return [offset + n for _, n in tail] if [u for u, _ in tail] == later else []
    # The last answer ends the last request; the len(later) before it end the requests
    # each later user message follows.
    if len(answers) < len(later) + 1:
        return []
    return [offset + n for n in answers[len(answers) - len(later) - 1:-1]]


def _check_path(reg: Registration, path: list[ExpectedCall]) -> str | None:
    for call in path:
        tool = reg.tool(call.name)
        if tool is None:
            return (f"the expected path calls {call.name}, which toolset {reg.name!r} does not "
                    f"offer")
        if is_destructive(tool, reg.config):
            return (f"the expected path calls destructive tool {call.name}: a reference end "
                    f"state is never built through one")
    return None


def build_episode(t: Trajectory, c: Classification, registrations: Sequence[Registration], *,
                  retry: Trajectory | None = None, holdout_fraction: float = 0.2
                  ) -> TaskSpec | Unverifiable | None:
    """The episode task of failed trajectory `t`, why it cannot be one, or None (module doc)."""
    if not multi_step(t):
        return None
    reg = registered_toolset(t, registrations)
    if reg is None or isinstance(reg, Unverifiable):
        return reg
    users = [(n, i) for n, i in enumerate(t.items)
             if isinstance(i, MessageItem) and i.role == "user"]
    if not users:
        return Unverifiable("no user request in the conversation")
    calls = _indexed_calls(t.items)
    if calls is None:
        return Unverifiable("a logged call's arguments are not a JSON object")
    found = expected_actions(t, retry)
    failed_at = c.step if c.step is not None else len(t.items) - 1
    turn = max([k for k, (n, _) in enumerate(users) if n <= failed_at], default=0)
    if found is not None:
        turn = min(turn, _left_path(t.items, [n for n, _ in users], calls, found.calls))
    start = users[turn][0]
    later = [u.content for _, u in users[turn + 1:]]
    if not all(isinstance(u, str) for u in later):
        return Unverifiable("a later user message is not plain text: the scripted user "
                            "gives text")
    prefix = [c for n, c in calls if n < start]
    logged = [c for n, c in calls if n >= start]
    feedback = t.outcome.feedback if t.outcome is not None else None
    results = _texts(feedback, "expected_results")
    answer = _texts(feedback, "final_answer_contains")
    if found is None and not results and not answer:
        return Unverifiable("no expected path or outcome: no correction, structured feedback "
                            "or successful retry in the session")
    path, rest = _path(prefix, found.calls if found else [])
    broken = _check_path(reg, path)
    if broken:
        return Unverifiable(broken)
    if not results and not answer and _same_calls(rest, logged):
        return Unverifiable("the expected calls are the ones the agent made from the failed "
                            "turn on: what failed is not in the calls, and no tool results or "
                            "answer content are expected that could show it")
    env_meta = t.metadata.get("environment")
    env_meta = env_meta if isinstance(env_meta, dict) else {}
    initial = env_meta.get("initial_state")
    initial = initial if isinstance(initial, dict) else None
    if initial is None and reg.config.on_divergence != "live":
        return Unverifiable(f"no initial state logged, and toolset {reg.name!r} answers a call "
                            f"off the logged path with {reg.config.on_divergence!r}: the right "
                            f"path leaves the failed one, so no attempt could succeed (log "
                            f"metadata.environment.initial_state, or on_divergence live)")
    check_state = initial is not None and reg.has_state and bool(rest)
    required = [] if check_state else rest
    if not (check_state or required or results or answer):
        return Unverifiable("nothing to check: the expected path adds no call after the "
                            "earlier turns, and no results or answer content are expected")
    turns: list[int] = []
    if check_state and found is not None and later:
        hi = t.outcome.human_intervention if t.outcome is not None else None
        source = (hi.corrected_items if found.source == "human_correction" and hi is not None
                  else retry.items if retry is not None and found.source.startswith("retry:")
                  else [])
        turns = _turn_counts(source, [str(u) for u in later], len(found.calls),
                             len(path) - len(found.calls))
    unsafe = sorted(x.name for x in reg.tools if is_destructive(x, reg.config))
    ignore = env_meta.get("state_ignore")
    repeats = Counter(json.dumps([p.name, p.arguments], sort_keys=True) for p in path)
    verifier = EpisodeSpec(
        toolset=reg.name, toolset_version=reg.version, initial_state=initial,
        setup=prefix, replay=None if initial is not None else logged,
        user_turns=[str(u) for u in later], reference_calls=path if check_state else [],
        check_state=check_state, reference_turns=turns,
        state_ignore=[str(k) for k in ignore] if isinstance(ignore, list) else [],
        state_unordered=not env_meta.get("state_ordered", False),
        required_calls=required, expected_results=results, answer_contains=answer,
        max_steps=max(8, 2 * len(path)), max_repeats=max([3, *repeats.values()]),
        unsafe_tools=unsafe)
    return new_task(ENV, to_messages(t.items[:start + 1]), toolset_tools(reg), verifier,
                    failure_mode=c.mode, holdout_fraction=holdout_fraction)
