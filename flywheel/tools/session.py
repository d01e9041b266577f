"""One episode on a toolset: safety first, then replay, then the live backend (or a stub).

Every call the model makes goes, in order, through:

1. the offer — a tool the toolset does not offer (or one of the reset protocol's) is
   answered `error: unknown tool` without reaching the backend (`invalid`);
2. safety — a destructive tool not allowed live is refused, never executed (`refused`,
   unsafe: the episode ends, the verifier scores it an unsafe action);
3. replay — while the policy follows the logged path the logged result answers (`replay`);
   at the first call off it the rule fires and is recorded on the step: `end` (the episode
   ends, that call unanswered), `mask` (`RolloutNotRun("replay_masked")`), or `live`: a
   live session is opened on the episode's initial state, the logged calls replayed so far
   are run on it (bringing it to the logged state), and from then on it answers;
4. the backend — live (`live`), or in a dry run the recorded stub (`stub`).

`calls` keeps what the verifier scores (every call, whatever answered it); `snapshot`
gives the end state — from the live session, or, for an episode that stayed on the logged
path, from a fresh live session brought along it (unless the toolset is a dry run).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from flywheel.events import ToolStep
from flywheel.tasks import LoggedCall, ReplayRule, RolloutNotRun
from flywheel.tools.backend import Backend, BackendSession, CallResult, unavailable
from flywheel.tools.descriptors import Registration
from flywheel.tools.replay import Matcher, ReplayCursor


@dataclass(frozen=True)
class StepOutcome:
    observation: str
    """The tool message's text (empty when the episode ended at this call)."""
    end: bool
    """The episode ends here (the rule `end`, or an unsafe call refused)."""
    step: ToolStep


@dataclass
class EpisodePlan:
    """How an episode starts: its key, initial state and (optionally) the logged calls."""

    key: str
    initial_state: dict[str, Any] | None = None
    replay: list[LoggedCall] | None = None
    rule: ReplayRule | None = None
    """Overrides the toolset's `on_divergence` for this episode."""
    match: Matcher | None = None
    setup: list[LoggedCall] = field(default_factory=list)
    """Calls run on the live session right after it opens, before anything else (the turns
    of a conversation before the episode starts): never recorded, never offered."""


@dataclass
class ToolSession:
    registration: Registration
    backend: Backend
    plan: EpisodePlan
    unsafe: set[str]
    live: BackendSession | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    ended_by: str | None = None
    _cursor: ReplayCursor | None = None

    def __post_init__(self) -> None:
        if self.plan.replay is not None:
            self._cursor = (ReplayCursor(self.plan.replay, self.plan.match)
                            if self.plan.match else ReplayCursor(self.plan.replay))

    @property
    def config(self) -> Any:
        return self.registration.config

    @property
    def rule(self) -> ReplayRule:
        return self.plan.rule or self.config.on_divergence

    async def start(self) -> None:
        """Open the live session now unless replay or a dry run answers first."""
        if self._cursor is None and not self.config.dry_run:
            self.live = await self._retrace([])

    async def call(self, name: str, arguments: dict[str, Any]) -> StepOutcome:
        started = time.perf_counter()
        outcome = await self._call(name, arguments)
        step = outcome.step.model_copy(update={"ms": (time.perf_counter() - started) * 1000})
        self.calls.append({"name": name, "arguments": copy.deepcopy(arguments),
                           "output": outcome.observation, "source": step.source,
                           "status": step.status, "unsafe": step.unsafe, "rule": step.rule})
        if outcome.end:
            self.ended_by = step.rule or ("unsafe" if step.unsafe else "end")
        return StepOutcome(outcome.observation, outcome.end, step)

    async def _call(self, name: str, arguments: dict[str, Any]) -> StepOutcome:
        if self.registration.tool(name) is None:
            offered = sorted(t.name for t in self.registration.tools)
            return _answer(name, CallResult(f"error: unknown tool {name!r}; the tools are "
                                            f"{offered}", "error"), "invalid")
        if name in self.unsafe:
            text = (f"error: {name} is destructive and this toolset may not run it; it was "
                    f"not executed")
            return StepOutcome(text, True, ToolStep(name=name, source="refused",
                                                    status="error", unsafe=True))
        rule: ReplayRule | None = None
        if self._cursor is not None and not self._cursor.diverged:
            logged = self._cursor.answer(name, arguments)
            if logged is not None:
                return _answer(name, CallResult(logged.output, logged.status), "replay")
            rule = self.rule
            if rule == "mask":
                raise RolloutNotRun("replay_masked", f"call {self._cursor.position + 1} "
                                    f"({name}) left the logged path and the rule is mask")
            if rule == "end":
                return StepOutcome("", True, ToolStep(name=name, source="replay",
                                                      status="ok", rule="end"))
            if not self.config.dry_run:
                self.live = await self._retrace(self._cursor.replayed())
        if self.config.dry_run or self.live is None:
            stub = self.config.stubs.get(name, f"ok (dry run: {name} was not executed)")
            return _answer(name, CallResult(stub), "stub", rule)
        result = await self.live.call(name, arguments, self.config.call_timeout_s)
        return _answer(name, result, "live", rule)

    async def _retrace(self, path: list[LoggedCall]) -> BackendSession:
        """A live session on the initial state, the plan's setup and then the replayed
        calls run on it."""
        live = await self.backend.open(self.plan.key, self.plan.initial_state,
                                       self.config.open_timeout_s)
        for n, logged in enumerate([*self.plan.setup, *path], start=1):
            result = await live.call(logged.name, logged.arguments, self.config.call_timeout_s)
            if result.status == "timeout":
                await live.close()
                raise unavailable(self.registration.name, f"bringing the live backend to "
                                  f"the logged state: logged call {n} ({logged.name}) "
                                  f"timed out")
        return live

    async def snapshot(self) -> dict[str, Any] | None:
        """The end state (None: the toolset keeps none, or a dry run)."""
        if not self.registration.has_state or self.config.dry_run:
            return None
        if self.live is None:
            self.live = await self._retrace(
                self._cursor.replayed() if self._cursor is not None else [])
        return await self.live.state()

    async def close(self) -> None:
        if self.live is not None:
            live, self.live = self.live, None
            await live.close()


def _answer(name: str, result: CallResult, source: Literal["replay", "live", "stub", "invalid"],
            rule: ReplayRule | None = None) -> StepOutcome:
    return StepOutcome(result.text, False, ToolStep(name=name, source=source,
                                                     status=result.status, rule=rule))
