"""`tool_choice` "required" and a named function through a real vLLM server (the `vllm` tests):
the call grammar goes as vLLM's structured output, and every answer is a well-formed call.

The same 30 BFCL questions as tests/test_policy_grammar.py, greedy, `max_tokens` 128, sent
at once through `VLLMPolicy` (the prefill continued with `continue_final_message`, the
grammar as `structured_outputs: {"grammar": ...}`), on the base model and on an adapter
trained by a few SFT steps: every answer calls an offered tool (the named one) with arguments
that validate against its schema, one call when parallel calls are off — but for at most
`CUT_ALLOWED` answers `max_tokens` cut inside their first call, each a prefix the grammar
accepts (seen: 1 of 30 with parallel calls on the base model, as on the local engine).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from flywheel.policy.base import AdapterRef, SamplingParams
from flywheel.policy.chat_format import load_chat_format
from flywheel.policy.grammar_masks import Grammars
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.policy.tool_choice import decoding
from flywheel.policy.vllm import VLLMPolicy
from tests.support.grammar_cases import (
    Request,
    bfcl_requests,
    failures,
    grammar_set,
    train_sft_adapter,
)
from tests.support.vllm_server import REPORT, SERVED, RealVLLM

bfcl_eval = pytest.importorskip(
    "bfcl_eval", reason="bfcl-eval (BFCL's data) is a test-only dependency; `make install`")
DATA = Path(bfcl_eval.__file__).parent / "data"

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

QUESTIONS = 30
MAX_TOKENS = 128


async def answer_all(policy: VLLMPolicy, requests: list[Request], choice: str, parallel: bool,
                     adapter: AdapterRef | None, grammars: Grammars, cut: list[str]
                     ) -> list[str]:
    fmt = policy.chat_format
    plans = [(r, decoding(fmt, r.messages, r.tools, choice.replace("{expected}", r.expected),
                          parallel)) for r in requests]
    done = await asyncio.gather(*(policy.sample(
        r.messages, SamplingParams(n=1, max_tokens=MAX_TOKENS, temperature=0.0, stop=d.stop,
                                   prefill=d.prefill, grammar=d.grammar),
        tools=d.tools, adapter=adapter) for r, d in plans))
    named = choice.startswith("function:")
    return failures(fmt, [(r, d, c) for (r, d), (c,) in zip(plans, done, strict=True)],
                    grammars, named=named, one=named or not parallel, cut=cut)


async def test_required_and_named_through_vllm_always_call_an_offered_tool(
        vllm_server: RealVLLM, tmp_path: Path) -> None:
    model_dir = resolve_model_dir(None)
    fmt = load_chat_format(model_dir)
    requests = bfcl_requests(DATA, "multiple", QUESTIONS)
    grammars = grammar_set(model_dir)
    adapter_dir = await asyncio.to_thread(
        train_sft_adapter, tmp_path / "sft", bfcl_requests(DATA, "multiple", 16, skip=QUESTIONS))
    policy = VLLMPolicy([vllm_server.url], model=SERVED, policy_name="policy", chat_format=fmt,
                        backoff_s=0.05)
    # Its own version number: the session's server keeps what other tests loaded.
    adapter = AdapterRef("policy", 31, adapter_dir)
    summary: dict[str, Any] = {}
    try:
        await policy.ensure_adapter(adapter)
        for label, ref in (("base", None), ("sft", adapter)):
            for choice, parallel in (("required", True), ("required", False),
                                     ("function:{expected}", True)):
                cut: list[str] = []
                bad = await answer_all(policy, requests, choice, parallel, ref, grammars, cut)
                summary[f"{label} {choice} parallel={parallel}"] = \
                    f"{QUESTIONS - len(bad) - len(cut)}/{QUESTIONS} (+{len(cut)} cut by " \
                    f"max_tokens inside the first call, a grammar prefix)"
                assert bad == [], (label, choice, parallel, bad)
        await policy.retire_adapter(adapter)
    finally:
        REPORT["call grammar: well-formed calls"] = summary
        await policy.close()
