"""Supervised warm start: demonstrations as token ids with a completion-only loss, and one
optimizer step of cross-entropy on them.

The prompt ids are the very ids the policy samples after (`ChatFormat.render` of the task's
messages and tools: the rollout prompt of the same task), and the target is the right reply
as the chat template renders it (`ChatFormat.encode_reply`: content, `<tool_call>` blocks and
the end-of-turn token, so the model learns to stop), so SFT teaches the distribution GRPO
later samples from and serving parses. Instructions, tool list and request are context,
never targets.

Import this module lazily: it imports torch and transformers.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F

from flywheel.mining.demos import Demonstration, called_tools
from flywheel.policy.chat_format import ChatFormat
from flywheel.trainer.prefix import (
    backward_prompt,
    completion_scores,
    encode_prompt,
    shared_prefix_len,
)

if TYPE_CHECKING:
    from flywheel.config import TrainerSettings
    from flywheel.trainer.ranks import Ranks

T = TypeVar("T")
IGNORE = -100
"""Label of a token that carries no loss (PyTorch's cross-entropy `ignore_index`)."""


@dataclass(frozen=True)
class SFTExample:
    input_ids: list[int]
    labels: list[int]
    """Same length as `input_ids`: the token itself where it is trained on, else IGNORE."""

    @property
    def target_len(self) -> int:
        """Trained tokens, which always end the sequence."""
        return sum(label != IGNORE for label in self.labels)


def encode_demonstration(fmt: ChatFormat, demo: Demonstration) -> SFTExample:
    prompt = fmt.render(demo.messages, demo.tools)
    # Tokenized on its own, as sampling produces it after the prompt's ids.
    completion = fmt.encode_reply(demo.messages, demo.reply, demo.tools)
    return SFTExample([*prompt, *completion], [IGNORE] * len(prompt) + completion)


def sft_batches(demos: Sequence[T], steps: int, batch: int, *, seed: int = 0,
                stratum: Callable[[T], str | None] | None = None) -> Iterator[list[T]]:
    """The warm start's batches; a batch never holds one demonstration twice.

    Each stratum's demonstrations are shuffled once (fixed seed), and the batches are filled
    from the strata in turn, each wrapping around its own; so every stratum gets the same
    share of the steps however few demonstrations it has (a stratum with fewer than its
    turns in a batch gives each of its demonstrations once). Demonstrations whose stratum is
    None are not balanced: they keep their share of all demonstrations, over the steps
    (rounded per batch, so that the running count never strays by one from it), and the
    strata share the rest. Without `stratum` all are one: shuffled once, then taken in
    order, wrapping around."""
    key = stratum or (lambda _: "")
    rng = random.Random(seed)
    free: list[T] = []
    groups: dict[str, list[T]] = {}
    for d in demos:
        k = key(d)
        if k is None:
            free.append(d)
        else:
            groups.setdefault(k, []).append(d)
    queues = [rng.sample(g, len(g)) for _, g in sorted(groups.items())]
    free = rng.sample(free, len(free)) if free else free
    taken = [0] * len(queues)
    size, turn, free_taken = min(batch, len(demos)), 0, 0
    share = len(free) / len(demos) if demos else 0.0
    for step in range(steps if demos else 0):
        room = sum(min(len(q), size) for q in queues)  # what the strata can fill
        due = round(share * size * (step + 1)) - free_taken
        n_free = min(max(due, size - room, 0), len(free), size)
        out = [free[(free_taken + i) % len(free)] for i in range(n_free)]
        free_taken += n_free
        used = [0] * len(queues)
        while len(out) < size:  # ends: the strata hold at least what is left
            q = turn % len(queues)
            turn += 1
            if used[q] < len(queues[q]):
                out.append(queues[q][taken[q] % len(queues[q])])
                taken[q] += 1
                used[q] += 1
        yield out


def sft_step_count(t: TrainerSettings, demonstrations: int) -> int:
    """Steps of the warm start on `demonstrations`: `sft_steps`, or more where that would
    see less than `sft_epochs` of them."""
    return max(t.sft_steps, math.ceil(t.sft_epochs * demonstrations / t.sft_batch))


def sft_stratum(t: TrainerSettings) -> Callable[[Demonstration], str | None] | None:
    """What the warm start's batches balance over, per `trainer.sft_balance`: the tools a
    reply calls; a reply that calls none (an answer, an episode's last turn: when to stop)
    is not a tool choice and keeps its share."""
    return (lambda d: called_tools(d) or None) if t.sft_balance == "tool" else None


def collate(examples: Sequence[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded ids and attention [b, L]; targets [b, K], the labels of the last K columns
    (K = longest target), so only the last K + 1 positions need logits."""
    width = max(len(e.input_ids) for e in examples)
    keep = max(max(e.target_len for e in examples), 1)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    targets = torch.full((len(examples), keep), IGNORE, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, width - n:] = torch.tensor(e.input_ids)
        attn[i, width - n:] = 1
        tail = e.labels[-keep:]
        targets[i, keep - len(tail):] = torch.tensor(tail)
    return {"ids": ids, "attn": attn, "targets": targets}


def completion_loss(model: Any, batch: dict[str, torch.Tensor]
                    ) -> tuple[torch.Tensor, int, int]:
    """(summed cross-entropy over the targets, targets, targets predicted by argmax)."""
    device = next(model.parameters()).device
    ids, attn = batch["ids"].to(device), batch["attn"].to(device)
    targets = batch["targets"].to(device)  # [b, K]
    keep = targets.shape[1]
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids,
                   logits_to_keep=keep + 1).logits[:, :-1].float()  # [b, K, V]
    # logits[:, j] was computed at column L - K - 1 + j and predicts column L - K + j.
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    mask = targets != IGNORE
    correct = int(((logits.argmax(-1) == targets) & mask).sum())
    return loss, int(mask.sum()), correct


def sft_step(model: Any, optimizer: torch.optim.Optimizer, examples: Sequence[SFTExample], *,
             pad_id: int, micro_batch: int = 4, grad_clip: float = 1.0,
             share_prefix: bool = False, ranks: Ranks | None = None) -> dict[str, float]:
    """One optimizer step of mean per-token cross-entropy over every target of `examples`.

    Micro-batches are weighted by their share of targets, so the step equals one loss over
    the whole batch whatever `micro_batch` is. `share_prefix`: see `sft_backward`. Under
    torchrun (`ranks`), this rank runs its share of the examples and the gradients of all
    ranks are summed: the same step.
    """
    started = time.perf_counter()
    model.train()
    total = sum(e.target_len for e in examples)
    params = [p for p in model.parameters() if p.requires_grad]
    if ranks is None:
        loss_sum, correct = sft_backward(model, examples, pad_id=pad_id,
                                         micro_batch=micro_batch, share_prefix=share_prefix)
    else:
        mine = [examples[i] for i in ranks.share([len(e.input_ids) for e in examples])]
        loss_sum, correct = sft_backward(model, mine, pad_id=pad_id, micro_batch=micro_batch,
                                         share_prefix=share_prefix, total=total)
        ranks.sum_grads(params)
        summed = ranks.sum_values({"loss": loss_sum, "correct": float(correct)})
        loss_sum, correct = summed["loss"], int(summed["correct"])
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    elapsed = max(time.perf_counter() - started, 1e-9)
    return {"loss": loss_sum / max(total, 1), "token_accuracy": correct / max(total, 1),
            "samples": float(len(examples)), "tokens": float(total),
            "grad_norm": float(grad_norm), "step_s": elapsed, "tokens_per_s": total / elapsed}


def sft_backward(model: Any, examples: Sequence[SFTExample], *, pad_id: int,
                 micro_batch: int = 4, share_prefix: bool = False,
                 total: int | None = None) -> tuple[float, int]:
    """Accumulate the gradient of the mean cross-entropy → (summed loss, argmax hits).

    `share_prefix` (a transformers model): the prompt tokens all examples start with (the
    instructions and tool list) run once (`flywheel.trainer.prefix`), and a micro-batch is
    the rest of `micro_batch` examples on top of their cached keys/values. `total`: the
    targets of the whole batch when `examples` is one rank's share of it.
    """
    total = max(sum(e.target_len for e in examples) if total is None else total, 1)
    loss_sum, correct = 0.0, 0
    if not examples:
        return loss_sum, correct
    n = shared_prefix_len([e.input_ids[:len(e.input_ids) - e.target_len] for e in examples]
                          ) if share_prefix else 0
    root = encode_prompt(model, examples[0].input_ids[:n]) if n else None
    for i in range(0, len(examples), micro_batch):
        chunk = examples[i:i + micro_batch]
        if root is None:
            loss, _n, right = completion_loss(model, collate(chunk, pad_id))
        else:
            # Only the columns where some example has a target are scored: a multi-turn
            # demonstration's conversation before its reply is context, not target.
            labels = [e.labels[n:] for e in chunk]
            columns = sorted({c for row in labels for c, y in enumerate(row) if y != IGNORE})
            if not columns:
                continue
            logp, hits = completion_scores(model, root, [e.input_ids[n:] for e in chunk],
                                           pad_id, 1.0, hits=True, columns=columns)  # [b, C]
            mask = torch.tensor([[c < len(row) and row[c] != IGNORE for c in columns]
                                 for row in labels], dtype=torch.bool, device=logp.device)
            loss = -torch.where(mask, logp, torch.zeros_like(logp)).sum()
            right = int((mask & hits).sum()) if hits is not None else 0
        (loss / total).backward()  # type: ignore[no-untyped-call]
        loss_sum += float(loss.detach())
        correct += right
    if root is not None:
        backward_prompt(root)
    return loss_sum, correct
