"""SFT warm start without services: trajectories → demonstrations, the holdout filter, token
labels (the real tokenizer), and the completion-only loss on a tiny stand-in model."""

from __future__ import annotations

import copy
import json
import random
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from flywheel.demo.samples import TOOLS
from flywheel.environments.prompt import task_messages, task_tools
from flywheel.mining.build import build_task, request_key, split_of
from flywheel.mining.classify import classify_failure
from flywheel.mining.demos import (
    Candidate,
    Demonstration,
    HeldOut,
    assistant_reply,
    demonstration_from_task,
    reserved_for_grpo,
    select,
    success_demonstration,
    success_task,
)
from flywheel.tasks import TaskSpec
from flywheel.trainer.sft import (
    IGNORE,
    SFTExample,
    collate,
    completion_loss,
    encode_demonstration,
    sft_step,
)
from flywheel.trajectory import Trajectory, parse_trajectory

SYSTEM = "You are a support bot. Use the tools."
WEATHER = {"city": "Paris", "unit": "c"}
UNSAFE = {"type": "function", "name": "delete_all_tickets", "x-unsafe": True,
          "parameters": {"type": "object", "properties": {}}}


def record(prompt: str, calls: list[tuple[str, Any, str]], *, status: str = "success",
           session: str = "s-1", outcome: dict[str, Any] | None = None,
           tools: list[dict[str, Any]] | None = None, meta: dict[str, Any] | None = None
           ) -> Trajectory:
    """A support-bot trajectory; `calls` are (tool, arguments, output status)."""
    items: list[dict[str, Any]] = [{"type": "message", "role": "system", "content": SYSTEM},
                                   {"type": "message", "role": "user", "content": prompt}]
    for n, (name, args, out) in enumerate(calls):
        items += [{"type": "function_call", "call_id": f"c{n}", "name": name,
                   "arguments": args if isinstance(args, str) else json.dumps(args)},
                  {"type": "function_call_output", "call_id": f"c{n}", "output": "{}",
                   "status": out}]
    items.append({"type": "message", "role": "assistant", "content": "Done."})
    rec: dict[str, Any] = {"trajectory_id": str(uuid.uuid4()), "agent": "support-bot",
                           "session_id": session, "tools": TOOLS if tools is None else tools,
                           "items": items, "outcome": {"status": status, **(outcome or {})}}
    if meta:
        rec["metadata"] = meta
    return parse_trajectory(rec)


def corrected(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"human_intervention": {"corrected_items": [
        {"type": "function_call", "call_id": "fix", "name": name,
         "arguments": json.dumps(args)}]}}


# --- trajectories → demonstrations ---------------------------------------------------------

def test_a_success_teaches_its_first_call_as_the_rollout_prompts_it() -> None:
    t = record("What's the weather in Paris?",
               [("get_weather", WEATHER, "ok"), ("send_email", {"to": "a@b.c"}, "ok")])
    demo = success_demonstration(t)
    task = success_task(t)
    assert demo is not None
    assert task is not None
    # The task's own messages and tools: the rollout prompt of the same task.
    assert demo.messages == task_messages(task) and demo.tools == task_tools(task)
    assert demo.messages[0] == {"role": "system", "content": SYSTEM}
    assert demo.messages[-1] == {"role": "user", "content": "What's the weather in Paris?"}
    assert demo.reply == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(WEATHER)}}]}
    assert demo.source_trajectory_id == t.trajectory_id and demo.env == "tool_call"


def test_a_success_has_the_fingerprint_the_miner_gives_the_same_failed_request() -> None:
    ok = record("What's the weather in Paris?", [("get_weather", WEATHER, "ok")])
    failed = record("What's the weather in Paris?", [("get_weather", {"city": "Paris"}, "ok")],
                    status="failure", session="s-2",
                    outcome=corrected("get_weather", WEATHER))
    demo = success_demonstration(ok)
    task = build_task(failed, classify_failure(failed, None))
    assert isinstance(task, TaskSpec) and demo is not None
    fixed = demonstration_from_task(task, failed.trajectory_id)  # what a train task gives
    assert fixed is not None
    assert demo.fingerprint == fixed.fingerprint == task.fingerprint
    assert (demo.messages, demo.completion) == (fixed.messages, fixed.completion)
    assert fixed.source_trajectory_id == failed.trajectory_id


