"""VLLMPolicy against a real vLLM server (started once per session: tests/support/vllm_server.py).

What the mock in test_policy_vllm.py assumes, checked against vLLM itself: a rollout group's
token ids and sampling log-probs equal a fresh forward pass of the local engine on the same
tokens; an adapter version's whole life (load, listing, sampling, retirement, never back
under its name); the adapters vLLM refuses, each failing at once with its fix; how
completions end (EOS in the tokens, stop strings inside a token).
"""

from __future__ import annotations

import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from flywheel.demo.samples import TOOLS
from flywheel.environments import load_environment
from flywheel.policy.base import AdapterRef, Policy, PolicyError, SamplingParams
from flywheel.policy.factory import make_policy
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.policy.vllm import AdapterLoadError, VLLMPolicy
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec
from tests.support.vllm_server import (
    REPORT,
    SERVED,
    CountingTransport,
    RealVLLM,
    post,
    served_settings,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MESSAGES = [{"role": "user", "content": "Say hello to Ada in one short sentence."}]
EOS_ID = 2  # SmolLM2's <|im_end|>


def tolerance(real: RealVLLM) -> tuple[float, float]:
    """(max, mean) abs log-prob difference allowed against the fp32 local engine. fp32:
    measured ≤ 5e-5 here, so 1e-3 still catches any real disagreement (a wrong temperature
    is off by > 1, top-p renormalisation by 0.1); bf16 (GPU default): measured 0.2 / 0.04."""
    return (1e-3, 1e-4) if real.fp32 else (0.75, 0.08)


def weather_task(city: str) -> TaskSpec:
    return TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                    messages=[{"role": "user", "content": f"Weather in {city}, in celsius?"}],
                    verifier=ToolCallSpec(expected=ExpectedCall(
                        name="get_weather", arguments={"city": city, "unit": "c"})),
                    failure_mode="bad_arguments", fingerprint=f"w-{city}", split="holdout")


def counting_policy(real: RealVLLM, **kwargs: Any) -> tuple[VLLMPolicy, CountingTransport]:
    transport = CountingTransport()
    return VLLMPolicy([real.url], model=SERVED, policy_name="policy", transport=transport,
                      backoff_s=0.05, **kwargs), transport


async def test_a_rollout_group_matches_a_fresh_forward_pass_of_the_local_engine(
        vllm_server: RealVLLM, vllm_adapters: dict[str, Path], local_engine: Policy,
        tmp_path: Path) -> None:
    policy = make_policy(served_settings(tmp_path, [vllm_server.url]))
    local: Any = local_engine
    env, task = load_environment("tool_call"), weather_task("Oslo")
    # Each test uses its own version numbers: the session's server keeps what others loaded.
    v1 = AdapterRef("policy", 11, vllm_adapters["v1"])
    diffs: list[float] = []
    try:
        # The base model tempered (processed log-probs include the temperature), then a LoRA
        # version at T = 1 (a smaller group: every completion costs a forward pass here).
        for adapter, temperature, size in ((None, 0.7, 8), (v1, 1.0, 4)):
            if adapter is not None:
                await policy.ensure_adapter(adapter)
                await local.ensure_adapter(adapter)
            cfg = GroupConfig(group_size=size, max_tokens=32, temperature=temperature)
            group = await run_group(policy, task, env, cfg, adapter=adapter, seed=5,
                                    group_key="a")
            mine = await run_group(local, task, env, GroupConfig(group_size=2, max_tokens=1),
                                   adapter=adapter, seed=5, group_key="a")
            ours = mine.rollouts[0].turns[0].prompt_token_ids
            assert all(r.not_run is None for r in group.rollouts), group.rollouts
            assert len({r.turns[0].text for r in group.rollouts}) > 1  # a real group
            for r in group.rollouts:
                (turn,) = r.turns
                assert turn.prompt_token_ids == ours  # one renderer for both engines
                assert len(turn.token_ids) == len(turn.logprobs) > 0
                fresh = await local.logprobs(turn.prompt_token_ids, turn.token_ids,
                                             temperature, adapter=adapter)
                diffs += [abs(a - b) for a, b in zip(fresh, turn.logprobs, strict=True)]
                if adapter is not None and r.index == 0:  # vLLM really applies the adapter
                    base = await local.logprobs(turn.prompt_token_ids, turn.token_ids,
                                                temperature)
                    assert max(abs(a - b) for a, b in zip(base, turn.logprobs,
                                                         strict=True)) > 1e-2
        await policy.retire_adapter(v1)
    finally:
        await policy.close()
    worst, mean = max(diffs), statistics.fmean(diffs)
    REPORT["log-prob |vLLM - local fp32 forward| (max, mean, tokens)"] = (
        f"{worst:.2e}, {mean:.2e}, {len(diffs)}")
    max_tol, mean_tol = tolerance(vllm_server)
    assert worst <= max_tol and mean <= mean_tol, (worst, mean)


