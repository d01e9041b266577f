"""`flywheel vllm args|serve|stop`: a vLLM server for the configured policy.

The command line is `flywheel.policy.vllm_flags.server_config(settings)`: the model the
model cache converted, the trainer's LoRA rank, runtime adapter loading, processed
log-probs, fp32 on CPU, the tool-call chat template and parser (infra/vllm.md).
"""

from __future__ import annotations

import shlex
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from flywheel.cli.common import console, fail, load_settings

if TYPE_CHECKING:
    from flywheel.config import Settings
    from flywheel.policy.vllm_flags import ServerConfig
    from flywheel.stack.vllm_server import VLLMServer

vllm_app = typer.Typer(no_args_is_help=True, help="A vLLM server for the configured policy "
                       "(CPU: `make vllm` installs it; see infra/vllm.md).")

GpuOpt = Annotated[bool, typer.Option("--gpu", help="GPU flags: dtype auto, no CPU "
                                      "settings.")]
PortOpt = Annotated[int | None, typer.Option(help="Port (default rollout.vllm_local_port).")]


def _device(gpu: bool) -> Literal["cpu", "gpu"]:
    return "gpu" if gpu else "cpu"


def _record_path() -> Path:
    return load_settings().home / "vllm.json"


def build_server(settings: Settings, *, python: Path | None = None,
                 device: Literal["cpu", "gpu"] = "cpu", port: int | None = None
                 ) -> tuple[ServerConfig, VLLMServer]:
    """The server for `settings`' policy (`flywheel vllm serve`, `flywheel up`)."""
    from flywheel.policy.vllm_flags import default_python, server_args, server_config, server_env
    from flywheel.stack.vllm_server import VLLMServer

    cfg = server_config(settings, device=device, port=port)
    server = VLLMServer(python or settings.rollout.vllm_python or default_python(),
                        server_args(cfg), server_env(cfg), cfg.url,
                        settings.home.resolve() / "logs" / "vllm.log")
    return cfg, server


@vllm_app.command("args")
def args(gpu: GpuOpt = False, port: PortOpt = None) -> None:
    """Print the server's environment and command line (to run it elsewhere)."""
    from flywheel.policy.vllm_flags import server_args, server_config, server_env

    cfg = server_config(load_settings(), device=_device(gpu), port=port)
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in server_env(cfg).items())
    print(f"{env} python {shlex.join(server_args(cfg))}")


@vllm_app.command("serve")
def serve(
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Return once healthy; stop "
                                         "it with `flywheel vllm stop`.")] = False,
    python: Annotated[Path | None, typer.Option(help="Interpreter with vLLM (default "
                                                "rollout.vllm_python or .venv-vllm).")] = None,
    gpu: GpuOpt = False, port: PortOpt = None,
    startup_timeout: Annotated[float, typer.Option(help="Seconds to wait for /health.")] = 600,
) -> None:
    """Start vLLM on 127.0.0.1 for the configured policy and wait until it is healthy."""
    from flywheel.stack.vllm_server import VLLMStartError, recorded

    settings = load_settings()
    record = settings.home / "vllm.json"
    if (running := recorded(record)) is not None:
        fail(f"a vLLM server started by flywheel already runs at {running['url']} (pid "
              f"{running['pid']}); `flywheel vllm stop` first")
    settings.home.mkdir(parents=True, exist_ok=True)
    cfg, server = build_server(settings, python=python, device=_device(gpu), port=port)
    try:
        server.start()
        startup = server.wait_healthy(startup_timeout)
    except VLLMStartError as err:
        server.stop()
        fail(str(err))
        return
    server.record(record)
    console.print(f"vLLM healthy at {cfg.url} after {startup:.1f}s (model "
                  f"{cfg.served_name}, log {server.log_path})")
    print(cfg.url)
    if detach:
        return
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            if not server.alive():
                fail(f"vLLM exited; see {server.log_path}")
    finally:
        server.stop()
        record.unlink(missing_ok=True)


@vllm_app.command("stop")
def stop() -> None:
    """Stop the server `flywheel vllm serve --detach` started (its whole process group)."""
    from flywheel.stack.vllm_server import stop_recorded

    data = stop_recorded(_record_path())
    console.print(f"stopped vLLM at {data['url']}" if data else "no vLLM server running")