def test_a_failure_teaches_only_its_correction() -> None:
    """A failure is never a demonstration itself; its train task, once a person or a retry
    says what was right, demonstrates the correction."""
    wrong = [("send_email", {"to": "x@y.z", "subject": "weather"}, "ok")]
    bare = record("What's the weather in Paris?", wrong, status="failure")
    assert success_demonstration(bare) is None
    assert not isinstance(build_task(bare, classify_failure(bare, None)), TaskSpec)
    by_person = record("What's the weather in Paris?", wrong, status="failure",
                       outcome=corrected("get_weather", WEATHER))
    retry = record("What's the weather in Paris?", [("get_weather", WEATHER, "ok")])
    tasks = [build_task(by_person, classify_failure(by_person, None)),
             build_task(bare, classify_failure(bare, None), retry=retry)]
    for task in tasks:
        assert isinstance(task, TaskSpec)
        demo = demonstration_from_task(task, uuid.uuid4())
        assert demo is not None
        assert [c["function"]["name"] for c in demo.reply["tool_calls"]] == ["get_weather"]


def test_a_correction_with_several_calls_demonstrates_all_of_them() -> None:
    """The chat format's `tool_calls` hold a multi-call correction (parallel calls)."""
    both = [("get_weather", WEATHER), ("get_weather", {"city": "Oslo", "unit": "c"})]
    failed = record("Weather in Paris and in Oslo?", [("get_weather", WEATHER, "ok")],
                    status="failure", outcome={"human_intervention": {"corrected_items": [
                        {"type": "function_call", "call_id": f"fix{n}", "name": name,
                         "arguments": json.dumps(args)} for n, (name, args) in enumerate(both)]}})
    task = build_task(failed, classify_failure(failed, None))
    assert isinstance(task, TaskSpec) and len(task.verifier.expected) == 2  # type: ignore[union-attr]
    demo = demonstration_from_task(task, failed.trajectory_id)
    assert demo is not None and demo.reply == assistant_reply(both)


@pytest.mark.parametrize("case", ["first_call_errored", "hallucinated", "unsafe",
                                  "arguments_not_json", "no_call", "workplace", "no_tools"])
def test_successes_that_demonstrate_nothing_usable(case: str) -> None:
    prompt = "What's the weather in Paris?"
    t = {
        "first_call_errored": lambda: record(prompt, [("get_weather", {"city": 1}, "error"),
                                                      ("get_weather", WEATHER, "ok")]),
        "hallucinated": lambda: record(prompt, [("get_forecast", WEATHER, "ok")]),
        "unsafe": lambda: record(prompt, [("delete_all_tickets", {}, "ok")],
                                 tools=[*TOOLS, UNSAFE]),
        "arguments_not_json": lambda: record(prompt, [("get_weather", '{"city": "Par', "ok")]),
        "no_call": lambda: record(prompt, []),
        "workplace": lambda: record(prompt, [("get_weather", WEATHER, "ok")], meta={
            "environment": {"name": "workplace", "initial_state": {}}}),
        "no_tools": lambda: record(prompt, [("get_weather", WEATHER, "ok")], tools=[]),
    }[case]()
    assert success_demonstration(t) is None


def _demo(fp: str, city: str = "x") -> Demonstration:
    return Demonstration(messages=[{"role": "user", "content": fp}], tools=TOOLS,
                         reply=assistant_reply([("get_weather", {"city": city})]),
                         source_trajectory_id=uuid.uuid4(), fingerprint=fp, env="tool_call")


