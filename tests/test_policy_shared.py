"""Prompts run once in the local engine, on the real SmolLM2-135M: the same seeds give the same
tokens and log-probs as `generate` running every row's prompt in full.

"The same" means bit-for-bit (== on every token id and every float log-prob) for a group, or
several groups in one call, whose rows need no padding, with and without an adapter, with the
prefix cache cold or holding that very prompt. Two cases change the arithmetic, not the math:
a batch of prompts of different lengths (`generate` runs the short ones left-padded, the shared
path unpadded) and a prompt continued from a cached start (its tail attends to cached keys in a
separate pass). There every token is the same and the log-probs agree to float32 rounding
(measured on ~2,000 tokens: no token differed, log-probs ≤ 1.9e-5 apart; asserted < 1e-4).
So does the default engine's shared-prefix attention (`flywheel.policy.prefix_attention`:
the rows' common start attended once for the whole batch, merged by log-sum-exp), which the
bit-for-bit cases turn off (`prefix_attention=False`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from flywheel.bench.learning import fixed_tasks
from flywheel.environments.prompt import task_messages, task_tools
from flywheel.policy import model_cache
from flywheel.policy.base import AdapterRef, Completion, SamplingParams

torch = pytest.importorskip("torch")
local = pytest.importorskip("flywheel.policy.local")

pytestmark = pytest.mark.slow

SHORT = [{"role": "user", "content": "Say hi"}]
LONG = [{"role": "system", "content": "You are a terse poet."},
        {"role": "user", "content": "Write a long poem about the sea, the wind and the stars."}]
TOOLS = [(task_messages(t), task_tools(t)) for t in fixed_tasks(2)]  # real tool_call tasks
ROUNDING = 1e-4


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return model_cache.default_model_dir(model_cache.default_cache_root())


@pytest.fixture(scope="module")
async def reference(model_dir: Path) -> AsyncIterator[local.LocalPolicy]:
    engine = local.LocalPolicy(model_dir, share_prompts=False)
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
async def shared(model_dir: Path) -> AsyncIterator[local.LocalPolicy]:
    """Prompts shared, attention plain: the arithmetic of `generate`."""
    engine = local.LocalPolicy(model_dir, prefix_attention=False)
    assert engine.share_prompts and not engine.prefix_attention
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
async def split(model_dir: Path) -> AsyncIterator[local.LocalPolicy]:
    """The default engine: rows that start alike read their common start once a step."""
    engine = local.LocalPolicy(model_dir)
    assert engine.share_prompts and engine.prefix_attention
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def lora_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))
    path = tmp_path_factory.mktemp("lora") / "v1"
    lora.save_pretrained(path)
    return path


def same(a: list[Completion], b: list[Completion]) -> None:
    """Bit-for-bit: every token id, log-prob, text and finish reason."""
    assert [(c.token_ids, c.logprobs, c.text, c.finish_reason) for c in a] == \
        [(c.token_ids, c.logprobs, c.text, c.finish_reason) for c in b]


def close(a: list[Completion], b: list[Completion]) -> float:
    """Every token the same; the largest log-prob difference."""
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.text for c in a] == [c.text for c in b]
    return max(abs(x - y) for ca, cb in zip(a, b, strict=True)
               for x, y in zip(ca.logprobs, cb.logprobs, strict=True))


def cached(completions: list[Completion]) -> list[int]:
    return [c.extra["cached_prompt_tokens"] for c in completions]


PARAMS = [
    SamplingParams(n=8, max_tokens=16, temperature=1.0, seed=3),
    SamplingParams(n=8, max_tokens=16, temperature=0.7, top_p=0.9, seed=4),
    SamplingParams(n=2, max_tokens=12, temperature=0.0),
]


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7-top_p", "greedy"])
async def test_a_group_is_bit_for_bit_the_full_prompt_path(
        reference: local.LocalPolicy, shared: local.LocalPolicy, params: SamplingParams) -> None:
    shared.prefix_cache.clear()
    for messages, tools in ((LONG, None), TOOLS[0]):
        expected = await reference.sample(messages, params, tools=tools)
        cold = await shared.sample(messages, params, tools=tools)
        # The prefix cache holds this very prompt.
        warm = await shared.sample(messages, params, tools=tools)

        same(expected, cold)
        same(expected, warm)
        assert cached(cold) == [0] * params.n
        assert cached(warm) == [len(shared.prompt_ids(messages, tools))] * params.n
    assert len({tuple(c.token_ids) for c in cold}) == (1 if params.temperature == 0 else 8)


async def test_groups_batched_together_and_split_across_batches(
        reference: local.LocalPolicy, shared: local.LocalPolicy,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two groups of 5 with max_batch 5 fill two padding-free batches: bit-for-bit. Then
    prompts of three lengths with max_batch 4: rows of different prompts share a batch, the
    shorter left-padded, and one prompt's rows straddle two batches."""
    shared.prefix_cache.clear()
    for engine in (reference, shared):
        monkeypatch.setattr(engine, "max_batch", 5)
    params = SamplingParams(n=5, max_tokens=12, temperature=1.0, seed=9)
    expected = await reference.sample_many([LONG, SHORT], params)
    got = await shared.sample_many([LONG, SHORT], params)
    for e, g in zip(expected, got, strict=True):
        same(e, g)

    for engine in (reference, shared):
        monkeypatch.setattr(engine, "max_batch", 4)
    shared.prefix_cache.clear()
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=5)
    expected = await reference.sample_many([SHORT, LONG, TOOLS[0][0]], params)
    got = await shared.sample_many([SHORT, LONG, TOOLS[0][0]], params)
    assert close([c for g in expected for c in g], [c for g in got for c in g]) < ROUNDING


