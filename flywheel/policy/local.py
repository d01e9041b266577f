"""The in-process policy engine: transformers + peft on CPU (or one local device).

It owns one model and its LoRA adapters. Every operation that touches the model (generate,
scoring, loading or deleting an adapter) runs on one dedicated worker thread, so the event
loop stays responsive, only one generate runs at a time (torch already uses every core), and
an adapter never changes under a running generate. Sampling log-probs are read from the raw
logits of the very forward passes that sampled the tokens, in fp32. A completion that ends
on EOS keeps the EOS token (and its log-prob) in `token_ids`, not in `text`, so the trainer
learns to stop; one cut by a stop string keeps tokens up to the one that completed it, while
its text ends exactly at the stop. Prompts are rendered by the policy's chat format
(`chat_format`), the one every engine, SFT and serving use.

Each distinct prompt of a call runs once and its rows sample from copies of its keys/values
(`flywheel.policy.sampling`); the shared start of prompts (system prompt, tools, earlier turns)
is kept across calls in a prefix cache per adapter (`flywheel.policy.prefix_cache`), dropped
with the adapter. Calls that arrive while the engine is busy run together (`batching`): the
rows of every waiting request of one adapter and decoding rule go through one batched forward
per token (up to `max_rows` rows), each request drawing from a generator of its own seed, so
it samples what it would alone. `share_prompts=False` samples through `generate`, request by
request, every row running its prompt in full: the reference the shared path is tested
against.

On a GPU (`device="auto"` finds one; the factory's default) the engine runs bf16 weights with
an fp32 output head, so sampling log-probs are fp32 products (`flywheel.policy.precision`);
a forward takes as many rows as half the free memory holds (`flywheel.policy.memory`), not a
fixed 32; and each decode step writes its keys/values in place (`kv.make_room`). The CPU
defaults, and what they sample, are unchanged.

Import this module lazily: it imports torch, transformers and peft at module level.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from peft import PeftModel
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    StoppingCriteria,
    StoppingCriteriaList,
)

from flywheel.policy.base import AdapterRef, Completion, PolicyError, SamplingParams
from flywheel.policy.batching import Batcher, Job, Results, early_settler
from flywheel.policy.chat_format import ChatFormat, load_chat_format
from flywheel.policy.cores import CoreShare, run_shared
from flywheel.policy.grammar_masks import Grammars, RowMasks
from flywheel.policy.logprobs import sequence_logprobs, token_logprobs
from flywheel.policy.memory import ModelShape, engine_rows
from flywheel.policy.precision import compute_dtype, to_low_precision
from flywheel.policy.prefix_attention import MIN_SHARED
from flywheel.policy.prefix_attention import enable as prefix_attention_on
from flywheel.policy.prefix_cache import PrefixCache
from flywheel.policy.sampling import (
    PromptKV,
    Seen,
    Unit,
    common_start,
    encode_cached,
    sample_rows,
    share_blocker,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
Messages = Sequence[Mapping[str, Any]]
Tools = Sequence[Mapping[str, Any]] | None


def stop_cut(text: str, params: SamplingParams) -> int | None:
    """Where the completion `text` must end by `params`' stop strings; None = not yet."""
    cuts = [text.find(s) + len(s) for s in params.stop if s and s in text]
    return min(cuts) if cuts else None


class _StopWatch(StoppingCriteria):
    """Stops each row at the token that completes a stop condition and records that step."""

    def __init__(self, decode: Callable[[list[int]], str], prompt_width: int,
                 params: SamplingParams) -> None:
        self.decode, self.width, self.params = decode, prompt_width, params
        self.stopped_at: dict[int, int] = {}
        """Row → index (in the generated tokens) of the token that completed a stop."""

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        new = input_ids[:, self.width:]  # [B, t]
        for row in range(new.shape[0]):
            if row not in self.stopped_at and stop_cut(self.decode(new[row].tolist()),
                                                       self.params) is not None:
                self.stopped_at[row] = new.shape[1] - 1
        done = [row in self.stopped_at for row in range(new.shape[0])]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