def test_select_dedupes_orders_and_refuses_everything_holdout_owns() -> None:
    src, req = uuid.uuid4(), ("s-9", "k")
    train_fp = "f0" * 32  # split_of: 0xf0f0f0f0 / 2³² ≈ 0.94, so train
    cands = [Candidate(_demo("0b"), (uuid.uuid4(),), ()),
             Candidate(_demo("0a"), (uuid.uuid4(),), ()),
             Candidate(_demo("0a"), (uuid.uuid4(),), ()),          # duplicate of the above
             Candidate(_demo("0a", "y"), (uuid.uuid4(),), ()),     # same task, other call
             Candidate(_demo("0e"), (uuid.uuid4(),), ()),          # a holdout fingerprint
             Candidate(_demo("0c"), (uuid.uuid4(), src), ()),      # a holdout source
             Candidate(_demo("0d"), (uuid.uuid4(),), (req,)),     # a holdout request
             Candidate(_demo(train_fp), (uuid.uuid4(),), ())]
    held = HeldOut(frozenset({"0e"}), frozenset({src}), frozenset({req}))
    picked = select(cands, held)
    assert [(d.fingerprint, d.completion) for d in picked] == [
        ("0a", _demo("", "x").completion), ("0a", _demo("", "y").completion),
        ("0b", _demo("", "x").completion), (train_fp, _demo("", "x").completion)]
    assert picked[0].source_trajectory_id == cands[1].demo.source_trajectory_id  # first kept
    assert select(cands, held, limit=2) == picked[:2]
    # With the miner's fraction, fingerprints it would hold out later are refused too.
    prospective = select(cands, HeldOut(holdout_fraction=0.2))
    assert all(split_of(d.fingerprint, 0.2) == "train" for d in prospective)
    assert train_fp in {d.fingerprint for d in prospective}
    assert not {"0a", "0b"} & {d.fingerprint for d in prospective}  # 0x0a / 2³² < 0.2


def test_the_share_left_to_grpo_is_deterministic_and_independent_of_the_holdout() -> None:
    rng = random.Random(3)
    fps = [f"{rng.getrandbits(256):064x}" for _ in range(4000)]
    left = [fp for fp in fps if reserved_for_grpo(fp, 0.5)]
    assert abs(len(left) / len(fps) - 0.5) < 0.03
    assert left == [fp for fp in fps if reserved_for_grpo(fp, 0.5)]
    assert not any(reserved_for_grpo(fp, 0.0) for fp in fps)
    # Among train-side fingerprints the same share is left out as among holdout ones.
    train = [fp for fp in fps if split_of(fp, 0.3) == "train"]
    holdout = [fp for fp in fps if split_of(fp, 0.3) == "holdout"]
    for side in (train, holdout):
        assert abs(sum(reserved_for_grpo(fp, 0.5) for fp in side) / len(side) - 0.5) < 0.05
    cands = [Candidate(_demo(fp), (uuid.uuid4(),), ()) for fp in fps[:200]]
    picked = {d.fingerprint for d in select(cands, HeldOut(reserve_share=0.5))}
    assert picked == {fp for fp in fps[:200] if not reserved_for_grpo(fp, 0.5)}


def test_request_of_a_retry_matches_its_failure() -> None:
    a = record("What's  the weather in PARIS?", [], status="failure")
    b = record("what's the weather in paris?", [("get_weather", WEATHER, "ok")])
    assert request_key(a) == request_key(b)


# --- tokens and labels --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from flywheel.policy.model_cache import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None), local_files_only=True)


def test_labels_cover_exactly_the_reply_and_the_end_of_turn(tokenizer: Any) -> None:
    from flywheel.policy.chat_format import chat_format_for, openai_tools, template_messages

    fmt = chat_format_for(tokenizer)
    demo = success_demonstration(record("What's the weather in Paris?",
                                        [("get_weather", WEATHER, "ok")]))
    assert demo is not None
    ex = encode_demonstration(fmt, demo)
    prompt = fmt.render(demo.messages, demo.tools)  # what sampling starts from
    assert ex.input_ids[:len(prompt)] == prompt
    assert ex.labels[:len(prompt)] == [IGNORE] * len(prompt)
    trained = ex.input_ids[len(prompt):]
    assert ex.labels[len(prompt):] == trained and ex.target_len == len(trained)
    assert trained[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.decode(trained) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
        "\n</tool_call><|im_end|>")
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")  # no prefill
    # The template's own generation span marks exactly the trained tokens.
    enc = tokenizer.apply_chat_template(
        template_messages([*demo.messages, demo.reply]), tools=openai_tools(demo.tools),
        chat_template=fmt.template, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True)
    assert [t for t, m in zip(enc["input_ids"], enc["assistant_masks"], strict=True) if m] \
        == trained


def test_collate_left_pads_and_keeps_the_last_targets() -> None:
    a = SFTExample([1, 2, 3, 4], [IGNORE, IGNORE, 3, 4])
    b = SFTExample([5, 6, 7], [IGNORE, IGNORE, 7])
    batch = collate([a, b], pad_id=0)
    assert batch["ids"].tolist() == [[1, 2, 3, 4], [0, 5, 6, 7]]
    assert batch["attn"].tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    assert batch["targets"].tolist() == [[3, 4], [IGNORE, 7]]


