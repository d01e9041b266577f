"""`flywheel bench gpu` (= `python -m flywheel.bench.gpu`): the GPU path's figures, one JSON.

Made for a bare GPU machine with no network (infra/gpu-check.sh): no weights can be brought
there, so every model is a random-init one of a given Hugging Face config shape, with the
tokenizer (and config) in `--model-dir` (`make gpu-bundle` puts SmolLM2-135M's in
`.gpu-bundle/model`). Random weights sample other tokens than real ones, but a decode step
or a training step costs the same work whatever the weights hold. Per shape:

* `engine`: tokens/s of the local engine (`LocalPolicy`, its GPU defaults: bf16 with an fp32
  head, rows per forward from free memory, shared-prefix attention) with 1 group at a time
  and 16 and 64 groups in flight (G = 8; prompts of ~`prompt_tokens`, the first
  ~`shared_tokens` common to every group, as a system prompt and tool schemas are;
  `max_tokens` completion tokens), and plain `model.generate` (same weights) on the 128 rows
  of the 16 groups: ratios against `generate`, against the memory bound (bf16 weights + every
  row's keys/values for prompt + half the completion read once a step, at `bandwidth` B/s)
  and against the compute bound (2·params + attention FLOPs a token at `peak_flops`).
* `trainer`: one GRPO step of 4 groups × 8 on the same prompts with random completions of
  `max_tokens`, bf16 with micro-batches from free memory (the GPU default) against fp32 with
  micro_batch 4 (the former default), median of `steps` steps after a warm-up one.

Each (shape, part) runs in a child process under its own timeout, within one budget for the
whole run; the JSON file is rewritten after every measurement, so a part that times out or
fails leaves its error beside the figures of the others (and its own so far).

Imports only what a GPU machine has (torch, transformers, peft) and Flywheel's engine and
trainer: the bundle carries the rest (`make gpu-bundle`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, int]] = {
    "smollm2-135m": {},
    "smollm2-1.7b": {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32,
                     "num_key_value_heads": 32, "intermediate_size": 8192, "head_dim": 64},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "head_dim": 16},
}
"""Config overrides of `--model-dir`'s config.json, by name; `key=value,…` gives any other."""
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class Workload:
    group_size: int = 8
    prompt_tokens: int = 430
    shared_tokens: int = 400
    max_tokens: int = 64
    levels: tuple[int, ...] = (1, 16, 64)
    """Groups in flight per engine measurement (1 = one group at a time, `solo` of them)."""
    solo: int = 4
    generate_groups: int = 16
    train_groups: int = 4
    steps: int = 3
    bandwidth: float = 4.8e12
    """Memory bandwidth, B/s (H200: 4.8e12; H100 SXM: 3.35e12)."""
    peak_flops: float = 989e12
    """Dense bf16 tensor-core FLOP/s (H100/H200 SXM spec sheet)."""


def shape_overrides(shape: str) -> dict[str, int]:
    if shape in SHAPES:
        return SHAPES[shape]
    try:
        return {k: int(v) for k, v in (kv.split("=") for kv in shape.split(",") if kv)}
    except ValueError:
        raise SystemExit(f"unknown shape {shape!r}: one of {', '.join(SHAPES)} or "
                         "key=value,… config overrides") from None


def build_model(model_dir: Path, shape: str, device: str, seed: int = 0) -> Any:
    """A random-init fp32 causal LM of `model_dir`'s config with `shape`'s overrides, built
    on `device` (initialised there: a 1.7B model initialised on a CPU takes a minute)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    for key, value in shape_overrides(shape).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=torch.float32)
    return model.eval()


def write_model(model_dir: Path, shape: str, out: Path) -> Path:
    """A loadable model directory: random weights of `shape` and `model_dir`'s tokenizer."""
    import shutil

    model = build_model(model_dir, shape, "cpu")
    model.save_pretrained(out)
    for name in TOKENIZER_FILES[1:]:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out


def _words(tokenizer: Any, n: int, salt: int) -> str:
    """Text of about `n` tokens (common words; `salt` varies them)."""
    vocab = ["order", "ticket", "weather", "calendar", "email", "refund", "account", "status",
             "invoice", "meeting", "customer", "shipping", "address", "report", "schedule"]
    words: list[str] = []
    i = salt
    while len(tokenizer.encode(" ".join(words))) < n:
        words.append(vocab[i % len(vocab)] + ("" if i % 3 else str(i % 97)))
        i += 7
    return " ".join(words)


