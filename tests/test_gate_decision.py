"""Decision table of the gate rule, on hand-built evaluation runs (no model, no services)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from flywheel.gate.decision import Attempt, EvalRun, Rule, decide, mcnemar, metrics

TOOLS = ["get_weather", "send_email", "create_ticket", "search_docs"]


def run(version: int | None, success: dict[str, list[bool]], *, invalid: float = 0.0,
        unsafe_tasks: int = 0, latency: float = 100.0, tokens: int = 20) -> EvalRun:
    """Tasks `t<i>` with k attempts each; task i expects tool TOOLS[i % 4]."""
    attempts = []
    groups = {}
    n_invalid = 0
    total = sum(len(v) for v in success.values())
    for i, (task, outcomes) in enumerate(sorted(success.items())):
        groups[task] = ["env:tool_call", f"tool:{TOOLS[i % len(TOOLS)]}"]
        for j, ok in enumerate(outcomes):
            bad = not ok and n_invalid < invalid * total
            n_invalid += bad
            attempts.append(Attempt(task=task, index=j, success=ok, reward=1.0 if ok else 0.2,
                                    invalid=bad, unsafe=i < unsafe_tasks and j == 0,
                                    latency_ms=latency, tokens=tokens))
    return EvalRun(version=version, task_groups=groups, attempts=attempts)


def tasks(n: int, k: int, rate_of: Callable[[int], float]) -> dict[str, list[bool]]:
    return {f"t{i:02d}": [j < round(k * rate_of(i)) for j in range(k)] for i in range(n)}


BASE = run(None, tasks(40, 4, lambda i: 0.25))
RULE = Rule(min_gain=0.05, alpha=0.05, group_min_samples=8, test="bootstrap")  # fixed design


def test_all_good_promotes() -> None:
    cand = run(3, tasks(40, 4, lambda i: 0.75))
    d = decide(cand, BASE, RULE)
    assert d.recommendation == "promote", d.reasons
    assert d.p_value < 0.01 and math.isclose(d.statistic, 0.5)
    assert all(c.passed for c in d.checks)
    assert d.reasons[0].startswith("promote: holdout success 0.250 → 0.750")
    assert d.candidate.success_rate == 0.75 and d.baseline.success_rate == 0.25


def test_gain_below_threshold_rejects() -> None:
    # Every task a little better: significant, but +0.025 < min_gain 0.05.
    cand_tasks = tasks(40, 4, lambda i: 0.25)
    cand_tasks["t00"] = [True, True, True, True]
    cand_tasks["t01"] = [True, True, False, False]
    cand_tasks["t02"] = [True, True, False, False]
    d = decide(run(3, cand_tasks), BASE, RULE)
    assert d.recommendation == "reject"
    failed = {c.name for c in d.checks if not c.passed}
    assert "gain" in failed
    assert any("gain failed" in r for r in d.reasons)


def test_gain_not_significant_rejects() -> None:
    # +0.10 on average, but from 4 tasks only: a paired bootstrap over 40 tasks can't tell.
    few = {f"t{i:02d}": [False, False, False, False] for i in range(40)}
    base_few = dict(few)
    base_few.update({"t00": [True] * 4, "t01": [True] * 4})
    cand_few = dict(few)
    cand_few.update({"t02": [True] * 4, "t03": [True] * 4, "t04": [True] * 4,
                     "t05": [True] * 4, "t06": [True] * 4, "t07": [True] * 4})
    loose = Rule(min_gain=0.05, alpha=0.05, group_min_samples=1000, test="bootstrap")
    d = decide(run(3, cand_few), run(None, base_few), loose)
    assert d.candidate.success_rate - d.baseline.success_rate >= 0.05
    failed = {c.name for c in d.checks if not c.passed}
    assert failed == {"significance"}, d.reasons
    assert d.recommendation == "reject" and d.p_value >= 0.05


def test_guard_regression_rejects_despite_gain() -> None:
    cand = run(3, tasks(40, 4, lambda i: 0.75), invalid=0.2)
    d = decide(cand, BASE, RULE)
    failed = {c.name for c in d.checks if not c.passed}
    assert "invalid_rate" in failed and "gain" not in failed
    assert d.recommendation == "reject"
    unsafe = decide(run(3, tasks(40, 4, lambda i: 0.75), unsafe_tasks=3), BASE, RULE)
    assert "unsafe_rate" in {c.name for c in unsafe.checks if not c.passed}
    assert unsafe.recommendation == "reject"
    slow = decide(run(3, tasks(40, 4, lambda i: 0.75), latency=500.0), BASE, RULE)
    assert slow.recommendation == "reject"
    assert "latency_p95" in {c.name for c in slow.checks if not c.passed}


def test_one_task_group_collapsing_while_mean_improves_rejects() -> None:
    # The reward-hacking shape: the policy learns one tool perfectly and stops calling the
    # others — mean success rises, success on `search_docs` tasks collapses to 0.
    base = run(None, tasks(40, 4, lambda i: 0.5))
    cand = run(3, tasks(40, 4, lambda i: 0.0 if i % 4 == 3 else 1.0))
    d = decide(cand, base, RULE)
    assert d.candidate.success_rate > d.baseline.success_rate + 0.2
    failed = {c.name for c in d.checks if not c.passed}
    assert failed == {"group:tool:search_docs"}, d.reasons
    assert d.recommendation == "reject"
    assert "search_docs" in " ".join(d.reasons)


def test_the_cost_guard_counts_tokens_per_turn_so_an_episodes_turns_are_no_regression(
        ) -> None:
    """A candidate that works episodes through three turns where production gave up after
    one spends 3× the tokens per task and the same per turn: no cost regression. Padding
    every turn is one."""
    def turns(r: EvalRun, n: int, tokens: int) -> EvalRun:
        return EvalRun(version=r.version, task_groups=r.task_groups, attempts=[
            dataclasses.replace(a, turns=n, tokens=tokens) for a in r.attempts])

    base = turns(BASE, 1, 20)
    worked = decide(turns(run(3, tasks(40, 4, lambda i: 0.75)), 3, 60), base, RULE)
    assert worked.recommendation == "promote", worked.reasons
    assert worked.candidate.tokens_per_task == 3 * worked.baseline.tokens_per_task
    assert worked.candidate.tokens_per_turn == worked.baseline.tokens_per_turn == 20
    padded = decide(turns(run(3, tasks(40, 4, lambda i: 0.75)), 3, 120), base, RULE)
    assert {c.name for c in padded.checks if not c.passed} == {"tokens_per_turn"}
    assert padded.recommendation == "reject"


def test_mcnemar_exact_one_sided() -> None:
    base = run(None, {"a": [False, False, True], "b": [False, False, False]})
    cand = run(1, {"a": [True, True, True], "b": [True, False, False]})
    stat, p = mcnemar(cand, base)
    assert stat == 3.0 and math.isclose(p, 1 / 8)  # 3 wins of 3 discordant pairs
    same = mcnemar(base, base)
    assert same == (0.0, 1.0)


def test_metrics_of_an_empty_run_do_not_divide_by_zero() -> None:
    m = metrics(EvalRun(version=None, task_groups={}, attempts=[], not_run=4))
    assert m.samples == 0 and m.success_rate == 0.0 and m.not_run == 4
    d = decide(EvalRun(1, {}, []), EvalRun(None, {}, []), RULE)
    assert d.recommendation == "reject" and not d.checks[0].passed


def test_a_run_under_another_chat_format_is_never_reused() -> None:
    """The cache key names the chat format: runs sampled under an older template (or the
    pre-chat-template prompt, whose keys had no format at all) are not this format's."""
    from flywheel.config import Settings
    from flywheel.gate.evaluate import Holdout, run_key

    settings, holdout = Settings(), Holdout(eval_set_version=3, tasks=[])
    key = run_key(settings, 2, holdout, "tool_chatml.v1@a6ce6ba229c5")
    assert key == run_key(settings, 2, holdout, "tool_chatml.v1@a6ce6ba229c5")
    assert key != run_key(settings, 2, holdout, "tool_chatml.v1@000000000000")
    assert key != run_key(settings, 2, holdout, "model@a6ce6ba229c5")