async def test_an_adapter_version_is_loaded_listed_sampled_retired_and_never_reloaded(
        vllm_server: RealVLLM, vllm_adapters: dict[str, Path]) -> None:
    policy, transport = counting_policy(vllm_server)
    v1 = AdapterRef("policy", 1, vllm_adapters["v1"])
    loads = (vllm_server.url, "/v1/load_lora_adapter")
    try:
        started = time.monotonic()
        await policy.ensure_adapter(v1)
        REPORT["adapter load (ensure_adapter: load + /v1/models check, s)"] = round(
            time.monotonic() - started, 3)
        card = vllm_server.models()["policy@v1"]
        assert (card["root"], card["parent"]) == (str(v1.path), SERVED)
        params = SamplingParams(n=4, max_tokens=16, seed=3)
        tuned = await policy.sample(MESSAGES, params, adapter=v1)
        base = await policy.sample(MESSAGES, params)
        assert [c.adapter for c in tuned] == ["policy@v1"] * 4
        assert [c.logprobs for c in tuned] != [c.logprobs for c in base]
        await policy.ensure_adapter(v1)  # idempotent: listed already, never loaded twice
        assert transport.calls[loads] == 1

        await policy.retire_adapter(v1)
        assert "policy@v1" not in vllm_server.models()
        with pytest.raises(PolicyError, match="was retired"):
            await policy.sample(MESSAGES, params, adapter=v1)
        with pytest.raises(PolicyError, match="immutable"):
            await policy.ensure_adapter(AdapterRef("policy", 1, vllm_adapters["v2"]))
        assert "policy@v1" not in vllm_server.models()  # nothing brought it back
        assert transport.calls[loads] == 1
        # The server itself: a retired name is unknown, with vLLM's own 404.
        resp = post(vllm_server.url, "/v1/chat/completions", {
            "model": "policy@v1", "messages": MESSAGES, "max_tokens": 1})
        assert resp.status_code == 404 and "does not exist" in resp.text
    finally:
        await policy.close()


@pytest.mark.parametrize(("adapter", "fix"), [
    ("r32", r"rank 32 but the server serves at most 16: start vLLM with --max-lora-rank ≥ 32"),
    ("corrupt", r"publish the weights again as a new version"),
    ("missing", r"No adapter found for .*mount the adapter volume at the same path"),
])
async def test_an_adapter_vllm_refuses_fails_at_once_with_the_fix(
        vllm_server: RealVLLM, vllm_adapters: dict[str, Path], adapter: str, fix: str) -> None:
    policy, transport = counting_policy(vllm_server)
    path = vllm_adapters.get(adapter, vllm_adapters["v1"].parent / "does-not-exist")
    try:
        with pytest.raises(AdapterLoadError, match=fix) as caught:
            await policy.ensure_adapter(AdapterRef("policy", 40, path))
        REPORT[f"refused load: {adapter}"] = f"HTTP {caught.value.status}: {caught.value}"
        assert transport.calls[(vllm_server.url, "/v1/load_lora_adapter")] == 1  # no retry
        replica = policy._replicas[0]
        assert (replica.failures, replica.down_until) == (0, 0.0)  # not benched
        assert "policy@v40" not in vllm_server.models()
        (c,) = await policy.sample(MESSAGES, SamplingParams(n=1, max_tokens=4))
        assert c.extra["replica"] == vllm_server.url
    finally:
        await policy.close()


async def test_a_name_another_instance_placed_from_another_path_is_refused(
        vllm_server: RealVLLM, vllm_adapters: dict[str, Path]) -> None:
    """vLLM itself answers the same 400 "already been loaded" whatever the path: only the
    client's `root` check keeps a version name immutable across processes."""
    first, _ = counting_policy(vllm_server)
    second, transport = counting_policy(vllm_server)
    v2 = AdapterRef("policy", 2, vllm_adapters["v2"])
    try:
        await first.ensure_adapter(v2)
        with pytest.raises(PolicyError, match=r"serves policy@v2 from .*v2, not .*v1.*immutable"):
            await second.ensure_adapter(AdapterRef("policy", 2, vllm_adapters["v1"]))
        assert transport.calls.get((vllm_server.url, "/v1/load_lora_adapter"), 0) == 0
        assert vllm_server.models()["policy@v2"]["root"] == str(v2.path)
        await first.retire_adapter(v2)
    finally:
        await first.close()
        await second.close()


async def test_completions_end_like_the_local_engine_says(vllm_server: RealVLLM) -> None:
    """EOS is sampled (in the tokens and log-probs) but not text; a stop string may end
    inside a token: the text stops at it, the tokens keep the token that completed it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None), local_files_only=True)
    policy, _ = counting_policy(vllm_server)
    try:
        out = await policy.sample(MESSAGES, SamplingParams(n=8, max_tokens=48, seed=1,
                                                           temperature=0.7))
        ended = [c for c in out if c.finish_reason == "stop"]
        assert ended, [c.text for c in out]
        for c in ended:
            assert c.token_ids[-1] == EOS_ID and len(c.logprobs) == len(c.token_ids)
            assert "<|im_end|>" not in c.text
            assert tokenizer.decode(c.token_ids, skip_special_tokens=True) == c.text
        words = [{"role": "user", "content": "Write the word banana five times."}]
        stopped = await policy.sample(words, SamplingParams(n=8, max_tokens=32, seed=2,
                                                            stop=("nan",)))
        cut = [c for c in stopped if c.extra["stop_reason"] == "nan"]
        assert cut, [c.text for c in stopped]
        for c in cut:
            decoded = tokenizer.decode(c.token_ids, skip_special_tokens=True)
            assert c.text.endswith("nan") and decoded.startswith(c.text)
    finally:
        await policy.close()
