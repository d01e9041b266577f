"""BFCL questions with their tools as serving requests, a short SFT adapter, and the check that
an answer is a well-formed call (test helper for the call-grammar tests, local and vLLM).

A request is a BFCL question (its first turn) with its functions as OpenAI tools (BFCL's
Python-ish types turned into JSON schema by `bfcl_harness.convert`, descriptions kept). An
answer passes when serving's own reading of it (`tool_choice.answer`) returns tool calls, each
naming an offered tool (the named one, for a named choice) with arguments that validate
against that tool's schema (`jsonschema`, Draft 2020-12) — independent of the grammar. An
answer `max_tokens` cut inside a later parallel call passes on the complete calls before it
(serving returns those, `finish_reason: length`); one cut inside its *first* call has no
complete call to return, and `failures` lets at most `CUT_ALLOWED` of those through, each only
if its tokens are a prefix the grammar accepts (the base model extending an unbounded list
until `max_tokens`: vLLM's structured output stops there the same way).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from flywheel.policy.base import Completion
from flywheel.policy.chat_format import ChatFormat
from flywheel.policy.grammar_masks import Grammars
from flywheel.policy.tool_choice import Decoding, answer
from tests.support.bfcl_harness import Case, load, reference


@dataclass(frozen=True)
class Request:
    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    """OpenAI shape, as a client sends them."""
    expected: str
    """The function BFCL's answer calls first (the named choice's name)."""
    case: Case

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}


def bfcl_requests(data: Path, category: str, n: int, *, skip: int = 0) -> list[Request]:
    """`n` questions of `category` after the first `skip` (drawn by the harness's seed)."""
    questions = {q["id"]: q for q in (json.loads(line) for line in
                                      (data / f"BFCL_v4_{category}.json").open())}
    cases, _ = load(data, category, n + skip + 20)
    out = []
    for case in cases[skip:]:
        turn = questions[case.id]["question"][0]
        described = {f["name"]: f.get("description") for f in case.functions}
        tools = [{"type": "function", "function": {
            "name": t["name"], "description": described.get(t["name"]) or "",
            "parameters": t["parameters"]}} for t in case.tools]
        out.append(Request(case.id, [dict(m) for m in turn], tools,
                           case.spec.expected[0].name, case))
        if len(out) == n:
            break
    assert len(out) == n, f"only {len(out)} usable {category} questions"
    return out


def problem(fmt: ChatFormat, d: Decoding, text: str, finish: str, request: Request, *,
            named: str | None = None, one: bool = False) -> str | None:
    """What is wrong with the answer `text` (None: a well-formed call as asked)."""
    message, finish_reason = answer(fmt, d, text, finish, (), id_prefix="call_t_")
    if not message.get("tool_calls"):
        return f"no call ({finish_reason}): {str(message.get('content'))[:200]!r}"
    # (cut by max_tokens inside a later parallel call, the complete ones are the answer)
    written = message["tool_calls"] if finish_reason == "length" else \
        fmt.parse(d.prefill + text)["tool_calls"]
    if one and len(written) != 1:
        return f"{len(written)} calls where one was allowed"
    for call in message["tool_calls"]:
        name = call["function"]["name"]
        if name not in request.schemas or (named is not None and name != named):
            return f"calls {name!r}, offered {sorted(request.schemas)}, named {named!r}"
        arguments = json.loads(call["function"]["arguments"])
        errors = sorted(jsonschema.Draft202012Validator(request.schemas[name])
                        .iter_errors(arguments), key=str)
        if errors:
            return f"{name}({arguments}): {errors[0].message}"
    return None


CUT_ALLOWED = 2
"""Answers `max_tokens` may cut inside their first call (seen: 1 of 30 on both engines, an
unbounded list the base model keeps extending); each must still be a prefix the grammar
accepts."""


def failures(fmt: ChatFormat, results: list[tuple[Request, Decoding, Completion]],
             grammars: Grammars | None, *, named: bool = False, one: bool = False,
             cut: list[str] | None = None) -> list[str]:
    """Every answer in `results` that is not a well-formed call as asked (`problem`), less at
    most `CUT_ALLOWED` cut by `max_tokens` whose tokens `grammars` accepts as a prefix (those
    are appended to `cut`, for the caller to report)."""
    out: list[str] = []
    cut = [] if cut is None else cut
    for r, d, c in results:
        why = problem(fmt, d, c.text, c.finish_reason, r,
                      named=r.expected if named else None, one=one)
        if why is None:
            continue
        if grammars is not None and c.finish_reason == "length" and d.grammar is not None \
                and grammars.matcher(d.grammar).consume_tokens(c.token_ids):
            cut.append(f"{r.id}: {why}")  # well-formed as far as it got
            continue
        out.append(f"{r.id}: {why}")
    return out if len(cut) <= CUT_ALLOWED else out + cut


def grammar_set(model_dir: Path) -> Grammars:
    """llguidance's view of the model's tokenizer, as the local engine builds it."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    eos = tokenizer.eos_token_id
    return Grammars(tokenizer, int(config.vocab_size), eos if isinstance(eos, list) else [eos])


def train_sft_adapter(directory: Path, requests: list[Request], *, steps: int = 4) -> Path:
    """A LoRA adapter trained for a few SFT steps on `requests`' reference calls (the
    trainer's own `sft_step`, its default rank and warm-start learning rate)."""
    from flywheel.config import TrainerSettings
    from flywheel.mining.demos import Demonstration
    from flywheel.policy.model_cache import resolve_model_dir
    from flywheel.trainer.engine import LoRASpec, LoRATrainer
    from flywheel.trainer.grpo import GRPOConfig

    t = TrainerSettings()
    trainer = LoRATrainer(resolve_model_dir(None), lora=LoRASpec(r=t.lora_r, alpha=t.lora_alpha),
                          grpo=GRPOConfig(), lr=t.lr, micro_batch=t.micro_batch, device="cpu")
    demos = [Demonstration(
        messages=r.messages, tools=r.tools, reply={"content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}
            for i, (name, args) in enumerate(reference(r.case.spec))]},
        source_trajectory_id=uuid.uuid4(), fingerprint=r.id, env="tool_call")
        for r in requests]
    for step in range(steps):
        batch = [demos[(step * 4 + k) % len(demos)] for k in range(4)]
        trainer.sft_step(batch, lr=t.sft_lr)
    trainer.model.save_pretrained(directory)
    return directory