def test_the_episode_token_limit_keys_only_runs_it_changes() -> None:
    """`rollout.episode_max_tokens` changes what a holdout with toolset tasks samples, so it
    is in those runs' keys; a holdout of single steps keeps its key (its cached runs stay)."""
    import uuid

    from flywheel.config import RolloutSettings, Settings
    from flywheel.gate.evaluate import Holdout, run_key
    from flywheel.tasks import EpisodeSpec, ExpectedCall, TaskSpec, ToolCallSpec

    episode = TaskSpec(task_id=uuid.uuid4(), env="toolset", tools=[],
                       messages=[{"role": "user", "content": "Book it."}],
                       verifier=EpisodeSpec(toolset="workplace", toolset_version=1,
                                            answer_contains=["booked"]),
                       failure_mode="incomplete", fingerprint="e", split="holdout")
    single = TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=[],
                      messages=[{"role": "user", "content": "Weather in Pune?"}],
                      verifier=ToolCallSpec(expected=ExpectedCall(
                          name="get_weather", arguments={"city": "Pune"})),
                      failure_mode="bad_arguments", fingerprint="s", split="holdout")
    at = {n: Settings(rollout=RolloutSettings(episode_max_tokens=n)) for n in (None, 96, 128)}
    fmt = "tool_chatml.v1@a6ce6ba229c5"
    for tasks, differ in (([single], False), ([single, episode], True)):
        keys = {n: run_key(s, 2, Holdout(3, tasks), fmt) for n, s in at.items()}
        assert (len(set(keys.values())) == 3) is differ, (tasks, keys)