def _prompts(fmt: Any, tokenizer: Any, w: Workload, count: int, salt: int) -> list[Any]:
    """`count` chat prompts of ~`prompt_tokens`, the first ~`shared_tokens` common."""
    # The template's own tokens (role markers, the generation prompt) count too.
    frame = len(fmt.render([{"role": "system", "content": ""},
                            {"role": "user", "content": ""}], None))
    system = "You are a support agent. " + _words(tokenizer, w.shared_tokens - frame, 0)
    own = max(w.prompt_tokens - w.shared_tokens - 6, 4)
    return [[{"role": "system", "content": system},
             {"role": "user",
              "content": f"Request {salt}-{i}: " + _words(tokenizer, own, salt + i)}]
            for i in range(count)]


class _Results:
    """The part's figures, written to `path` after every measurement (partial results)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sig(x: float) -> float:
    """`x` to 4 significant digits (ratios of a few per cent, or of 1e-6 on a CPU)."""
    return float(f"{x:.4g}")


def _bounds(model: Any, w: Workload, rows: int, shape: Any) -> dict[str, float]:
    """tokens/s the memory and the compute allow for `rows` rows a step (bf16)."""
    params = sum(p.numel() for p in model.parameters())
    context = w.prompt_tokens + w.max_tokens // 2
    step_bytes = 2 * params + rows * context * shape.kv_bytes_per_token(2)
    flops = 2 * params + 4 * shape.layers * context * shape.heads * shape.head_dim
    return {"memory_bound_tokens_per_s": rows * w.bandwidth / step_bytes,
            "compute_bound_tokens_per_s": w.peak_flops / flops, "params": float(params)}


def run_engine(model_dir: Path, shape: str, device: str, w: Workload, out: _Results) -> None:
    import asyncio

    import torch

    from flywheel.policy.base import SamplingParams
    from flywheel.policy.local import LocalPolicy

    model = build_model(model_dir, shape, device)
    policy = LocalPolicy(model_dir, device=device, precision="auto", model=model)
    dev = next(policy.model.parameters()).device
    fmt, tok = policy.chat_format, policy.tokenizer
    out.put("engine_setup", {"dtype": str(policy.dtype), "device": str(dev),
                             "prefix_attention": policy.prefix_attention,
                             "shape": asdict(policy.shape)})

    async def groups(k: int, salt: int, together: bool) -> tuple[int, float, list[Any]]:
        prompts = _prompts(fmt, tok, w, k, salt)
        calls = [policy.sample(m, SamplingParams(n=w.group_size, max_tokens=w.max_tokens,
                                                 temperature=1.0, seed=salt + i))
                 for i, m in enumerate(prompts)]
        _sync(dev)
        started = time.perf_counter()
        if together:
            done = await asyncio.gather(*calls)
        else:
            done = [await c for c in calls]
        _sync(dev)
        seconds = time.perf_counter() - started
        return sum(len(c.token_ids) for g in done for c in g), seconds, prompts

    async def main() -> None:
        await groups(2, 1, True)  # warm-up: CUDA kernels, the shared start in the prefix cache
        for level in w.levels:
            together = level > 1
            tokens, seconds, prompts = await groups(level if together else w.solo,
                                                    1000 * level, together)
            rows = policy.rows_per_forward([policy.prompt_ids(m) for m in prompts],
                                           w.max_tokens)
            figures = {"tokens": tokens, "seconds": round(seconds, 3),
                       "rows_in_flight": level * w.group_size,
                       "tokens_per_s": round(tokens / seconds, 1), "rows_per_forward": rows,
                       "prompt_tokens": len(policy.prompt_ids(prompts[0]))}
            out.put(f"engine_{level}_groups" if together else "engine_1_group_at_a_time",
                    figures)
        await policy.close()

    asyncio.run(main())
    # Plain `generate` on the rows of `generate_groups` groups, same weights and head.
    from transformers import GenerationConfig

    prompts = _prompts(fmt, tok, w, w.generate_groups, 7)
    rows = [fmt.render(m, None) for m in prompts for _ in range(w.group_size)]
    width = max(len(r) for r in rows)
    pad = int(model.config.pad_token_id or 0)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=dev)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=dev)
    config = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=w.max_tokens, min_new_tokens=w.max_tokens, do_sample=True,
        temperature=1.0, top_k=0, pad_token_id=pad, eos_token_id=model.config.eos_token_id)
    with torch.no_grad():
        model.generate(input_ids=ids[:8], attention_mask=mask[:8], generation_config=config)
        _sync(dev)
        started = time.perf_counter()
        new = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        _sync(dev)
    seconds = time.perf_counter() - started
    tokens = int(new.shape[0]) * (int(new.shape[1]) - width)
    gen = {"rows": len(rows), "tokens": tokens, "seconds": round(seconds, 3),
           "tokens_per_s": round(tokens / seconds, 1),
           "dtype": str(next(model.parameters()).dtype)}  # the engine's: same weights
    out.put("generate", gen)
    from flywheel.policy.memory import ModelShape

    shape_ = ModelShape.of(model.config)
    summary: dict[str, Any] = {}
    for key, figures in list(out.data.items()):
        if not key.startswith("engine_") or "tokens_per_s" not in figures:
            continue
        rows_in_step = min(figures["rows_per_forward"], figures["rows_in_flight"])
        b = _bounds(model, w, rows_in_step, shape_)
        summary[key] = {
            "over_generate": round(figures["tokens_per_s"] / gen["tokens_per_s"], 3),
            "of_memory_bound": _sig(figures["tokens_per_s"] / b["memory_bound_tokens_per_s"]),
            "of_compute_bound": _sig(figures["tokens_per_s"]
                                     / b["compute_bound_tokens_per_s"]),
            "memory_bound_tokens_per_s": round(b["memory_bound_tokens_per_s"], 1),
            "bound_rows": rows_in_step}
    out.put("ratios", summary)


def run_trainer(model_dir: Path, shape: str, device: str, w: Workload, out: _Results) -> None:
    import contextlib
    import uuid

    import torch

    from flywheel.events import GroupScoredPayload, ScoredRollout, Turn
    from flywheel.policy.chat_format import load_chat_format
    from flywheel.policy.precision import ieee_fp32

    fmt = load_chat_format(model_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    gen = torch.Generator().manual_seed(0)
    groups = []
    for i, messages in enumerate(_prompts(fmt, tok, w, w.train_groups, 11)):
        prompt = fmt.render(messages, None)
        rollouts = []
        for j in range(w.group_size):
            ids = torch.randint(100, 40000, (w.max_tokens,), generator=gen).tolist()
            rollouts.append(ScoredRollout(
                index=j, reward=float(j % 2), reward_components={}, failure_mode=None,
                not_run=None, latency_ms=0.0,
                turns=[Turn(prompt_token_ids=prompt, token_ids=ids,
                            logprobs=[-10.0] * len(ids), text="", finish_reason="length")]))
        groups.append(GroupScoredPayload(
            group_id=uuid.uuid4(), task_id=uuid.uuid4(), env="bench", adapter=None,
            adapter_version=None, temperature=1.0, rollouts=rollouts, reward_mean=0.5,
            reward_std=0.5, trainable=True, worker=f"bench{i}"))
    # The defaults (on a GPU: bf16, micro-batches from free memory) against the former ones.
    variants = {"defaults": ("auto", None), "fp32_micro_batch_4": ("fp32", 4)}
    times: dict[str, float] = {}
    for name, (precision, micro) in variants.items():
        # the bf16 run allows TF32 for the whole process: the fp32 baseline runs in IEEE fp32,
        # as the trainer did before (and as the figures were measured)
        with ieee_fp32() if precision == "fp32" else contextlib.nullcontext():
            times[name] = _time_trainer(out, name, model_dir, shape, device, precision, micro,
                                        groups, w)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out.put("trainer_defaults_over_fp32", round(times["fp32_micro_batch_4"]
                                                / times["defaults"], 3))


def _time_trainer(out: _Results, name: str, model_dir: Path, shape: str, device: str,
                  precision: str, micro: int | None, groups: list[Any], w: Workload) -> float:
    """The median step of a fresh trainer (after a warm-up step), reported under `name`."""
    import statistics

    from flywheel.trainer.engine import LoRASpec, LoRATrainer
    from flywheel.trainer.grpo import GRPOConfig

    trainer = LoRATrainer(model_dir, lora=LoRASpec(), grpo=GRPOConfig(), lr=1e-5,
                          device=device, precision=precision, micro_batch=micro,
                          base_model=build_model(model_dir, shape, device))
    trainer.step(groups)  # warm-up
    seconds = []
    for _ in range(w.steps):
        _sync(trainer.device)
        started = time.perf_counter()
        metrics = trainer.step(groups)
        _sync(trainer.device)
        seconds.append(time.perf_counter() - started)
    median = statistics.median(seconds)
    out.put(f"trainer_{name}", {
        "step_s": round(median, 4), "steps": w.steps, "dtype": str(trainer.dtype),
        "micro_batch": trainer.micro_rows(len(groups[0].rollouts[0].turns[0]
                                              .prompt_token_ids), w.max_tokens),
        "samples": metrics["samples"], "loss": metrics.get("loss")})
    return median


PARTS = {"engine": run_engine, "trainer": run_trainer}


def run_gpu_bench(model_dir: Path, out: Path, *, shapes: list[str], parts: list[str],
                  device: str, w: Workload, timeouts: dict[str, float],
                  budget_s: float) -> dict[str, Any]:
    """Every (shape, part) in a child process under its timeout; the whole report in `out`,
    rewritten as each part ends."""
    started = time.monotonic()
    report: dict[str, Any] = {"workload": asdict(w), "device": device,
                              "model_dir": str(model_dir), "shapes": {}}
    work = out.parent / (out.stem + ".parts")
    work.mkdir(parents=True, exist_ok=True)
    for shape in shapes:
        report["shapes"][shape] = {}
        for part in parts:
            left = budget_s - (time.monotonic() - started)
            timeout = min(timeouts[part], left)
            part_file = work / f"{shape}-{part}.json"
            part_file.unlink(missing_ok=True)
            entry: dict[str, Any] = {}
            if timeout < 5:
                entry["error"] = "skipped: the run's budget is spent"
            else:
                cmd = [sys.executable, "-m", "flywheel.bench.gpu", "--child", part,
                       "--shape", shape, "--model-dir", str(model_dir), "--device", device,
                       "--out", str(part_file), "--workload", json.dumps(asdict(w))]
                t0 = time.monotonic()
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                    if proc.returncode != 0:
                        entry["error"] = f"exit {proc.returncode}: {proc.stderr[-1500:]}"
                except subprocess.TimeoutExpired:
                    entry["error"] = f"timed out after {timeout:.0f} s (figures so far kept)"
                entry["wall_s"] = round(time.monotonic() - t0, 1)
            if part_file.is_file():
                entry.update(json.loads(part_file.read_text()))
            report["shapes"][shape][part] = entry
            out.write_text(json.dumps(report, indent=1, default=str))
    report["total_s"] = round(time.monotonic() - started, 1)
    out.write_text(json.dumps(report, indent=1, default=str))
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m flywheel.bench.gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True,
                    help="config.json + tokenizer files (e.g. .gpu-bundle/model)")
    ap.add_argument("--out", type=Path, default=Path("gpu-bench.json"))
    ap.add_argument("--shapes", default="smollm2-135m,smollm2-1.7b")
    ap.add_argument("--parts", default="engine,trainer")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--engine-timeout", type=float, default=110.0)
    ap.add_argument("--trainer-timeout", type=float, default=60.0)
    ap.add_argument("--budget", type=float, default=340.0, help="seconds for the whole run")
    ap.add_argument("--bandwidth", type=float, default=Workload.bandwidth)
    ap.add_argument("--peak-flops", type=float, default=Workload.peak_flops)
    ap.add_argument("--prompt-tokens", type=int, default=Workload.prompt_tokens)
    ap.add_argument("--shared-tokens", type=int, default=Workload.shared_tokens)
    ap.add_argument("--max-tokens", type=int, default=Workload.max_tokens)
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--generate-groups", type=int, default=Workload.generate_groups)
    ap.add_argument("--write-model", type=Path, default=None,
                    help="only save a random-init model of the first shape there and exit")
    ap.add_argument("--child", choices=sorted(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.device == "auto":
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.child:
        w = Workload(**{**json.loads(a.workload),
                        "levels": tuple(json.loads(a.workload)["levels"])})
        PARTS[a.child](a.model_dir, a.shape, a.device, w, _Results(a.out))
        return
    shapes = [s for s in a.shapes.split(";" if "=" in a.shapes else ",") if s]
    if a.write_model is not None:
        print(write_model(a.model_dir, shapes[0], a.write_model))
        return
    w = Workload(prompt_tokens=a.prompt_tokens, shared_tokens=a.shared_tokens,
                 max_tokens=a.max_tokens, levels=tuple(int(x) for x in a.levels.split(",")),
                 generate_groups=a.generate_groups, bandwidth=a.bandwidth,
                 peak_flops=a.peak_flops)
    report = run_gpu_bench(a.model_dir, a.out, shapes=shapes, parts=a.parts.split(","),
                           device=a.device, w=w, budget_s=a.budget,
                           timeouts={"engine": a.engine_timeout, "trainer": a.trainer_timeout})
    print(json.dumps(report, indent=1, default=str))
    failed = [f"{s}/{p}" for s, parts in report["shapes"].items()
              for p, e in parts.items() if "error" in e]
    if failed:
        print(f"bench gpu: {len(failed)} part(s) failed or timed out: {', '.join(failed)}",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
