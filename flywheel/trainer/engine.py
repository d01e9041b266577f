"""The LoRA policy being trained, and one GRPO optimizer step over scored groups (CPU/GPU).

The base model is loaded once; the adapter is either fresh (LoRA B = 0, so the policy starts
equal to the base) or resumed from a published version together with its optimizer state.
Old log-probs come from sampling (never recomputed), so the importance ratio corrects for
any staleness. The KL reference is the base model — the same weights with the adapter
disabled, no second copy. The same adapter and optimizer take SFT steps on demonstrations
(the warm start before GRPO; see `flywheel.trainer.sft`).

A group's G completions share one prompt, and a batch's prompts share their instructions and
tools: each prompt, and that common prefix, runs once per step (`flywheel.trainer.prefix`),
with the exact gradient of running every sequence in full.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from flywheel.events import GroupScoredPayload
from flywheel.mining.demos import Demonstration
from flywheel.policy.chat_format import ChatFormat, load_chat_format
from flywheel.policy.logprobs import token_logprobs
from flywheel.policy.memory import ModelShape, available_bytes, train_rows
from flywheel.policy.precision import allow_tf32, compute_dtype, to_low_precision
from flywheel.trainer.grpo import GRPOConfig, group_advantages, grpo_loss, pad_batch
from flywheel.trainer.prefix import (
    EncodedPrompt,
    backward_prompt,
    by_prompt,
    completion_logps,
    encode_prompt,
    shared_prefix_len,
)
from flywheel.trainer.ranks import Ranks, rank_device
from flywheel.trainer.sft import encode_demonstration, sft_step

STATE_FILE = "trainer_state.pt"
CPU_MICRO_BATCH = 4
"""Completions per forward/backward on the CPU when `micro_batch` is unset (fewer only where
memory is short: `LoRATrainer.micro_rows`)."""


@dataclass(frozen=True)
class LoRASpec:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class Sample:
    """One model turn to train on: tokens as sampled, their sampling log-probs, advantage."""

    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]
    advantage: float
    temperature: float


def samples_from_groups(groups: Sequence[GroupScoredPayload], cfg: GRPOConfig) -> list[Sample]:
    """Every scored turn of every group, with its group-relative advantage.

    Rollouts that did not run have no reward: they get no advantage and are not trained on.
    """
    out: list[Sample] = []
    for g in groups:
        advantages = group_advantages([r.reward for r in g.rollouts], scale_std=cfg.scale_std,
                                      eps=cfg.std_eps)
        for r, adv in zip(g.rollouts, advantages, strict=True):
            if adv is None:
                continue
            for turn in r.turns:
                if turn.token_ids:
                    out.append(Sample(turn.prompt_token_ids, turn.token_ids, turn.logprobs,
                                      adv, g.temperature))
    return out


def _batch(samples: Sequence[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded [b, L] inputs; completions end every row, so the last K logits suffice."""
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    keep = max(len(s.completion_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    old = torch.zeros((len(samples), keep))
    mask = torch.zeros((len(samples), keep), dtype=torch.bool)
    for i, s in enumerate(samples):
        seq = [*s.prompt_ids, *s.completion_ids]
        ids[i, width - len(seq):] = torch.tensor(seq)
        attn[i, width - len(seq):] = 1
        c = len(s.completion_ids)
        old[i, keep - c:] = torch.tensor(s.old_logprobs[:c])
        mask[i, keep - c:] = True
    return {"ids": ids, "attn": attn, "old": old, "mask": mask,
            "adv": torch.tensor([s.advantage for s in samples]), "keep": torch.tensor(keep)}


_Add = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor,
                 Sequence[Sample]], None]
"""Takes one micro-batch's (logp, ref_logp, old_logp, mask) [b, K] and its samples."""
_Pair = tuple[EncodedPrompt, EncodedPrompt | None]
"""A prompt encoded under the policy and, when the KL needs it, under the reference."""


