"""Grammar-constrained rows on the local engine: one llguidance matcher per row, masking its
logits at every step.

A request with `SamplingParams.grammar` (serving's `tool_choice` "required" or a named
function: `flywheel.policy.call_grammar`) samples each of its rows from
softmax(masked logits / T): the tokens the grammar does not allow next get -inf, and the
sampled token then advances the row's matcher. Once the grammar is complete and nothing may
follow, the only token allowed is the end of turn (EOS), so the turn ends there. A row of a
request without a grammar is not touched — its logits, its draws and its log-probs are what
they would be without this module — so `auto` (the gate's decoding) is unchanged and only
constrained rows pay for a mask. The log-probs reported for a constrained row are those of
the masked, renormalised distribution it was sampled from (what vLLM's processed log-probs
report under structured outputs too).

llguidance (Microsoft's Rust library behind vLLM's `guidance` backend, llama.cpp's and
SGLang's): its wheel has no Python dependencies and no torch pin, computes a mask without
precomputing anything per grammar (tens of microseconds per row and token on a CPU), and reads
Lark grammars with inline JSON schemas, which is what a call in a chat template's markup is.

Import this module lazily: it imports torch and llguidance.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import torch
from torch import Tensor

from flywheel.policy.base import PolicyError

_SHIFTS = torch.arange(32, dtype=torch.int32)


class Grammars:
    """The engine's tokenizer as llguidance sees it, and matchers compiled against it."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        """Width of the model's logits (the mask is cut or padded to it)."""
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=max(vocab_size, len(tokenizer)), eos_token=sorted(eos_ids))

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `grammar`; `PolicyError` if it does not compile."""
        matcher = llguidance.LLMatcher(self.tokenizer, llguidance.grammar_from("lark", grammar),
                                       log_level=0)
        if matcher.is_error():
            raise PolicyError(f"the request's grammar does not compile: "
                              f"{matcher.get_error()[:500]}")
        return matcher

    def rows(self, templates: Sequence[llguidance.LLMatcher | None]) -> RowMasks | None:
        """A batch's rows' matchers, each a copy of its request's compiled one (`templates`,
        None where a row has no grammar); None when no row has one."""
        if not any(t is not None for t in templates):
            return None
        return RowMasks([None if t is None else t.deep_copy() for t in templates],
                        self.tokenizer.vocab_size, self.vocab_size)


class RowMasks:
    """The matchers of one batch's rows, stepped along with the sampling loop."""

    def __init__(self, matchers: Sequence[llguidance.LLMatcher | None], ll_vocab: int,
                 vocab_size: int) -> None:
        self.matchers = list(matchers)
        self.vocab_size = vocab_size
        self._words = (ll_vocab + 31) // 32
        self._buffer = torch.zeros(len(self.matchers), self._words, dtype=torch.int32)

    def allowed(self, rows: Sequence[int]) -> Tensor:
        """Which tokens each of `rows` (batch indices, all constrained) may draw next:
        [len(rows), V] bool."""
        buffer = self._buffer[:len(rows)]
        for k, row in enumerate(rows):
            matcher = self.matchers[row]
            assert matcher is not None
            slot = buffer[k]
            matcher.unsafe_compute_mask_ptr(slot.data_ptr(), self._words * 4)
        bits = (buffer[:, :, None] >> _SHIFTS) & 1  # [k, W, 32]: bit i of word w = token 32w+i
        allowed = bits.reshape(len(rows), -1).bool()
        if allowed.shape[1] >= self.vocab_size:
            return allowed[:, :self.vocab_size]
        return torch.cat([allowed, allowed.new_zeros(len(rows), self.vocab_size
                                                     - allowed.shape[1])], dim=1)

    def mask(self, logits: Tensor, rows: Tensor, running: Tensor) -> Tensor:
        """`logits` [b, V] of batch rows `rows` [b] with -inf where a running constrained row
        may not go; other rows' logits are returned untouched."""
        picked = [(j, int(r)) for j, r in enumerate(rows.tolist())
                  if self.matchers[int(r)] is not None and bool(running[j])]
        if not picked:
            return logits
        at = torch.tensor([j for j, _ in picked], device=logits.device)
        allowed = self.allowed([r for _, r in picked]).to(logits.device)
        out = logits.clone()
        out[at] = logits[at].masked_fill(~allowed, float("-inf"))
        return out

    def advance(self, tokens: Tensor, running: Tensor) -> None:
        """Feed each running constrained row the token it drew (`tokens`, `running`: [B])."""
        for row, matcher in enumerate(self.matchers):
            if matcher is not None and bool(running[row]):
                matcher.consume_token(int(tokens[row]))