async def test_a_callers_rows_leave_the_batch_once_they_have_all_ended(
        shared: local.LocalPolicy) -> None:
    """Twelve callers' rows of one prompt in one batch, each from its own seed: each gets the
    tokens it gets alone, while the batch's decode steps ran fewer rows once some groups had
    ended (a batch that kept feeding them padding would pass the comparison too)."""
    import asyncio

    shared.prefix_cache.clear()
    params = [SamplingParams(n=1, max_tokens=40, temperature=1.0, seed=s) for s in range(12)]
    alone = [await shared.sample(SHORT, p) for p in params]
    steps: list[int] = []  # rows of each decode step (one new token a row)

    def rows(_: object, args: tuple[object, ...], __: object) -> None:
        ids = args[0]
        assert isinstance(ids, torch.Tensor)
        if ids.shape[1] == 1:
            steps.append(int(ids.shape[0]))

    hook = shared.model.get_input_embeddings().register_forward_hook(rows)
    try:
        together = await asyncio.gather(*(shared.sample(SHORT, p) for p in params))
    finally:
        hook.remove()
    assert close([c for g in alone for c in g], [c for g in together for c in g]) < ROUNDING
    assert steps[0] == 12 and min(steps) < 12
    assert steps == sorted(steps, reverse=True)


async def test_the_shared_start_of_prompts_is_reused_across_calls(
        reference: local.LocalPolicy, shared: local.LocalPolicy) -> None:
    shared.prefix_cache.clear()
    first, second = (shared.prompt_ids(m, t) for m, t in TOOLS)
    start = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert start > 100  # instructions and tool list: the tasks differ only in the request
    params = SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=2)
    messages, tools = TOOLS[1]

    await shared.sample(TOOLS[0][0], params, tools=TOOLS[0][1])  # warms the cache
    got = await shared.sample(messages, params, tools=tools)
    assert cached(got) == [start] * 4
    assert close(await reference.sample(messages, params, tools=tools), got) < ROUNDING

    # A later turn of an episode continues the whole earlier conversation.
    turn2 = [*messages, {"role": "assistant", "content": got[0].text},
             {"role": "user", "content": "Result: sunny, 21 C"}]
    later = await shared.sample(turn2, params, tools=tools)
    # All of the earlier prompt but perhaps its last token, which can merge with the reply
    # after it when the longer conversation is tokenized.
    assert cached(later)[0] >= len(shared.prompt_ids(messages, tools)) - 1
    assert close(await reference.sample(turn2, params, tools=tools), later) < ROUNDING
    assert shared.prefix_cache.nbytes <= shared.prefix_cache.capacity


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
async def test_cache_entries_are_per_adapter_and_go_with_it(
        reference: local.LocalPolicy, shared: local.LocalPolicy, lora_dir: Path) -> None:
    shared.prefix_cache.clear()
    v1 = AdapterRef("policy", 1, lora_dir)
    for engine in (reference, shared):
        await engine.ensure_adapter(v1)
    params = SamplingParams(n=8, max_tokens=16, temperature=1.0, seed=6)
    ids = shared.prompt_ids(LONG)

    base = await shared.sample(LONG, params)  # the base model's entry for this prompt
    cold = await shared.sample(LONG, params, adapter=v1)
    warm = await shared.sample(LONG, params, adapter=v1)
    assert cached(cold) == [0] * 8  # the base entry never serves the adapter
    assert cached(warm) == [len(ids)] * 8
    expected = await reference.sample(LONG, params, adapter=v1)
    same(expected, cold)
    same(expected, warm)
    assert [c.token_ids for c in base] != [c.token_ids for c in cold]

    for engine in (reference, shared):
        await engine.retire_adapter(v1)
    assert shared.prefix_cache.lookup("policy@v1", ids) is None
    hit = shared.prefix_cache.lookup(None, ids)
    assert hit is not None and hit.exact  # the base model's entry stays
    same(await reference.sample(LONG, params), await shared.sample(LONG, params))