class LoRATrainer:
    """The adapter being trained on one device (see the module docstring).

    On a CUDA GPU (`precision="auto"`) the base weights are bf16 and the computation runs on
    the tensor cores, while everything that accumulates or compares stays fp32: the LoRA
    parameters and AdamW's moments (peft keeps an adapter fp32 over a bf16 base), the
    output head (`flywheel.policy.precision.Fp32Head`: logits, hence log-probs, from an fp32
    product), the log-probs (`token_logprobs`), importance ratios and the GRPO loss
    (`grpo_loss` upcasts). TF32 is allowed for the fp32 products left (LoRA). On the CPU
    nothing changes: fp32 throughout, `micro_batch` 4 (fewer only where memory is short).

    `micro_batch` None sizes micro-batches from the GPU's free memory at every step
    (`flywheel.policy.memory.train_rows`, half of what is free); 4 on the CPU, or fewer
    when half of the memory available would not hold 4.
    `gradient_checkpointing` recomputes each layer in the backward instead of keeping its
    activations; the shared-prompt cut needs the keys/values cache, which a checkpointed
    layer drops, so every sequence then runs in full. `base_model`: an fp32 causal LM
    already built (a random-init shape for benchmarks); `model_dir` still names its
    tokenizer and chat template.
    """

    def __init__(self, model_dir: Path, *, lora: LoRASpec, grpo: GRPOConfig, lr: float,
                 grad_clip: float = 1.0, micro_batch: int | None = None,
                 resume_from: Path | None = None, device: str = "auto",
                 chat_template: str = "auto", precision: str = "auto",
                 gradient_checkpointing: bool = False, base_model: Any = None) -> None:
        self.device = rank_device(device, 0)
        self.precision = precision
        self.dtype = compute_dtype(precision, self.device)
        base = base_model if base_model is not None else AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32)
        base = to_low_precision(base, self.dtype)
        if self.dtype != torch.float32:
            allow_tf32(self.device)
        base.to(self.device)
        self.shape = ModelShape.of(base.config)
        self.pad_id = int(base.config.pad_token_id or base.config.eos_token_id or 0)
        self.gradient_checkpointing = gradient_checkpointing
        if gradient_checkpointing:
            base.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model: Any
        if resume_from is not None:
            self.model = PeftModel.from_pretrained(base, resume_from, is_trainable=True)
        else:
            self.model = get_peft_model(base, LoraConfig(
                r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                target_modules=list(lora.target_modules), task_type="CAUSAL_LM"))
        self.grpo, self.grad_clip, self.micro_batch = grpo, grad_clip, micro_batch
        self.lr = lr
        self.optimizer = torch.optim.AdamW(self.trainable(), lr=lr, weight_decay=0.0)
        self.steps = 0
        self.ranks: Ranks | None = None
        """Set under torchrun (`flywheel.trainer.distributed`): steps run this rank's share
        of each batch and sum the gradients of all ranks."""
        self.model_dir = model_dir
        self.chat_template = chat_template
        self._chat_format: ChatFormat | None = None
        if resume_from is not None and (resume_from / STATE_FILE).exists():
            state = torch.load(resume_from / STATE_FILE, weights_only=True,
                               map_location=self.device)
            self.optimizer.load_state_dict(state["optimizer"])
            self.steps = int(state["steps"])

    def micro_rows(self, prompt_tokens: int, completion_tokens: int) -> int:
        """Completions per forward/backward: the setting, else what fits half of the GPU's
        free memory now (`train_rows`); on the CPU 4, fewer when half of the memory
        available now would not hold 4 (a multi-turn demonstration keeps ~1.6 MB a token
        of SmolLM2-135M's activations: 4 rows of 800 tokens are ~5 GB)."""
        if self.micro_batch is not None:
            return self.micro_batch
        if self.device.type != "cuda":
            available = available_bytes()
            if available is None:
                return CPU_MICRO_BATCH
            return min(CPU_MICRO_BATCH, train_rows(
                available * 0.5, self.shape, prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                dtype_bytes=torch.finfo(self.dtype).bits // 8,
                checkpointing=self.gradient_checkpointing))
        free, _ = torch.cuda.mem_get_info(self.device)
        return train_rows(free * 0.5, self.shape, prompt_tokens=prompt_tokens,
                          completion_tokens=completion_tokens,
                          dtype_bytes=torch.finfo(self.dtype).bits // 8,
                          checkpointing=self.gradient_checkpointing)

    def named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_trainable()]

    def spec(self) -> LoRASpec:
        """The adapter's shape as loaded (a resumed version keeps its own)."""
        cfg = self.model.peft_config["default"]
        return LoRASpec(r=cfg.r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                        target_modules=tuple(sorted(cfg.target_modules)))

    def _logps(self, b: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """Log-probs of the completion tokens, [b, K] (K = longest completion)."""
        keep = int(b["keep"])
        b = {k: v.to(self.device) for k, v in b.items()}
        position_ids = (b["attn"].cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=b["ids"], attention_mask=b["attn"],
                            position_ids=position_ids, logits_to_keep=keep + 1,
                            use_cache=False).logits
        # logits[:, j] predicts token at column width - keep - 1 + j + 1.
        return token_logprobs(logits[:, :-1], b["ids"][:, -keep:], temperature)

    def step(self, groups: Sequence[GroupScoredPayload]) -> dict[str, float]:
        """One optimizer step over every scored turn in `groups`."""
        started = time.perf_counter()
        samples = samples_from_groups(groups, self.grpo)
        self.model.train()
        total_tokens = sum(len(s.completion_ids) for s in samples)
        metrics: dict[str, float] = {"samples": float(len(samples)),
                                     "tokens": float(total_tokens)}
        if self.ranks is None or not samples:  # nothing to train: no gradient anywhere
            metrics.update(self.backward(samples))
        else:  # this rank's whole prompts, weighted by the whole batch; gradients summed
            sets = by_prompt([(s.prompt_ids, s.temperature) for s in samples])
            costs = [len(samples[ix[0]].prompt_ids)
                     + sum(len(samples[i].completion_ids) for i in ix) for ix in sets]
            mine = [samples[i] for k in self.ranks.share(costs) for i in sets[k]]
            sums = self.backward(mine, totals=(total_tokens, len(samples)))
            self.ranks.sum_grads(self.trainable())
            metrics.update(self.ranks.sum_values(sums))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        rewards = [r.reward for g in groups for r in g.rollouts if r.reward is not None]
        metrics.update({"grad_norm": float(grad_norm), "step_s": time.perf_counter() - started,
                        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
                        "tokens_per_s": total_tokens / max(time.perf_counter() - started, 1e-9)})
        return metrics

    def backward(self, samples: Sequence[Sample], *, share_prompts: bool = True,
                 totals: tuple[int, int] | None = None) -> dict[str, float]:
        """Accumulate the gradient of one GRPO loss over all of `samples` → its metrics.

        Each distinct prompt runs once (`flywheel.trainer.prefix`), continuing the prefix all
        prompts share (instructions, tools) when that too runs once; a micro-batch is up to
        `micro_batch` completions of one prompt on top of its cached keys/values. Memory is
        then bounded by one micro-batch plus the activations of one prompt and the shared
        prefix, held until their completions are done. With `share_prompts=False` every
        prompt + completion runs in full, `micro_batch` sequences per forward (the old path,
        the reference for the exactness tests). `totals` (tokens, samples) of the whole batch
        when `samples` is one rank's share of it.
        """
        total_tokens, total_samples = totals or (sum(len(s.completion_ids) for s in samples),
                                                 len(samples))
        sums: dict[str, float] = {}
        if not samples:
            return sums
        share_prompts = share_prompts and not self.gradient_checkpointing
        rows = self.micro_rows(max(len(s.prompt_ids) for s in samples),
                               max(len(s.completion_ids) for s in samples))

        def add(logp: torch.Tensor, ref: torch.Tensor | None, old: torch.Tensor,
                mask: torch.Tensor, chunk: Sequence[Sample]) -> None:
            # Padding columns never reach the loss, not even as NaN × 0.
            mask = mask.to(logp.device)
            logp = torch.where(mask, logp, torch.zeros_like(logp))
            if ref is not None:
                ref = torch.where(mask, ref, torch.zeros_like(ref))
            adv = torch.tensor([s.advantage for s in chunk], device=logp.device)
            loss, m = grpo_loss(logp, old.to(logp.device), adv, mask,
                                self.grpo, ref_logp=ref)
            # Weight micro-batches so the step equals one loss over the whole batch.
            weight = (int(mask.sum()) / max(total_tokens, 1)
                      if self.grpo.loss_norm == "token" else len(chunk) / total_samples)
            (loss * weight).backward()  # type: ignore[no-untyped-call]
            for k, v in m.items():
                if k != "tokens":
                    sums[k] = sums.get(k, 0.0) + float(v) * weight

        if not share_prompts:  # every prompt + completion in full: the reference path
            for i in range(0, len(samples), rows):
                chunk = samples[i:i + rows]
                b = _batch(chunk, self.pad_id)
                logp = self._logps(b, chunk[0].temperature)
                ref = None
                if self.grpo.kl_coef > 0:
                    with torch.no_grad(), self.model.disable_adapter():
                        ref = self._logps(b, chunk[0].temperature)
                add(logp, ref, b["old"], b["mask"], chunk)
            return sums
        sets = by_prompt([(s.prompt_ids, s.temperature) for s in samples])
        prompts = [samples[ix[0]].prompt_ids for ix in sets]
        n = shared_prefix_len(prompts)
        root = self._encode(prompts[0][:n], None) if n else None
        for ix in sets:
            self._prompt_group([samples[i] for i in ix], root, add, rows)
        if root is not None:
            backward_prompt(root[0])
        return sums

    def _encode(self, ids: Sequence[int], parent: _Pair | None) -> _Pair:
        """`ids` encoded with the adapter (grad) and, for the KL, without (no grad)."""
        policy = encode_prompt(self.model, ids, None if parent is None else parent[0])
        if self.grpo.kl_coef == 0:
            return policy, None
        with torch.no_grad(), self.model.disable_adapter():
            return policy, encode_prompt(self.model, ids,
                                         None if parent is None else parent[1])

    def _prompt_group(self, group: Sequence[Sample], root: _Pair | None, add: _Add,
                      rows: int) -> None:
        """Every sample of `group` (one prompt, one temperature) through `add`, prompt once."""
        temperature = group[0].temperature
        policy, ref_prompt = self._encode(
            group[0].prompt_ids[0 if root is None else root[0].length:], root)
        for i in range(0, len(group), rows):
            chunk = group[i:i + rows]
            completions = [s.completion_ids for s in chunk]
            logp = completion_logps(self.model, policy, completions, self.pad_id, temperature)
            ref = None
            if ref_prompt is not None:
                with torch.no_grad(), self.model.disable_adapter():
                    ref = completion_logps(self.model, ref_prompt, completions, self.pad_id,
                                           temperature)
            old, mask = pad_batch([s.old_logprobs[:len(s.completion_ids)] for s in chunk])
            add(logp, ref, old, mask, chunk)
        backward_prompt(policy)

    @property
    def chat_format(self) -> ChatFormat:
        """The policy's chat format; only SFT needs it (text → ids), GRPO trains on sampled
        ids. Loaded on first use."""
        if self._chat_format is None:
            self._chat_format = load_chat_format(self.model_dir, self.chat_template)
        return self._chat_format

    def sft_step(self, demos: Sequence[Demonstration], *,
                 lr: float | None = None) -> dict[str, float]:
        """One optimizer step of completion-only cross-entropy on `demos`.

        `lr` overrides the optimizer's learning rate for this step only (a warm start usually
        wants a larger one than GRPO).
        """
        examples = [encode_demonstration(self.chat_format, d) for d in demos]
        saved = [g["lr"] for g in self.optimizer.param_groups]
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        try:
            longest = max((len(e.input_ids) for e in examples), default=1)
            target = max((e.target_len for e in examples), default=1)
            share = not self.gradient_checkpointing
            # What the pass holds: with a shared prefix, every token after it keeps its
            # activations (a multi-turn demonstration's conversation, not only its reply).
            shared = shared_prefix_len([e.input_ids[:len(e.input_ids) - e.target_len]
                                        for e in examples]) if share else 0
            rows = (self.micro_rows(shared, longest - shared) if share
                    else self.micro_rows(longest - target, target))
            metrics = sft_step(self.model, self.optimizer, examples, pad_id=self.pad_id,
                               micro_batch=rows,
                               grad_clip=self.grad_clip,
                               share_prefix=share, ranks=self.ranks)
        finally:
            for g, old in zip(self.optimizer.param_groups, saved, strict=True):
                g["lr"] = old
        self.steps += 1
        return metrics

    def reset_optimizer(self) -> None:
        """Fresh AdamW moments (after the SFT warm start, before GRPO)."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer = torch.optim.AdamW(self.trainable(), lr=lr, weight_decay=0.0)

    def save(self, directory: Path) -> None:
        """Adapter weights + optimizer state: everything needed to resume exactly."""
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory)
        torch.save({"optimizer": self.optimizer.state_dict(), "steps": self.steps},
                   directory / STATE_FILE)
