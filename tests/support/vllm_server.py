"""The real vLLM server the `vllm`-marked tests run against, and what they share.

One server per test session, started exactly as `flywheel vllm serve` starts it
(`flywheel.policy.vllm_flags.server_config`), from `.venv-vllm` (`make vllm`) or
`FLYWHEEL_TEST_VLLM_PYTHON`. On a GPU machine `FLYWHEEL_TEST_VLLM_DEVICE=gpu` switches to the
GPU flags (dtype auto, no CPU settings): infra/gpu-check.sh runs the same tests that way.
Measurements (start time, log-prob agreement, tokens/s, load time) are collected in `REPORT`,
printed at the end of the session and written to `FLYWHEEL_TEST_VLLM_REPORT` if set.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from flywheel.config import RolloutSettings, Settings
from flywheel.policy.vllm_flags import ServerConfig, server_args, server_config, server_env
from flywheel.stack.broker import free_port
from flywheel.stack.vllm_server import VLLMServer

ROOT = Path(__file__).resolve().parents[2]
SERVED = "policy-base"
REPORT: dict[str, Any] = {}


def vllm_python() -> Path | None:
    configured = os.environ.get("FLYWHEEL_TEST_VLLM_PYTHON")
    path = Path(configured) if configured else ROOT / ".venv-vllm" / "bin" / "python"
    return path if path.is_file() else None


def device() -> Literal["cpu", "gpu"]:
    return "gpu" if os.environ.get("FLYWHEEL_TEST_VLLM_DEVICE") == "gpu" else "cpu"


def served_settings(home: Path, urls: list[str] | None = None, **rollout: Any) -> Settings:
    """Settings of a policy served by the test server (`rollout.engine = vllm`)."""
    return Settings(home=home, rollout=RolloutSettings(
        engine="vllm", vllm_urls=urls or [], vllm_model=SERVED, **rollout))


@dataclass
class RealVLLM:
    cfg: ServerConfig
    server: VLLMServer
    startup_s: float

    @property
    def url(self) -> str:
        return self.cfg.url

    @property
    def fp32(self) -> bool:
        return "--dtype" in self.server.args and \
            self.server.args[self.server.args.index("--dtype") + 1] in ("float32", "float")

    def models(self) -> dict[str, dict[str, Any]]:
        """`GET /v1/models`, by id."""
        data = httpx.get(f"{self.url}/v1/models", timeout=30).raise_for_status().json()
        return {card["id"]: card for card in data["data"]}


def start_server(python: Path, home: Path, port: int | None = None) -> RealVLLM:
    settings = served_settings(home)
    overrides: dict[str, Any] = {"gpu_memory_utilization": 0.4} if device() == "gpu" else {}
    if dtype := os.environ.get("FLYWHEEL_TEST_VLLM_DTYPE"):
        overrides["dtype"] = dtype
    cfg = server_config(settings, device=device(), port=port or free_port(), **overrides)
    server = VLLMServer(python, server_args(cfg), server_env(cfg), cfg.url,
                        home / f"vllm-{cfg.port}.log")
    server.start()
    try:
        startup = server.wait_healthy(float(os.environ.get("FLYWHEEL_TEST_VLLM_STARTUP_S",
                                                           900)))
    except BaseException:
        server.stop()
        raise
    return RealVLLM(cfg, server, startup)


class Proxy:
    """A second replica address for one server: a TCP forwarder in its own process, so a
    test can kill it (SIGKILL) with requests in flight, as a replica dies."""

    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.tcp_proxy",
                                      str(self.port), str(target_port)],
                                     cwd=ROOT, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "ready" once it listens
        if b"ready" not in line:
            self.kill()
            raise RuntimeError(f"the TCP proxy did not start: {line!r}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


class CountingTransport(httpx.AsyncBaseTransport):
    """Counts requests per (replica, path) and transport failures per replica."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.calls: dict[tuple[str, str], int] = {}
        self.failed: dict[str, int] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        origin = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        key = (origin, request.url.path)
        self.calls[key] = self.calls.get(key, 0) + 1
        try:
            return await self.inner.handle_async_request(request)
        except httpx.TransportError:
            self.failed[origin] = self.failed.get(origin, 0) + 1
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()


def write_adapters(out: Path) -> dict[str, Path]:
    """Random PEFT LoRA versions like the trainer's (r = trainer.lora_r, q/k/v/o), with lora_B
    drawn small but non-zero so each one changes the model; plus the two vLLM refuses at load:
    rank 32 (> --max-lora-rank 16) and truncated weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from flywheel.policy.model_cache import resolve_model_dir

    settings = Settings()
    model_dir, rank = resolve_model_dir(None), settings.trainer.lora_r
    paths: dict[str, Path] = {}
    for name, seed, r in (("v1", 1, rank), ("v2", 2, rank), ("r32", 3, 32)):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(
            r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if "lora_B" in pname:
                    param.normal_(std=0.02)
        model.save_pretrained(out / name)
        paths[name] = out / name
    broken = out / "corrupt"
    shutil.copytree(out / "v1", broken)
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    paths["corrupt"] = broken
    return paths


def report_lines() -> Iterator[str]:
    for key, value in REPORT.items():
        yield f"  {key}: {value}"


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def unload(url: str, *names: str) -> None:
    """Leave the session's server as found (404 for a name already gone is fine)."""
    for name in names:
        post(url, "/v1/unload_lora_adapter", {"lora_name": name})