class Bigram(torch.nn.Module):
    """Next-token logits from the current token only: losses are easy to compute by hand."""

    def __init__(self, vocab: int = 9) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, logits_to_keep: int) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids][:, -logits_to_keep:])


EXAMPLES = [SFTExample([1, 2, 3, 4, 5], [IGNORE, IGNORE, IGNORE, 4, 5]),
            SFTExample([6, 7, 8], [IGNORE, IGNORE, 8]),
            SFTExample([2, 2, 3, 1], [IGNORE, 2, 3, 1])]


def test_completion_loss_scores_only_targets_from_the_token_before() -> None:
    torch.manual_seed(0)
    model = Bigram()
    loss, n, _ = completion_loss(model, collate(EXAMPLES, pad_id=0))
    logp = torch.log_softmax(model.table.detach(), -1)
    by_hand = -sum(logp[e.input_ids[t - 1], e.input_ids[t]]
                   for e in EXAMPLES for t in range(len(e.input_ids)) if e.labels[t] != IGNORE)
    assert n == 6
    assert float(loss.detach()) == pytest.approx(float(by_hand), rel=1e-5)


def test_sft_step_is_the_same_update_whatever_the_micro_batch() -> None:
    torch.manual_seed(0)
    a = Bigram()
    b = copy.deepcopy(a)
    ma = sft_step(a, torch.optim.SGD(a.parameters(), lr=0.5), EXAMPLES, pad_id=0,
                  micro_batch=1, grad_clip=100.0)
    mb = sft_step(b, torch.optim.SGD(b.parameters(), lr=0.5), EXAMPLES, pad_id=0,
                  micro_batch=8, grad_clip=100.0)
    assert torch.allclose(a.table, b.table, atol=1e-6)
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-6) and ma["tokens"] == 6
    after, _, _ = completion_loss(a, collate(EXAMPLES, pad_id=0))
    assert float(after.detach()) / 6 < ma["loss"]  # the step lowered the loss it reported


def test_sft_batches_shuffle_once_wrap_around_and_never_repeat_within_a_batch() -> None:
    from flywheel.trainer.sft import sft_batches

    batches = list(sft_batches(list(range(10)), steps=4, batch=4))
    assert [len(b) for b in batches] == [4, 4, 4, 4]
    assert all(len(set(b)) == len(b) for b in batches)
    flat = [x for b in batches for x in b]
    assert sorted(flat[:10]) == list(range(10))   # one pass over all before any repeat
    assert flat[10:] == flat[:6]                  # then the same order again
    assert flat[:10] != list(range(10))            # shuffled (fixed seed)
    assert batches == list(sft_batches(list(range(10)), steps=4, batch=4))
    few = list(sft_batches([1, 2], steps=2, batch=8))  # fewer demonstrations than a batch
    assert len(few) == 2 and all(sorted(b) == [1, 2] for b in few)
    assert list(sft_batches([], steps=3, batch=8)) == []


def test_sft_batches_by_stratum_give_every_stratum_its_share() -> None:
    from flywheel.trainer.sft import sft_batches

    # 40 demonstrations of one tool, 2 and 4 of two others (the demo's traffic had 105/2/4).
    demos = [f"ticket-{i}" for i in range(40)] + ["weather-0", "weather-1"] + \
        [f"email-{i}" for i in range(4)]
    kind = lambda d: d.split("-")[0]  # noqa: E731
    batches = list(sft_batches(demos, steps=6, batch=8, stratum=kind))
    assert [len(b) for b in batches] == [8] * 6
    assert all(len(set(b)) == len(b) for b in batches)
    for b in batches:
        counts = {k: sum(kind(d) == k for d in b) for k in ("ticket", "weather", "email")}
        assert counts["weather"] == 2  # both, in every batch: fewer than its turns
        assert counts["email"] == 3 and counts["ticket"] == 3
    flat = [d for b in batches for d in b]
    tickets = [d for d in flat if kind(d) == "ticket"]
    assert len(set(tickets)) == len(tickets) == 18  # no ticket twice before all 40 went
    assert batches == list(sft_batches(demos, steps=6, batch=8, stratum=kind))
    unstratified = [d for b in sft_batches(demos, steps=6, batch=8) for d in b]
    assert sum(kind(d) == "ticket" for d in unstratified) > 36  # as they come: ~87%
    assert list(sft_batches([], steps=2, batch=8, stratum=kind)) == []
    assert [sorted(b) for b in sft_batches(["a-1", "b-1"], steps=1, batch=8,
                                           stratum=kind)] == [["a-1", "b-1"]]


