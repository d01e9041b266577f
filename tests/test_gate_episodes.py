"""A mixed pool trains and gates both kinds (issue 37): single-step `tool_call` tasks and
episode tasks on the workplace world served as a Python toolset, run by the real rollout
loop, environments, trainer sample building, gate evaluation, decision and report — with a
scripted policy instead of a model (the replies are the script's; everything after them is
real). The trainer gets scored groups of both kinds, an episode group's every assistant turn
with its episode's advantage; the decision record judges episodes in groups of their own;
"what changed" shows both sides' episodes turn by turn, where they diverged and why the
verifier said what it said; and the verifier canaries of both kinds run before the decision,
a planted bug in either verifier blocking it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from flywheel.config import Settings
from flywheel.demo.samples import TOOLS
from flywheel.environments import load_environment
from flywheel.environments.base import AnySpec, Environment, ToolSchemas
from flywheel.environments.tool_call import ToolCallEnvironment
from flywheel.environments.toolset import ToolsetEnvironment
from flywheel.events import GroupScoredPayload
from flywheel.gate import canaries
from flywheel.gate import evaluate as gate_evaluate
from flywheel.gate.decision import Attempt, EvalRun
from flywheel.gate.evaluate import Holdout, evaluate
from flywheel.gate.hacking import review
from flywheel.gate.report import changes_markdown, report_markdown
from flywheel.mining.episodes import toolset_tools
from flywheel.policy.base import AdapterRef, Completion, SamplingParams
from flywheel.policy.chat_format import ChatFormat, load_chat_format
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import EpisodeSpec, ExpectedCall, TaskSpec, ToolCallSpec, VerifierResult
from flywheel.tools.runtime import Catalog
from flywheel.toolsets import PythonClass
from flywheel.trainer.engine import samples_from_groups
from flywheel.trainer.grpo import GRPOConfig, group_advantages
from tests.support.scripted import tool_call
from tests.support.toolsets import registered
from tests.test_gate_episode_canaries import RightToolsAreEnough

WORKPLACE = "flywheel.environments.workplace_tools:WorkplaceTools"
EMPTY = {"calendar": {"events": []}, "email": {"inbox": [], "outbox": []},
         "tickets": {"items": []}, "next_id": 1}
USER2 = "Now email ana@example.com about it."
RIGHT = [tool_call("tickets_create", title="printer", priority=2), "Filed.",
         tool_call("email_send", to="ana@example.com", subject="printer"), "Emailed Ana."]
WRONG = [tool_call("tickets_create", title="printer", priority=3), "Filed.", "Done."]


class Agent:
    """Right or wrong by a rule: `good(adapter, seed, i)`. A right attempt calls the weather
    tool for Paris, or walks the episode's right path (a P2 ticket, then the email the
    scripted user asks for); a wrong one asks for Lyon's weather, or files a P3 and never
    sends the email."""

    def __init__(self, fmt: ChatFormat, good: Any) -> None:
        self.chat_format, self.good = fmt, good

    async def sample(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams, *,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     adapter: AdapterRef | None = None) -> list[Completion]:
        prompt = self.chat_format.render(messages, tools)
        done = sum(1 for m in messages if m["role"] == "assistant")
        out = []
        for i in range(params.n):
            good = self.good(adapter, params.seed, i)
            if "weather" in str(messages[0]["content"]).lower():
                text = tool_call("get_weather", city="Paris" if good else "Lyon")
            else:
                path = RIGHT if good else WRONG
                text = path[done] if done < len(path) else "Done."
            out.append(Completion(text=text, token_ids=[7, 8, 9], logprobs=[-0.1] * 3,
                                  prompt_token_ids=prompt, finish_reason="stop",
                                  adapter=adapter.name if adapter else None, latency_ms=1.0))
        return out

    async def ensure_adapter(self, adapter: AdapterRef) -> None: ...


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return load_chat_format(resolve_model_dir(None))


@pytest.fixture
async def catalog() -> AsyncIterator[Catalog]:
    reg = await registered("workplace", PythonClass(target=WORKPLACE))
    found = Catalog.of([reg])
    try:
        yield found
    finally:
        await found.aclose()


async def _pool(catalog: Catalog) -> list[TaskSpec]:
    reg = (await catalog.runtime("workplace")).registration
    step = TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                    messages=[{"role": "user", "content": "What's the weather in Paris?"}],
                    verifier=ToolCallSpec(expected=ExpectedCall(name="get_weather",
                                                                arguments={"city": "Paris"})),
                    failure_mode="bad_arguments", fingerprint="step", split="holdout")
    episode = TaskSpec(
        task_id=uuid.uuid4(), env="toolset", tools=toolset_tools(reg),
        messages=[{"role": "user", "content": "File a P2 ticket: printer."}],
        verifier=EpisodeSpec(toolset="workplace", toolset_version=reg.version,
                             initial_state=EMPTY, check_state=True, user_turns=[USER2],
                             reference_calls=[
                                 ExpectedCall(name="tickets_create",
                                              arguments={"title": "printer", "priority": 2}),
                                 ExpectedCall(name="email_send",
                                              arguments={"to": "ana@example.com",
                                                         "subject": "printer"})],
                             unsafe_tools=["tickets_purge"]),
        failure_mode="incomplete", fingerprint="episode", split="holdout")
    return [step, episode]


def _loader(catalog: Catalog, bug: bool = False) -> Any:
    def load(name: str) -> Environment:
        if name == "toolset":
            return RightToolsAreEnough(catalog) if bug else ToolsetEnvironment(catalog)
        return load_environment(name)
    return load


async def test_the_trainer_gets_both_kinds_an_episode_turn_by_turn_at_its_advantage(
        fmt: ChatFormat, catalog: Catalog) -> None:
    # Half of each group right: attempt i of a single step, episode i (its turns are
    # sampled at seed + 1000·i + step).
    agent = Agent(fmt, lambda _a, seed, i: (i if seed < 1000 and i else seed // 1000) % 2 == 0)
    groups = []
    for task in await _pool(catalog):
        env = _loader(catalog)(task.env)
        out = await run_group(agent, task, env,  # type: ignore[arg-type]
                              GroupConfig(group_size=4, max_steps=4, rollout_timeout_s=30),
                              adapter=None, seed=0, group_key=f"train-{task.env}")
        assert [r.reward == 1.0 for r in out.rollouts] == [True, False] * 2, task.env
        assert out.trainable
        groups.append(GroupScoredPayload(
            group_id=uuid.uuid4(), task_id=task.task_id, env=task.env, adapter=None,
            adapter_version=None, temperature=1.0, rollouts=out.rollouts,
            reward_mean=out.reward_mean, reward_std=out.reward_std, trainable=True,
            worker="test"))
    samples = samples_from_groups(groups, GRPOConfig())
    step, episode = groups
    assert [len(r.turns) for r in step.rollouts] == [1, 1, 1, 1]
    assert [len(r.turns) for r in episode.rollouts] == [4, 3, 4, 3]
    assert len(samples) == 4 + 14
    cfg = GRPOConfig()
    advantages = group_advantages([r.reward for r in episode.rollouts],
                                  scale_std=cfg.scale_std, eps=cfg.std_eps)
    want = [(t.prompt_token_ids, adv) for r, adv in zip(episode.rollouts, advantages,
                                                        strict=True) for t in r.turns]
    assert [(s.prompt_ids, s.advantage) for s in samples[4:]] == want
    assert {s.advantage > 0 for s in samples[4:8]} == {True}  # the right episode, every turn
    # The tool results and the scripted user's words are prompt, never trained.
    trained = [fmt.tokenizer.decode(s.completion_ids) for s in samples]
    assert all(USER2 not in t for t in trained)


def _settings() -> Settings:
    s = Settings()
    return s.model_copy(update={
        "gate": s.gate.model_copy(update={"round_samples": 2, "samples_per_task": 6,
                                          "group_min_samples": 2, "canary_tasks": 8}),
        "rollout": s.rollout.model_copy(update={"max_steps": 4, "rollout_timeout_s": 30})})


async def _side(agent: Agent, holdout: Holdout, adapter: AdapterRef | None, s: Settings
                ) -> EvalRun:
    return EvalRun.combine([await evaluate(agent, holdout, adapter, s, r)  # type: ignore[arg-type]
                            for r in range(s.gate.max_rounds)])


async def test_the_gate_judges_episodes_apart_and_shows_both_sides_turn_by_turn(
        fmt: ChatFormat, catalog: Catalog, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gate_evaluate, "load_environment", _loader(catalog))
    s = _settings()
    holdout = Holdout(1, await _pool(catalog))
    step, episode = (str(t.task_id) for t in holdout.tasks)
    agent = Agent(fmt, lambda adapter, _seed, _i: adapter is not None)
    v1 = AdapterRef("policy", 1, Path("/adapters/v1"))
    cand, base = await _side(agent, holdout, v1, s), await _side(agent, holdout, None, s)
    found = canaries.run(holdout.tasks, s.gate.canary_tasks, _loader(catalog))
    record = review(cand, base, s.gate, found=found)

    assert found.wrong == [] and set(found.per_env) == {"tool_call", "toolset"}
    # Each kind is a group of its own on both sides, with its own regression check.
    assert record.candidate.groups == {"env:tool_call": 1.0, "env:toolset": 1.0,
                                       "kind:episode": 1.0, "mode:bad_arguments": 1.0,
                                       "mode:incomplete": 1.0, "tool:get_weather": 1.0}
    assert record.baseline.groups["kind:episode"] == 0.0
    assert record.candidate.group_samples["kind:episode"] == 6
    checks = {c.name: c for c in record.checks}
    assert checks["group:kind:episode"].passed and checks["group:env:tool_call"].passed
    assert checks["canaries"].passed
    # The episodes' paired test in the record: 6 pairs, all won (one task: no interval).
    ep = record.group_tests["kind:episode"]
    assert (ep.tasks, ep.pairs, ep.wins, ep.losses) == (1, 6, 6, 0)
    assert ep.p_value == pytest.approx(1 / 64) and ep.ci_low is None

    # What changed: both fixed; the episode side by side, turn by turn.
    ch = record.changes
    assert ch is not None and ch.fixed_count == 2 and ch.broken_count == 0
    item = next(t for t in ch.fixed if t.task_id == episode)
    single = next(t for t in ch.fixed if t.task_id == step)
    assert single.candidate.episode is None and single.diverged_at is None
    c, p = item.candidate.episode, item.production.episode
    assert c is not None and p is not None
    assert [[x.name for x in t.calls] for t in c] == [["tickets_create"], [],
                                                      ["email_send"], []]
    assert [[x.name for x in t.calls] for t in p] == [["tickets_create"], [], []]
    assert [t.user for t in c] == [None, USER2, None, None]
    assert [t.user for t in p] == [None, USER2, None]
    assert '"priority": 3' in p[0].calls[0].arguments
    assert "tkt-1" in c[0].calls[0].result and c[0].calls[0].source == "live"
    assert item.diverged_at == 1  # the first call's arguments differ
    assert "every check held: state" in item.candidate.reason
    assert "end state differs from the reference" in item.production.reason
    markdown = changes_markdown(record.model_dump(mode="json"))
    assert "**1 ← diverged**" in markdown
    assert "3 production and 4 candidate turns; the sides' calls first differ at turn 1" \
        in markdown
    assert f"user: `{USER2}`" in markdown and "email_send" in markdown
    assert "end state differs" in markdown


async def test_a_planted_episode_verifier_bug_blocks_the_decision_as_a_single_step_one_does(
        catalog: Catalog) -> None:
    """The canaries run over the mixed holdout before the decision; a verifier that accepts
    an episode calling the right tools, or a single step calling the right tool, fails the
    `canaries` check — no promotion, the record naming the environment and canary."""
    tasks = await _pool(catalog)

    class RightToolIsEnough(ToolCallEnvironment):
        def verify(self, spec: AnySpec, output: object, *,
                   tools: ToolSchemas | None = None) -> VerifierResult:
            got = super().verify(spec, output, tools=tools)
            if got.failure_mode in ("bad_arguments", "wrong_arguments"):
                return VerifierResult(reward=1.0, reward_components={}, failure_mode=None)
            return got

    def single_bug(name: str) -> Environment:
        return RightToolIsEnough() if name == "tool_call" else _loader(catalog)(name)

    ids = [str(t.task_id) for t in tasks]
    runs = [EvalRun(v, {t: [] for t in ids}, [
        Attempt(t, j, v == 1, float(v == 1), False, False, 10.0, 5)
        for t in ids for j in range(12)]) for v in (1, None)]
    rule = _settings().gate
    clean = review(*runs, rule, found=canaries.run(tasks, 8, _loader(catalog)))
    assert next(c for c in clean.checks if c.name == "canaries").passed
    for load, env in ((_loader(catalog, bug=True), "toolset"), (single_bug, "tool_call")):
        found = canaries.run(tasks, 8, load)
        assert found.wrong and {w.env for w in found.wrong} == {env}
        record = review(*runs, rule, found=found)
        check = next(c for c in record.checks if c.name == "canaries")
        assert not check.passed and f"{env} " in check.detail
        assert record.recommendation == "reject"
        assert any(r.startswith("not promoted: canaries failed") for r in record.reasons)
        shown = report_markdown({"evaluation_id": "e", "record": {
            **record.model_dump(mode="json"), "version": 1, "baseline_version": None,
            "eval_set_version": 1}})
        assert "## Verifier canaries" in shown and "scored wrongly" in shown
