"""A gate round with every task in flight at once samples what one task after another does:
on the real SmolLM2-135M, greedy decoding gives every task the same outcome and the same
tokens at `gate.max_inflight` 1 and 16, while the local engine ran the concurrent round in
far fewer batched forwards; and a sampled round draws each task from its own seed (the
engine's batch-mates do not change which random numbers it gets)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from flywheel.bench.learning import fixed_tasks
from flywheel.config import Settings
from flywheel.gate.decision import EvalRun
from flywheel.gate.evaluate import Holdout, evaluate

local = pytest.importorskip("flywheel.policy.local")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
async def policy() -> AsyncIterator[local.LocalPolicy]:
    from flywheel.policy.factory import make_policy

    engine = make_policy(Settings())
    assert isinstance(engine, local.LocalPolicy) and engine.share_prompts
    yield engine
    await engine.close()


def _settings(inflight: int, temperature: float) -> Settings:
    s = Settings()
    return s.model_copy(update={
        "gate": s.gate.model_copy(update={"max_inflight": inflight, "temperature": temperature,
                                          "round_samples": 1 if temperature == 0 else 2}),
        "rollout": s.rollout.model_copy(update={"max_tokens": 24})})


def _outcomes(run: EvalRun) -> list[tuple[str, int, bool, float, bool, int]]:
    return sorted((a.task, a.index, a.success, a.reward, a.invalid, a.tokens)
                  for a in run.attempts)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
async def test_concurrent_round_matches_sequential(policy: local.LocalPolicy,
                                                   temperature: float) -> None:
    holdout = Holdout(1, fixed_tasks(8, seed=3))
    before = policy.batcher.batches
    sequential = await evaluate(policy, holdout, None, _settings(1, temperature))
    one_by_one = policy.batcher.batches - before
    counted: list[int] = []
    before = policy.batcher.batches
    concurrent = await evaluate(policy, holdout, None, _settings(16, temperature),
                                on_task=counted.append)
    together = policy.batcher.batches - before

    assert one_by_one == len(holdout.tasks) and together < one_by_one / 2
    assert len(counted) == len(holdout.tasks)  # progress came task by task
    assert sequential.not_run == concurrent.not_run == 0
    if temperature == 0:
        assert _outcomes(concurrent) == _outcomes(sequential)
    else:  # same seeds: the sampled tokens agree but for float rounding at a tie
        same = sum(x == y for x, y in zip(_outcomes(concurrent), _outcomes(sequential),
                                          strict=True))
        assert same >= len(sequential.attempts) - 1


async def test_a_task_is_done_when_its_rows_are_not_when_the_batch_is(
        policy: local.LocalPolicy, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round's tasks all arrive in one batch, which the engine runs in several forwards
    (`local_batch_rows`): each task is reported done as soon as the forward holding its rows
    ends, so progress moves task by task (a round of 71 tasks used to show 0/284 for
    minutes) and a freed slot takes the next task while the rest still run."""
    monkeypatch.setattr(policy, "max_rows", 2)  # 8 tasks × 1 greedy row: 4 forwards
    forwards: list[int] = []
    real = policy._generate_shared

    def counted(*args: object, **kwargs: object) -> object:
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        forwards.append(len(forwards) + 1)
        return out

    monkeypatch.setattr(policy, "_generate_shared", counted)
    seen_at: list[int] = []
    holdout = Holdout(1, fixed_tasks(8, seed=3))
    await evaluate(policy, holdout, None, _settings(16, 0.0),
                   on_task=lambda _n: seen_at.append(len(forwards)))
    assert len(forwards) == 4 and len(seen_at) == 8
    assert seen_at[0] < 4, seen_at  # the first tasks were done before the last forward ran
    assert seen_at == sorted(seen_at)