def test_sft_batches_keep_the_share_of_what_no_stratum_balances() -> None:
    """An episode's demonstrations are half answers (its last turn: when to stop), half calls
    of a few tools, one combination of them rare. Balancing the answers as one more "tool"
    gave them an eighth of the warm start and the rare combination as much (seed 11 of the
    helpdesk: 559 of 1,187 answers; 5 demonstrations of one parallel call each seen ~5
    times in 24 steps), and the checkpoint looped past its step budget."""
    from flywheel.mining.demos import called_tools
    from flywheel.trainer.sft import sft_batches, sft_stratum

    demos = [f"answer-{i}" for i in range(47)] + [f"ticket-{i}" for i in range(40)] + \
        [f"email-{i}" for i in range(10)] + ["list+update-0", "list+update-1", "list+update-2"]
    kind = lambda d: None if d.startswith("answer") else d.split("-")[0]  # noqa: E731
    batches = list(sft_batches(demos, steps=25, batch=8, stratum=kind))
    assert [len(b) for b in batches] == [8] * 25
    assert all(len(set(b)) == len(b) for b in batches)
    flat = [d for b in batches for d in b]
    answers = [d for d in flat if d.startswith("answer")]
    assert len(answers) == round(0.47 * 8 * 25) == 94  # their share of all demonstrations
    for step in range(1, 26):  # and never far from it along the way
        got = sum(d.startswith("answer") for b in batches[:step] for d in b)
        assert abs(got - 0.47 * 8 * step) <= 0.5
    assert len(set(answers[:47])) == 47  # no answer twice before all went
    calls = [kind(d) for d in flat if not d.startswith("answer")]
    shares = sorted(calls.count(k) for k in ("ticket", "email", "list+update"))
    assert len(calls) == 106 and shares[-1] - shares[0] <= 1  # the calls, balanced
    assert batches == list(sft_batches(demos, steps=25, batch=8, stratum=kind))
    # Only answers; or mostly answers: the one call comes once in 24 (its share, 1 of 21).
    assert [sorted(b) for b in sft_batches(["answer-0", "answer-1"], steps=2, batch=8,
                                           stratum=kind)] == [["answer-0", "answer-1"]] * 2
    small = list(sft_batches([f"answer-{i}" for i in range(20)] + ["email-0"], steps=3,
                             batch=8, stratum=kind))
    assert all(len(b) == len(set(b)) == 8 for b in small)
    assert sum(b.count("email-0") for b in small) == 1
    # As many demonstrations as a batch: each once.
    assert sorted(next(sft_batches(["answer-0", "answer-1", "answer-2", "email-0"], steps=1,
                                   batch=4, stratum=kind))) == [
        "answer-0", "answer-1", "answer-2", "email-0"]
    # The trainer's `tool` balance: an answer is not a stratum, a call is its tools.
    by = sft_stratum(SimpleNamespace(sft_balance="tool"))  # type: ignore[arg-type]
    assert by is not None
    answer = Demonstration(messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                           reply={"role": "assistant", "content": "Done."},
                           source_trajectory_id=uuid.uuid4(), fingerprint="0a", env="episode")
    assert called_tools(answer) == "" and by(answer) is None
    assert by(_demo("0b")) == called_tools(_demo("0b")) == "get_weather"
    assert sft_stratum(SimpleNamespace(sft_balance="none")) is None  # type: ignore[arg-type]


def test_the_warm_start_sees_its_share_of_a_large_pool() -> None:
    from flywheel.config import TrainerSettings
    from flywheel.trainer.sft import sft_step_count

    t = TrainerSettings(sft_steps=12, sft_batch=8, sft_epochs=0.33)
    assert sft_step_count(t, 111) == 12      # the demo's single steps: sft_steps
    assert sft_step_count(t, 0) == 12
    assert sft_step_count(t, 1187) == 49     # an episode pool: a third of it, 392 seen
    assert sft_step_count(t.model_copy(update={"sft_epochs": 0.0}), 1187) == 12