async def test_the_cache_stays_under_its_cap(
        shared: local.LocalPolicy, monkeypatch: pytest.MonkeyPatch) -> None:
    shared.prefix_cache.clear()
    one_prompt = 45 * 1024 * len(shared.prompt_ids(LONG))  # 45 KiB of keys/values a token
    monkeypatch.setattr(shared.prefix_cache, "capacity", int(one_prompt * 1.5))
    params = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1)
    for messages in (LONG, SHORT, LONG):
        await shared.sample(messages, params)
        assert shared.prefix_cache.nbytes <= shared.prefix_cache.capacity
    assert len(shared.prefix_cache) == 1  # one prompt fits; the other was evicted

    monkeypatch.setattr(shared.prefix_cache, "capacity", 0)
    shared.prefix_cache.clear()
    for _ in range(2):
        assert cached(await shared.sample(LONG, params)) == [0, 0]
    assert len(shared.prefix_cache) == 0


async def test_a_model_that_cannot_share_prompts_samples_in_full(
        model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Cohere scales its logits after the head: the engine says so and keeps to `generate`."""
    import transformers

    config = transformers.CohereConfig(vocab_size=49152, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=2, logit_scale=0.25)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path)

    with caplog.at_level("WARNING", logger="flywheel.policy.local"):
        engine = local.LocalPolicy(tmp_path)
    try:
        assert not engine.share_prompts
        assert "not its output head's" in caplog.text
        got = await engine.sample(SHORT, SamplingParams(n=2, max_tokens=4, seed=1))
        assert [len(c.token_ids) for c in got] == [4, 4] and cached(got) == [0, 0]
    finally:
        await engine.close()


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
# Sampled and greedy: the split changes attention only, not how logits are warped (top-p
# is covered by the bit-for-bit cases above); each case runs `generate` on long prompts.
@pytest.mark.parametrize("params", [PARAMS[0], PARAMS[2]], ids=["t1", "greedy"])
async def test_shared_prefix_attention_samples_what_generate_does(
        reference: local.LocalPolicy, split: local.LocalPolicy, lora_dir: Path,
        params: SamplingParams, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group (its rows share the whole prompt), prompts of three lengths under one system
    prompt and tools (they share that start), and the same through a LoRA adapter: every
    token as `generate` samples it, log-probs within float32 rounding — and the split path
    did run (a plain SDPA step would pass the comparison too)."""
    from flywheel.policy import prefix_attention

    splits: list[int] = []
    real = prefix_attention._attend

    def counted(*args: object) -> object:
        splits.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(prefix_attention, "_attend", counted)
    split.prefix_cache.clear()
    worst = 0.0
    for messages, tools in ((LONG, None), TOOLS[0]):
        worst = max(worst, close(await reference.sample(messages, params, tools=tools),
                                 await split.sample(messages, params, tools=tools)))
    prompts = [TOOLS[0][0], TOOLS[1][0], [*TOOLS[0][0][:1], *SHORT]]
    expected = await reference.sample_many(prompts, params, tools=TOOLS[0][1])
    got = await split.sample_many(prompts, params, tools=TOOLS[0][1])
    worst = max(worst, close([c for g in expected for c in g], [c for g in got for c in g]))
    adapter = AdapterRef("policy", 2, lora_dir)  # its own name: other tests retire v1
    for engine in (reference, split):
        await engine.ensure_adapter(adapter)
    worst = max(worst, close(await reference.sample(TOOLS[0][0], params, tools=TOOLS[0][1],
                                                    adapter=adapter),
                             await split.sample(TOOLS[0][0], params, tools=TOOLS[0][1],
                                                adapter=adapter)))
    for engine in (reference, split):
        await engine.retire_adapter(adapter)
    assert worst < ROUNDING
    assert splits  # every layer of every split decode step attends twice
