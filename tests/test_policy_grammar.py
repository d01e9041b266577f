"""`tool_choice` "required" and a named function decoded under the call grammar on the local
engine (the real SmolLM2-135M): every answer is a well-formed call.

16 BFCL questions (category `multiple`: several functions offered, one to pick) with their
tools, batched in one go, greedy, `max_tokens` 128, on the base model and on an adapter
trained by one SFT step: every answer of `required` and of a named choice calls an offered
tool (the named one) with arguments that validate against its JSON schema; with
`parallel_tool_calls: false`, exactly one call. `required` runs with parallel calls off on the
base model and on on the adapter, to keep this file's time down (each setting on both models:
the vLLM test). The one exception is `max_tokens`: at most `CUT_ALLOWED` answers
may be cut inside their first call (the base model extending an unbounded list: once in 30
questions), and each of those is still a prefix the grammar accepts. The base model's first 10
requests without the grammar (the prefill alone, how `required` was served before; 10 as in
the probe that found it) leave some answers malformed, which is what makes the check able to
fail. Rows without a grammar (`auto`, the gate's decoding) are untouched when they share a
batch with constrained ones, and a constrained row's log-probs are its masked distribution's.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from flywheel.policy import model_cache
from flywheel.policy.base import AdapterRef, SamplingParams
from flywheel.policy.chat_format import ChatFormat
from flywheel.policy.tool_choice import Decoding, decoding
from tests.support.grammar_cases import Request, bfcl_requests, train_sft_adapter
from tests.support.grammar_cases import failures as cut_failures

torch = pytest.importorskip("torch")
local = pytest.importorskip("flywheel.policy.local")
bfcl_eval = pytest.importorskip(
    "bfcl_eval", reason="bfcl-eval (BFCL's data) is a test-only dependency; `make install`")
DATA = Path(bfcl_eval.__file__).parent / "data"

pytestmark = pytest.mark.slow

QUESTIONS = 16  # the vLLM test (optional step) decodes 30
MAX_TOKENS = 128
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
EMAIL = {"type": "function", "function": {
    "name": "send_email", "description": "Send an email.",
    "parameters": {"type": "object", "properties": {"to": {"type": "string"},
                                                    "body": {"type": "string"}},
                   "required": ["to", "body"]}}}
ASK = [{"role": "user", "content": "What's the weather in Oslo for 3 days?"}]


@pytest.fixture(scope="module")
def requests() -> list[Request]:
    return bfcl_requests(DATA, "multiple", QUESTIONS)


@pytest.fixture(scope="module")
async def policy() -> AsyncIterator[Any]:
    engine = local.LocalPolicy(model_cache.default_model_dir(model_cache.default_cache_root()),
                               policy_name="policy", max_batch=8, max_rows=QUESTIONS,
                               prefix_cache_mb=1024)  # every prompt encoded once per adapter
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
async def adapter(policy: Any, tmp_path_factory: pytest.TempPathFactory) -> AdapterRef:
    """An adapter trained by one SFT step on 4 other BFCL questions' reference calls (its
    LoRA weights moved off their zero init, so every answer goes through the adapter's path;
    how good it is does not matter to the grammar, and each step costs ~35 s on one core)."""
    train = bfcl_requests(DATA, "multiple", 4, skip=QUESTIONS)
    path = await asyncio.to_thread(train_sft_adapter, tmp_path_factory.mktemp("sft"), train,
                                   steps=1)
    ref = AdapterRef("policy", 1, path)
    await policy.ensure_adapter(ref)
    return ref


async def answers(policy: Any, requests: list[Request], choice: str, parallel: bool, *,
                  adapter: AdapterRef | None = None, grammar: bool = True
                  ) -> list[tuple[Request, Decoding, Any]]:
    """Every request decoded as serving decodes it, all submitted at once (one batch)."""
    fmt: ChatFormat = policy.chat_format
    plans = []
    for r in requests:
        d = decoding(fmt, r.messages, r.tools, choice.replace("{expected}", r.expected),
                     parallel)
        plans.append((r, d if grammar else dataclasses.replace(d, grammar=None)))
    before = policy.batcher.batches
    done = await asyncio.gather(*(policy.sample(
        r.messages, SamplingParams(n=1, max_tokens=MAX_TOKENS, temperature=0.0,
                                   stop=d.stop, prefill=d.prefill, grammar=d.grammar),
        tools=d.tools, adapter=adapter) for r, d in plans))
    assert policy.batcher.batches == before + 1  # all in one batch
    return [(r, d, c) for (r, d), (c,) in zip(plans, done, strict=True)]


def failures(fmt: ChatFormat, results: list[tuple[Request, Decoding, Any]], *,
             named: bool = False, one: bool = False, policy: Any = None) -> list[str]:
    return cut_failures(fmt, results, None if policy is None else policy._grammar_set(),
                        named=named, one=one)


async def test_required_and_named_on_the_base_model_always_call_an_offered_tool(
        policy: Any, requests: list[Request]) -> None:
    fmt = policy.chat_format
    required = await answers(policy, requests, "required", parallel=False)
    assert failures(fmt, required, one=True, policy=policy) == []
    # the turn ends where the grammar does (rows not cut by max_tokens end on EOS)
    assert all(c.token_ids[-1] in policy._eos_ids for _, _, c in required
               if c.finish_reason == "stop")
    named = await answers(policy, requests, "function:{expected}", parallel=True)
    assert failures(fmt, named, named=True, one=True, policy=policy) == []
    # Without the grammar (the prefill alone) the same greedy requests leave calls malformed:
    # the check above is one the base model fails by itself.
    loose = await answers(policy, requests[:10], "required", parallel=False, grammar=False)
    assert failures(fmt, loose), "the base model answered every question well unconstrained"


async def test_required_and_named_on_a_trained_adapter(
        policy: Any, requests: list[Request], adapter: AdapterRef) -> None:
    fmt = policy.chat_format
    required = await answers(policy, requests, "required", parallel=True, adapter=adapter)
    assert failures(fmt, required, policy=policy) == []
    assert all(c.adapter == adapter.name for _, _, c in required)
    named = await answers(policy, requests, "function:{expected}", parallel=True,
                          adapter=adapter)
    assert failures(fmt, named, named=True, one=True, policy=policy) == []


async def test_parallel_calls_allowed_by_the_grammar(policy: Any) -> None:
    """`required` with parallel calls: the grammar lets a second call follow the first."""
    fmt = policy.chat_format
    two = [{"role": "user", "content": "Email ann@x.org and bob@x.org: the meeting moved."}]
    d = decoding(fmt, two, [WEATHER, EMAIL], "required", parallel=True)
    assert d.max_calls is None and d.grammar is not None
    matcher = policy._grammar_set().matcher(d.grammar)
    call = '<tool_call>\n{"name": "send_email", "arguments": {"to": "a", "body": "b"}}\n' \
           '</tool_call>'
    text = (call + "\n" + call).removeprefix(d.prefill)
    assert matcher.consume_tokens(fmt.encode(text)) and matcher.is_accepting()
    single = decoding(fmt, two, [WEATHER, EMAIL], "required", parallel=False)
    matcher = policy._grammar_set().matcher(single.grammar)
    assert matcher.try_consume_tokens(fmt.encode(text)) < len(fmt.encode(text))


async def test_the_grammar_accepts_the_templates_calls_and_refuses_bad_ones(
        policy: Any) -> None:
    fmt = policy.chat_format
    d = decoding(fmt, ASK, [WEATHER, EMAIL], "required", parallel=False)
    grammars = policy._grammar_set()

    def accepted(call: str) -> bool:
        matcher = grammars.matcher(d.grammar)
        ids = fmt.encode(call.removeprefix(d.prefill))
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    good = fmt.reply_text(ASK, {"content": None, "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}}]}, [WEATHER, EMAIL])
    assert accepted(good.removesuffix(fmt.end_of_turn))
    opening = '<tool_call>\n{"name": '
    for bad in ('"get_weather", "arguments": {"city": 5}}\n</tool_call>',  # wrong type
                '"get_weather", "arguments": {"days": 3}}\n</tool_call>',  # missing required
                '"get_forecast", "arguments": {"city": "Oslo"}}\n</tool_call>',  # not offered
                '"get_weather", "arguments": {"city": "Oslo"}\n</tool_call>'):  # unbalanced
        assert not accepted(opening + bad), bad


async def test_auto_rows_are_untouched_by_constrained_rows_in_their_batch(
        policy: Any, requests: list[Request]) -> None:
    """Three `auto` requests (the gate's decoding: no grammar) share a batch with a fourth
    request, once decoded under its grammar and once not: the `auto` rows come out
    bit-for-bit the same, so only the rows that ask for a grammar pay for it."""
    fmt = policy.chat_format
    auto = [decoding(fmt, r.messages, r.tools, "auto", parallel=True) for r in requests[:3]]
    assert all(d.grammar is None and not d.prefill for d in auto)
    params = SamplingParams(n=2, max_tokens=24, temperature=0.0)
    required = decoding(fmt, requests[3].messages, requests[3].tools, "required", True)

    async def batch(grammar: str | None) -> tuple[list[Any], list[Any]]:
        before = policy.batcher.batches
        *rows, fourth = await asyncio.gather(
            *(policy.sample(r.messages, params, tools=r.tools) for r in requests[:3]),
            policy.sample(requests[3].messages, dataclasses.replace(
                params, prefill=required.prefill, grammar=grammar), tools=requests[3].tools))
        assert policy.batcher.batches == before + 1  # one batch: the same forward passes
        return rows, fourth

    free, _ = await batch(None)
    shared, _ = await batch(required.grammar)
    assert [[(c.token_ids, c.logprobs) for c in g] for g in shared] == \
        [[(c.token_ids, c.logprobs) for c in g] for g in free]


async def test_constrained_logprobs_are_the_masked_distributions(
        policy: Any, requests: list[Request]) -> None:
    """Sampled at T = 1 under the grammar: each token's reported log-prob is its log-prob
    under the renormalised mask, never below the unmasked model's, and above it wherever the
    mask removed probability mass."""
    r = requests[0]
    d = decoding(policy.chat_format, r.messages, r.tools, "required", parallel=True)
    (c,) = await policy.sample(r.messages, SamplingParams(
        n=1, max_tokens=48, temperature=1.0, seed=3, prefill=d.prefill, grammar=d.grammar),
        tools=r.tools)
    raw = await policy.logprobs(c.prompt_token_ids, c.token_ids, 1.0)
    assert all(m >= u - 1e-4 for m, u in zip(c.logprobs, raw, strict=True))
    assert sum(c.logprobs) > sum(raw) + 1e-3


async def test_the_generate_path_samples_what_the_shared_path_samples(
        policy: Any, requests: list[Request]) -> None:
    """A model that cannot share prompts samples through `generate` with the grammar as a
    logits processor: the same greedy calls, the same masked log-probs."""
    alone = local.LocalPolicy(model_cache.default_model_dir(model_cache.default_cache_root()),
                              share_prompts=False)
    try:
        outs = []
        for engine in (policy, alone):
            got = await answers(engine, requests[:4], "required", parallel=True)
            outs.append([(c.token_ids, c.logprobs) for _, _, c in got])
            assert failures(engine.chat_format, got) == []
        assert [t for t, _ in outs[0]] == [t for t, _ in outs[1]]
        assert all(abs(a - b) < 1e-3 for (_, x), (_, y) in zip(*outs, strict=True)
                   for a, b in zip(x, y, strict=True))
    finally:
        await alone.close()
