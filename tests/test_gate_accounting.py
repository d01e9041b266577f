"""Every attempt counts: a candidate that abstains, times out or rambles where it would lose
is measured on every task, through the real `evaluate` and `decide` (no services).

24 holdout tool_call tasks. Production (the base model) is right on tasks 0–11 and calls the
tool with a wrong city on the others: served success 0.50. The gaming candidate is right on
tasks 12–19 — where production is wrong — and on the other 16 answers nothing (or runs past
the deadline, or is cut by max_tokens): served success 0.33, a regression every agent would
feel. Before this accounting its 16 non-answers were "not run" and left out, and the gate
promoted it ("0.500 → 1.000, e-value 42.9"). A truly better candidate (right on 0–17) is
promoted by the same rule, and infrastructure failures are retried, then end `incomplete`.

The scripted policy has the real chat format (SmolLM2's tokenizer and template), so every
reply is the text a model would write and is parsed as serving parses it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from flywheel.config import GateSettings, RolloutSettings, Settings
from flywheel.events import GateDecision
from flywheel.gate import sequential
from flywheel.gate.decision import EvalRun, decide, round_counts
from flywheel.gate.evaluate import Holdout, evaluate
from flywheel.gate.lifetime import rule_for
from flywheel.policy.base import AdapterRef, Completion, PolicyError, SamplingParams
from flywheel.policy.chat_format import ChatFormat, load_chat_format
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec

TASKS = 24
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CANDIDATE = AdapterRef("policy", 2, Path("/adapters/v2"))
Reply = tuple[str, str]  # (text, finish_reason) — or "HANG" / "CRASH" as the text


def _task(i: int) -> TaskSpec:
    return TaskSpec(task_id=uuid.UUID(int=i + 1), env="tool_call", tools=[WEATHER],
                    messages=[{"role": "user", "content": f"Weather in city{i}?"}],
                    verifier=ToolCallSpec(expected=ExpectedCall(
                        name="get_weather", arguments={"city": f"city{i}"})),
                    failure_mode="bad_arguments", fingerprint=f"h{i}", split="holdout")


HOLDOUT = Holdout(1, [_task(i) for i in range(TASKS)])


def call(city: str) -> str:
    """A call as the bundled template writes it."""
    return (f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': {'city': city}})}"
            "\n</tool_call>")


class Scripted:
    """Answers each side from a script: script(version, task number) → a reply."""

    def __init__(self, fmt: ChatFormat, script: Callable[[int | None, int], Reply]) -> None:
        self.chat_format, self.script = fmt, script
        self.calls: dict[tuple[int | None, int], int] = {}

    async def sample(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams, *,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     adapter: AdapterRef | None = None) -> list[Completion]:
        found = re.search(r"city(\d+)", str(messages[-1]["content"]))
        assert found
        task, version = int(found.group(1)), adapter.version if adapter else None
        self.calls[version, task] = self.calls.get((version, task), 0) + 1
        text, finish = self.script(version, task)
        if text == "HANG":
            await asyncio.sleep(3600)
        if text == "CRASH":
            raise PolicyError("engine unreachable")
        prompt = self.chat_format.render(messages, tools)
        return [Completion(text=text, token_ids=[7] * 12, logprobs=[-0.5] * 12,
                           prompt_token_ids=prompt, finish_reason=finish,
                           adapter=adapter.name if adapter else None, latency_ms=1.0)
                for _ in range(params.n)]

    async def ensure_adapter(self, adapter: AdapterRef) -> None: ...

    async def retire_adapter(self, adapter: AdapterRef) -> None: ...

    async def close(self) -> None: ...


def production(task: int) -> Reply:
    return call(f"city{task}" if task < 12 else "Atlantis"), "stop"


def gaming(miss: Reply) -> Callable[[int | None, int], Reply]:
    """Production as above; the candidate right on 12–19 and `miss` on the other 16."""
    def script(version: int | None, task: int) -> Reply:
        if version is None:
            return production(task)
        return (call(f"city{task}"), "stop") if 12 <= task < 20 else miss
    return script


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return load_chat_format(resolve_model_dir(None))


def _settings(tmp_path: Path) -> Settings:
    """The default gate; a short sampling deadline so the timeout case runs fast. The latency
    guard is off: these scripted attempts take a millisecond of work, so their wall-clock p95
    is the machine's load (a clean-clone CI run saw 111 → 278 ms and rejected on latency),
    not the accounting these tests are about."""
    return Settings(home=tmp_path, rollout=RolloutSettings(rollout_timeout_s=0.05),
                    gate=GateSettings(retry_backoff_s=0.0, latency_p95_ratio=1e9))


async def _gate(script: Callable[[int | None, int], Reply], fmt: ChatFormat,
                s: Settings) -> tuple[GateDecision, Scripted]:
    """Round by round as the gate service samples (both sides, then a look), then decide."""
    policy = Scripted(fmt, script)
    rule = rule_for(s.gate, 1)
    cand: list[EvalRun] = []
    base: list[EvalRun] = []
    for r in range(s.gate.max_rounds):
        cand.append(await evaluate(policy, HOLDOUT, CANDIDATE, s, r))
        base.append(await evaluate(policy, HOLDOUT, None, s, r))
        c, b = EvalRun.combine(cand), EvalRun.combine(base)
        counts = round_counts(c, b, s.gate.round_samples)
        if len(counts) <= r or sequential.run(counts, rule).stop:
            break
    return decide(EvalRun.combine(cand), EvalRun.combine(base), s.gate), policy


@pytest.mark.parametrize("miss, mode", [
    (("", "stop"), "empty"),                             # abstains
    (("HANG", "stop"), "timeout"),                       # samples past the deadline
    ((call("city")[:24], "length"), "truncated"),        # rambles until max_tokens
])
async def test_a_candidate_that_does_not_answer_where_it_would_lose_is_rejected(
        fmt: ChatFormat, tmp_path: Path, miss: Reply, mode: str) -> None:
    d, _ = await _gate(gaming(miss), fmt, _settings(tmp_path))
    assert d.recommendation == "reject", d.reasons
    # Every attempt counted: 24 tasks × the samples the test used, on both sides.
    assert d.candidate.samples == d.baseline.samples == TASKS * d.sequential.samples_per_task
    assert d.candidate.not_run == d.baseline.not_run == 0
    assert d.candidate.success_rate == pytest.approx(8 / 24)
    assert d.baseline.success_rate == pytest.approx(12 / 24)
    n = 16 * d.sequential.samples_per_task
    assert d.candidate.failure_modes[mode] == n and d.baseline.failure_modes[mode] == 0
    assert d.baseline.failure_modes["bad_arguments"] == 12 * d.sequential.samples_per_task
    assert d.sequential is not None and d.sequential.stop in ("loss", "futility")
    assert not next(c for c in d.checks if c.name == "gain").passed
    # The record names the abstention, both sides' counts, biggest shift first.
    assert f"(candidate vs production): {mode} {n} vs 0" in " ".join(d.reasons)


async def test_the_same_tasks_with_a_truly_better_candidate_promote(
        fmt: ChatFormat, tmp_path: Path) -> None:
    def better(version: int | None, task: int) -> Reply:
        if version is None:
            return production(task)
        return call(f"city{task}" if task < 18 else "Atlantis"), "stop"

    d, _ = await _gate(better, fmt, _settings(tmp_path))
    assert d.recommendation == "promote", d.reasons
    assert d.candidate.success_rate == pytest.approx(18 / 24)
    assert d.sequential is not None and d.sequential.stop == "win"
    assert d.lifetime is not None and d.lifetime.candidate_number == 1
    assert d.sequential.threshold == pytest.approx(1 / d.lifetime.level)


async def test_infrastructure_failures_are_retried_then_end_incomplete(
        fmt: ChatFormat, tmp_path: Path) -> None:
    s = _settings(tmp_path)
    flaky: dict[int, int] = {}

    def script(version: int | None, task: int) -> Reply:
        if version is None:
            return production(task)
        if task == 3:  # the engine fails twice on this task, then answers
            flaky[task] = flaky.get(task, 0) + 1
            if flaky[task] <= 2:
                return "CRASH", "stop"
        return call(f"city{task}"), "stop"

    d, policy = await _gate(script, fmt, s)
    assert d.recommendation == "promote", d.reasons  # the retries completed every pair
    assert policy.calls[2, 3] == policy.calls[2, 4] + 2

    def down(version: int | None, task: int) -> Reply:
        return ("CRASH", "stop") if version == 2 and task == 5 else production(task)

    d, policy = await _gate(down, fmt, s)
    # Never decided on what is left: the round the test needs cannot be completed.
    assert d.recommendation == "incomplete", d.reasons
    assert d.sequential is not None and d.sequential.stop == "incomplete"
    assert d.candidate.not_run_kinds == {"crash": 2}  # its 2 samples in round 1
    assert d.reasons[0].startswith("incomplete, not decided: round 1 is incomplete: 2 "
                                   "candidate and 0 production attempts")
    assert policy.calls[2, 5] == 1 + s.gate.infra_retries


def test_old_cached_attempts_without_a_failure_mode_still_load() -> None:
    run = EvalRun(1, {"t": []}, [])
    data = dataclasses.asdict(run)
    del data["not_run_kinds"]
    assert EvalRun.from_json(data) == run