class _GrammarMask(LogitsProcessor):
    """`generate`'s side of `RowMasks`: each step feeds every row's matcher the token it drew
    and masks the logits; keeps each step's mask so the log-probs are the masked ones."""

    def __init__(self, masks: RowMasks, prompt_width: int, eos: torch.Tensor) -> None:
        self.masks, self.width, self.eos = masks, prompt_width, eos
        self.steps: list[torch.Tensor] = []
        """Per step, where the grammar blocked a row: [B, V] bool."""
        self._running: torch.Tensor | None = None
        """Rows that have not drawn an end-of-turn token yet."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor
                 ) -> torch.FloatTensor:
        if self._running is None:
            self._running = torch.ones(scores.shape[0], dtype=torch.bool, device=scores.device)
        elif input_ids.shape[1] > self.width:  # feed the token each row drew last step
            self.masks.advance(input_ids[:, -1], self._running)
            self._running &= ~torch.isin(input_ids[:, -1], self.eos)
        rows = torch.arange(scores.shape[0], device=scores.device)
        masked = self.masks.mask(scores, rows, self._running)
        self.steps.append(torch.isneginf(masked) & ~torch.isneginf(scores))
        return cast(torch.FloatTensor, masked)


class LocalPolicy:
    """The Policy protocol served in-process; adapters are PEFT LoRA directories."""

    def __init__(self, model_dir: Path, *, policy_name: str = "policy", device: str = "cpu",
                 precision: str = "fp32", max_batch: int = 8,
                 prefix_cache_mb: float = 256.0, share_prompts: bool = True,
                 chat_template: str = "auto", max_rows: int | None = None,
                 cores: CoreShare | None = None, prefix_attention: bool = True,
                 model: PreTrainedModel | None = None) -> None:
        """`device` `auto` = the first GPU when there is one; `precision` as
        `flywheel.policy.precision` says (`auto`: bf16 on CUDA with an fp32 head).
        `max_rows` None: 32 on the CPU, sized by free memory on a GPU (`_row_limit`).
        `model`: an fp32 causal LM already built (a random-init shape for benchmarks);
        `model_dir` still names its tokenizer and chat template."""
        self.policy_name, self.max_batch = policy_name, max_batch
        self.max_rows = None if max_rows is None else max(max_rows, max_batch)
        """Most rows in one forward pass when concurrent requests share it (None: sized per
        batch by `_row_limit`)."""
        self.cores = cores
        """Every model operation runs at this process's share of the cores (None: torch's
        pool as it is)."""
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        # Its own tokenizer: callers may render and parse while the worker thread decodes.
        self._chat_format = load_chat_format(model_dir, chat_template)
        self.tokenizer.padding_side = "left"
        place = torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                             else "cpu" if device == "auto" else device)
        self.dtype = compute_dtype(precision, place)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                         local_files_only=True)
        model = to_low_precision(model, self.dtype)
        self.shape = ModelShape.of(model.config)
        eos = model.generation_config.eos_token_id
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self._eos_ids: set[int] = set(eos if isinstance(eos, list) else [eos])
        pad = self.tokenizer.pad_token_id
        self._pad_id: int = pad if pad is not None else min(self._eos_ids)
        # generate() fills every unset option from the checkpoint's defaults (repetition
        # penalty, top-k, …); a neutral config keeps sampling at exactly softmax(logits / T).
        model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
            bos_token_id=model.generation_config.bos_token_id,
            eos_token_id=sorted(self._eos_ids), pad_token_id=self._pad_id)
        self.model: PreTrainedModel | PeftModel = model.to(place).eval()  # type: ignore[arg-type]
        self._grammars: Grammars | None = None
        """llguidance's view of the tokenizer, built on the first constrained request."""
        self._adapter_paths: dict[str, Path] = {}
        """Every adapter name ever loaded → its directory; kept after retiring (immutability)."""
        self._loaded: set[str] = set()
        self.prefix_cache: PrefixCache[PromptKV] = PrefixCache(int(prefix_cache_mb * 2**20))
        """Encoded prompts by (adapter name, token ids); only the worker thread touches it."""
        self.share_prompts = share_prompts and self._can_share()
        self.prefix_attention = False
        """Rows that start alike read their common keys/values once per decode step
        (`flywheel.policy.prefix_attention`)."""
        if self.share_prompts and prefix_attention:
            reason = prefix_attention_on(self.model)
            if reason is not None:
                log.warning("shared-prefix attention is off: %s", reason)
            self.prefix_attention = reason is None
        self._worker: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="flywheel-policy")
        self.batcher = Batcher(
            lambda jobs: self._run(self._sample_jobs_sync, jobs, early_settler(jobs)))
        """Concurrent `sample` calls wait here and run together (`flywheel.policy.batching`)."""

    # -- Policy protocol ---------------------------------------------------------------------

    @property
    def chat_format(self) -> ChatFormat:
        return self._chat_format

    async def sample(self, messages: Messages, params: SamplingParams, *, tools: Tools = None,
                     adapter: AdapterRef | None = None) -> list[Completion]:
        return (await self.sample_many([messages], params, tools=tools, adapter=adapter))[0]

    async def sample_many(self, prompts: Sequence[Messages], params: SamplingParams, *,
                          tools: Tools = None, adapter: AdapterRef | None = None
                          ) -> list[list[Completion]]:
        """`params.n` completions for each prompt (all offered `tools`), rows of all prompts
        batched together — and with those of concurrent calls that can share the batch."""
        if self._worker is None:
            raise PolicyError("this LocalPolicy is closed")
        flat = await self.batcher.submit(list(prompts), params, tools, self._name(adapter))
        return [flat[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    async def ensure_adapter(self, adapter: AdapterRef) -> None:
        await self._run(self._ensure_sync, self._name(adapter), adapter.path.resolve())

    async def retire_adapter(self, adapter: AdapterRef) -> None:
        await self._run(self._retire_sync, self._name(adapter))

    async def close(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            await asyncio.to_thread(worker.shutdown, wait=True)
            self.prefix_cache.clear()
            del self.model
            gc.collect()

    # -- extras for tests, the trainer and benchmarks ------------------------------------------

    def prompt_ids(self, messages: Messages, tools: Tools = None, prefill: str = "") -> list[int]:
        """Token ids of the chat prompt, generation prompt added (`chat_format.render`), and
        `prefill` after it (encoded with the prompt as one text, as vLLM does)."""
        if not prefill:
            return self._chat_format.render(messages, tools)
        return self._chat_format.encode(self._chat_format.render_text(messages, tools) + prefill)

    async def logprobs(self, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                       temperature: float, *, adapter: AdapterRef | None = None) -> list[float]:
        """`sequence_logprobs` under `adapter` (None = base model), on the model's thread."""
        def score(name: str | None) -> list[float]:
            with self._using(name) as model:
                return sequence_logprobs(model, prompt_ids, completion_ids, temperature)
        return await self._run(score, self._name(adapter))

    # -- worker-thread internals ---------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._worker is None:
            raise PolicyError("this LocalPolicy is closed")
        return await asyncio.get_running_loop().run_in_executor(
            self._worker, run_shared, self.cores, fn, *args)

    def _name(self, adapter: AdapterRef | None) -> str | None:
        if adapter is not None and adapter.policy != self.policy_name:
            raise PolicyError(f"adapter {adapter.name} belongs to policy {adapter.policy!r}; "
                              f"this engine serves {self.policy_name!r}")
        return None if adapter is None else adapter.name

    @contextmanager
    def _using(self, name: str | None) -> Iterator[torch.nn.Module]:
        """The model with adapter `name` active (None = base weights) for one operation."""
        model = self.model
        if name is not None and name not in self._loaded:
            state = "was retired" if name in self._adapter_paths else "is not loaded"
            raise PolicyError(f"adapter {name} {state}; call ensure_adapter() before sampling it")
        if not isinstance(model, PeftModel):
            yield model
        elif name is None:
            with model.disable_adapter():
                yield model
        else:
            model.set_adapter(name)
            yield model

    def _ensure_sync(self, name: str, path: Path) -> None:
        known = self._adapter_paths.get(name)
        if known is not None and known != path:
            raise PolicyError(f"adapter {name} was already loaded from {known}; versions are "
                              f"immutable, so publish {path} under a new version")
        if name in self._loaded:
            return
        if not (path / "adapter_config.json").is_file():
            raise PolicyError(f"{path} holds no PEFT adapter (adapter_config.json missing)")
        if isinstance(self.model, PeftModel):
            self.model.load_adapter(str(path), adapter_name=name, is_trainable=False)
        else:
            self.model = PeftModel.from_pretrained(self.model, str(path), adapter_name=name)
        self.model.eval()
        self._adapter_paths[name] = path
        self._loaded.add(name)

    def _retire_sync(self, name: str) -> None:
        self.prefix_cache.drop_adapter(name)  # their keys/values came from these weights
        if name not in self._loaded:
            return
        assert isinstance(self.model, PeftModel)
        self._loaded.discard(name)
        if self._loaded:
            # Activate a survivor first: peft warns when the active adapter is deleted.
            self.model.set_adapter(next(iter(self._loaded)))
            self.model.delete_adapter(name)
        else:  # back to the plain model: no LoRA wrappers left to slow every forward
            self.model = self.model.unload()

    def _rows(self, job: Job) -> list[list[int]]:
        p = job.params
        return [ids for m in job.prompts
                for ids in [self.prompt_ids(m, job.tools, p.prefill)] * p.n]

    def _sample_jobs_sync(self, jobs: list[Job],
                          finished: Callable[[int, list[Completion] | BaseException], None]
                          | None = None) -> Results:
        """Every job of a compatible batch (`batching.batch_key`): its completions or error;
        `finished(i, result)` as soon as job i has all its rows (the forwards of a batch run
        one after another: the first jobs need not wait for the last)."""
        def tell(i: int, result: list[Completion] | BaseException) -> None:
            if finished is not None:
                finished(i, result)

        if not self.share_prompts:
            out: Results = []
            for i, job in enumerate(jobs):
                out.append(self._sample_alone(job))
                tell(i, out[-1])
            return out
        results: Results = [[] for _ in jobs]
        device = next(self.model.parameters()).device
        chunks: dict[int, tuple[torch.Generator, list[list[list[int]]]]] = {}
        compiled: dict[int, Any] = {}
        for i, job in enumerate(jobs):
            try:
                rows = self._rows(job)
                if job.params.grammar is not None:
                    compiled[i] = self._grammar_set().matcher(job.params.grammar)
            except Exception as err:  # this caller's prompt, not the batch's
                results[i] = err
                continue
            gen = torch.Generator(device=device)
            # A seed pins these samples whatever shares the batch; none = fresh entropy.
            gen.manual_seed(job.params.seed) if job.params.seed is not None else gen.seed()
            chunks[i] = (gen, [rows[s:s + self.max_batch]
                               for s in range(0, len(rows), self.max_batch)])
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                tell(i, result)
        params, name, seen = jobs[0].params, jobs[0].adapter, cast(Seen, {})
        # Chunk k of a job continues its generator where chunk k-1 left it: by level.
        levels = max((len(c) for _, c in chunks.values()), default=0)
        with self._using(name), torch.no_grad():
            limit = self.rows_per_forward([r for _, c in chunks.values() for u in c for r in u],
                                          params.max_tokens)
            for level in range(levels):
                units = [(i, gen, c[level]) for i, (gen, c) in chunks.items() if level < len(c)]
                for group in _packed(units, limit):
                    done = self._generate_shared(group, params, name, seen, compiled)
                    for (i, _, _), completions in zip(group, done, strict=True):
                        cast(list[Completion], results[i]).extend(completions)
                        if level == len(chunks[i][1]) - 1:  # its last chunk
                            tell(i, results[i])
        return results

    def rows_per_forward(self, rows: Sequence[Sequence[int]], max_tokens: int) -> int:
        """The most of `rows` (prompt ids) one forward takes: `_row_limit` for the longest
        row + `max_tokens`, less the start they all share when shared-prefix attention
        reads it once for the whole forward."""
        shared = common_start(rows) if rows and self.prefix_attention else 0
        if shared < MIN_SHARED:
            shared = 0
        return self._row_limit(max((len(r) for r in rows), default=1) - shared + max_tokens)

    def _row_limit(self, tokens_per_row: int) -> int:
        """Rows in one forward: the setting, else 32 on the CPU, else what half of the GPU's
        free memory holds for rows of `tokens_per_row` (prompt + completion) each."""
        if self.max_rows is not None:
            return self.max_rows
        device = next(self.model.parameters()).device
        if device.type != "cuda":
            return max(32, self.max_batch)
        free, _ = torch.cuda.mem_get_info(device)
        return engine_rows(free * 0.5, self.shape, tokens_per_row,
                           dtype_bytes=torch.finfo(self.dtype).bits // 8, floor=self.max_batch)

    def _sample_alone(self, job: Job) -> list[Completion] | BaseException:
        """One job through `generate` (a model that cannot share prompts), seeded as ever."""
        try:
            rows = self._rows(job)
        except Exception as err:
            return err
        out: list[Completion] = []
        device = next(self.model.parameters()).device
        cuda = [device.index or 0] if device.type == "cuda" else []
        try:
            grammar = None if job.params.grammar is None else \
                self._grammar_set().matcher(job.params.grammar)
        except PolicyError as err:
            return err
        with self._using(job.adapter), torch.random.fork_rng(devices=cuda):
            # fork_rng: a seed pins these samples without touching anyone else's RNG stream.
            if job.params.seed is not None:
                torch.manual_seed(job.params.seed)
            for start in range(0, len(rows), self.max_batch):
                chunk = rows[start:start + self.max_batch]
                out += self._generate(chunk, job.params, job.adapter,
                                      None if grammar is None else
                                      self._grammar_set().rows([grammar] * len(chunk)))
        return out

    def _can_share(self) -> bool:
        reason = share_blocker(self.model)
        if reason is not None:
            log.warning("prompts are not shared: %s; every row runs its prompt in full", reason)
        return reason is None

    def _generate_shared(self, units: list[Chunk],
                         params: SamplingParams, name: str | None, seen: Seen,
                         compiled: Mapping[int, Any] | None = None) -> list[list[Completion]]:
        """One batched generate over several jobs' rows, each unit drawing from its own
        generator, and sampling under its job's grammar where `compiled` has one (job index
        → compiled matcher); the completions of each unit."""
        rows = [r for _, _, unit in units for r in unit]
        masks = self._grammar_set().rows([(compiled or {}).get(i) for i, _, unit in units
                                          for _ in unit]) if compiled else None
        spans: list[Unit] = []
        for _, gen, unit in units:
            start = spans[-1][1] if spans else 0
            spans.append((start, start + len(unit), gen))
        started = time.monotonic()
        watch = _StopWatch(self._decode, 0, params)
        prompts = [encode_cached(self.model, r, name, self.prefix_cache, seen) for r in rows]
        new, lps = sample_rows(
            self.model, [p for p, _ in prompts], params, eos_ids=self._eos_ids,
            pad_id=self._pad_id, units=spans, shared=common_start(rows), masks=masks,
            stop=(lambda t: watch(cast(torch.LongTensor, t), None)) if params.stop else None)
        batch_ms = (time.monotonic() - started) * 1000
        flat = [self._completion(rows[i], new[i].tolist(), lps[i].tolist(),
                                 watch.stopped_at.get(i), params, name, batch_ms, len(rows),
                                 cached=prompts[i][1]) for i in range(len(rows))]
        return [flat[a:b] for a, b, _ in spans]

    def _generate(self, rows: list[list[int]], params: SamplingParams,
                  name: str | None, masks: RowMasks | None = None) -> list[Completion]:
        width = max(len(r) for r in rows)
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([[self._pad_id] * (width - len(r)) + r for r in rows],
                                 device=device)  # [B, P], left-padded
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        sampling = params.temperature > 0
        config = GenerationConfig(  # type: ignore[no-untyped-call]
            max_new_tokens=params.max_tokens, do_sample=sampling,
            temperature=params.temperature if sampling else None,
            top_p=params.top_p if sampling else None,
            top_k=0 if sampling else None,  # 0, not unset: unset means transformers' top-k=50
            eos_token_id=sorted(self._eos_ids), pad_token_id=self._pad_id,
            return_dict_in_generate=True, output_logits=True)
        watch = _StopWatch(self._decode, width, params)
        # Decoding every row at every step costs little, but nothing at all when unneeded.
        criteria = [watch] if params.stop else []
        grammar = None if masks is None else _GrammarMask(
            masks, width, torch.tensor(sorted(self._eos_ids), device=device))
        started = time.monotonic()
        result = cast(Any, self.model).generate(
            input_ids=input_ids, attention_mask=mask, generation_config=config,
            stopping_criteria=StoppingCriteriaList(criteria),
            logits_processor=LogitsProcessorList([grammar] if grammar else []))
        batch_ms = (time.monotonic() - started) * 1000
        new = result.sequences[:, width:]  # [B, T]
        # One step at a time: stacking all logits would hold [B, T, V] twice.
        def sampled(t: int, step: torch.Tensor) -> torch.Tensor:  # constrained rows: masked
            return step if grammar is None else step.masked_fill(grammar.steps[t], float("-inf"))

        lps = torch.stack([token_logprobs(sampled(t, step)[:, None], new[:, t:t + 1],
                                          params.temperature)[:, 0]
                           for t, step in enumerate(result.logits)], dim=1)  # [B, T]
        return [self._completion(rows[i], new[i].tolist(), lps[i].tolist(), watch.stopped_at.get(i),
                                 params, name, batch_ms, len(rows)) for i in range(len(rows))]

    def _completion(self, prompt: list[int], tokens: list[int], lps: list[float],
                    stopped_at: int | None, params: SamplingParams, name: str | None,
                    batch_ms: float, batch_size: int, cached: int = 0) -> Completion:
        eos_at = next((i for i, tok in enumerate(tokens) if tok in self._eos_ids), None)
        ends = [i + 1 for i in (stopped_at, eos_at) if i is not None]
        keep = min(ends) if ends else len(tokens)
        text = self._decode(tokens[:keep])
        cut = stop_cut(text, params)
        return Completion(
            text=text if cut is None else text[:cut], token_ids=tokens[:keep], logprobs=lps[:keep],
            prompt_token_ids=list(prompt), finish_reason="stop" if ends else "length", adapter=name,
            latency_ms=batch_ms / batch_size,
            extra={"batch_ms": batch_ms, "cached_prompt_tokens": cached})

    def _grammar_set(self) -> Grammars:
        """llguidance's tokenizer (about a second to build), once per engine."""
        if self._grammars is None:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            self._grammars = Grammars(self.tokenizer, int(vocab), self._eos_ids)
        return self._grammars

    def _decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))



Chunk = tuple[int, torch.Generator, list[list[int]]]
"""A job's index, its generator, and up to `max_batch` of its rows."""


def _packed(units: list[Chunk], max_rows: int) -> list[list[Chunk]]:
    """Consecutive chunks in forwards of at most `max_rows` rows (a chunk is never split)."""
    groups: list[list[Chunk]] = []
    size = max_rows
    for unit in units:
        if size + len(unit[2]) > max_rows:
            groups.append([])
            size = 0
        groups[-1].append(unit)
        size += len(unit[2])
    return groups
