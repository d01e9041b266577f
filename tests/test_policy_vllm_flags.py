"""How Flywheel starts vLLM (flags, env, pins), what its errors mean, and the server process
(a stand-in that answers /health: no vLLM needed)."""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flywheel.config import RolloutSettings, Settings, TrainerSettings
from flywheel.policy.vllm_errors import VLLMError, classify, is_retryable, load_fix
from flywheel.policy.vllm_flags import (
    VLLM_CPU_VERSION,
    ServerConfig,
    lora_rank_flag,
    server_args,
    server_config,
    server_env,
)
from flywheel.stack.broker import free_port
from flywheel.stack.vllm_server import VLLMServer, VLLMStartError, recorded, stop_recorded

ROOT = Path(__file__).resolve().parents[1]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_lora_rank_rounds_up_to_a_value_vllm_accepts() -> None:
    assert [lora_rank_flag(r) for r in (1, 4, 8, 16, 17, 300, 512)] == \
        [1, 8, 8, 16, 32, 320, 512]
    with pytest.raises(ValueError, match=r"trainer\.lora_r <= 512"):
        lora_rank_flag(513)


def test_cpu_and_gpu_flags() -> None:
    cpu = ServerConfig(model_dir=Path("/m"), port=9000, lora_rank=12, max_loras=3,
                       max_cpu_loras=4, chat_template=Path("/t.jinja"))
    args = server_args(cpu)
    assert args[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert (flag(args, "--dtype"), flag(args, "--max-lora-rank")) == ("float32", "16")
    assert (flag(args, "--max-loras"), flag(args, "--max-cpu-loras")) == ("3", "4")
    assert flag(args, "--logprobs-mode") == "processed_logprobs"
    assert flag(args, "--generation-config") == "vllm"
    assert flag(args, "--tool-call-parser") == "hermes" and "--enable-auto-tool-choice" in args
    assert (flag(args, "--host"), flag(args, "--chat-template")) == ("127.0.0.1", "/t.jinja")
    assert server_env(cpu) == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                               "VLLM_CPU_KVCACHE_SPACE": "1"}
    gpu = ServerConfig(model_dir=Path("/m"), device="gpu", gpu_memory_utilization=0.4)
    assert flag(server_args(gpu), "--dtype") == "auto"
    assert flag(server_args(gpu), "--gpu-memory-utilization") == "0.4"
    assert "--chat-template" not in server_args(gpu)
    assert server_env(gpu) == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with pytest.raises(ValueError, match="max_cpu_loras"):
        server_args(ServerConfig(model_dir=Path("/m"), max_loras=4, max_cpu_loras=2))


def test_the_server_follows_the_settings() -> None:
    settings = Settings(rollout=RolloutSettings(vllm_model="base", max_staleness=3,
                                                vllm_local_port=8123),
                        trainer=TrainerSettings(lora_r=24))
    cfg = server_config(settings, model_dir=Path("/m"), chat_template=None)
    assert (cfg.served_name, cfg.port, cfg.lora_rank) == ("base", 8123, 24)
    # retention (staleness + 1) + production + baseline, all in one batch
    assert (cfg.max_loras, cfg.max_cpu_loras) == (6, 9)
    assert flag(server_args(cfg), "--max-lora-rank") == "32"


def test_the_cpu_pin_is_the_one_checked_and_inside_the_gpu_range() -> None:
    script = (ROOT / "infra" / "vllm-cpu.sh").read_text()
    assert f"VLLM_CPU_SPEC='vllm-cpu=={VLLM_CPU_VERSION}'" in script
    assert f"VLLM_CPU_VERSION={VLLM_CPU_VERSION}" in script
    pyproject = (ROOT / "pyproject.toml").read_text()
    low, high = re.search(r'"vllm>=([\d.]+),<([\d.]+)"', pyproject).groups()  # type: ignore[union-attr]
    version = tuple(map(int, VLLM_CPU_VERSION.split(".")))
    assert tuple(map(int, low.split("."))) <= version < tuple(map(int, high.split(".")))


MESSAGES = {
    "rank": "Call to add_lora method failed: Worker failed with error 'LoRA rank 32 is greater "
            "than max_lora_rank 16.', please check the stack trace above for the root cause",
    "corrupt": "Call to add_lora method failed: Worker failed with error 'Error while "
               "deserializing header: incomplete metadata, file not fully covered', please "
               "check the stack trace above for the root cause",
    "dead": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
}


def test_errors_are_typed_by_what_retrying_can_do() -> None:
    load = "/v1/load_lora_adapter"
    assert classify(load, 500, MESSAGES["rank"]) == "permanent"
    assert classify(load, 500, MESSAGES["corrupt"]) == "permanent"
    assert classify("/v1/chat/completions", 500, MESSAGES["dead"]) == "dead"
    assert classify(load, 500, MESSAGES["dead"]) == "dead"
    assert classify("/v1/chat/completions", 503, "overloaded") == "transient"
    assert classify("/v1/chat/completions", 429, "slow down") == "transient"
    assert classify("/v1/chat/completions", 400, "bad") == "permanent"
    assert not is_retryable(VLLMError("r", 500, MESSAGES["rank"], "permanent"))
    assert is_retryable(VLLMError("r", 500, MESSAGES["dead"], "dead"))
    assert "restarted" in str(VLLMError("r", 500, MESSAGES["dead"], "dead"))


def test_each_refused_load_names_its_fix() -> None:
    def fix(status: int, message: str) -> str:
        return load_fix(VLLMError("r", status, message), "/adapters/p/v3")

    assert "--max-lora-rank ≥ 32 (--max-lora-rank 32)" in fix(500, MESSAGES["rank"])
    assert "publish the weights again" in fix(500, MESSAGES["corrupt"])
    assert "--enable-lora" in fix(500, "Call to add_lora method failed: Worker failed with "
                                       "error 'LoRA is not enabled. Use --enable-lora to "
                                       "enable LoRA.'")
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in fix(404, "Not Found")
    assert "cannot read /adapters/p/v3" in fix(404, "Loading lora p@v3 failed: No adapter "
                                                    "found for /adapters/p/v3")


FAKE_SERVER = textwrap.dedent('''
    import http.server, subprocess, sys
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # an "engine"
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')


def _group(pgid: int) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(pid))
    return found


def test_the_server_runs_in_its_own_group_and_stops_with_all_of_it(tmp_path: Path) -> None:
    port = free_port()
    server = VLLMServer(Path(sys.executable), ["-c", FAKE_SERVER, str(port)], {},
                        f"http://127.0.0.1:{port}", tmp_path / "vllm.log")
    server.start()
    try:
        assert server.wait_healthy(30) < 30
        assert server.proc is not None
        pgid = server.proc.pid
        deadline = time.monotonic() + 10
        while len(_group(pgid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_group(pgid)) == 2  # the server and its "engine"
        server.record(tmp_path / "vllm.json")
        assert recorded(tmp_path / "vllm.json") is None  # not a vLLM process: never stopped
    finally:
        server.stop(grace_s=5)
    assert _group(pgid) == []
    assert stop_recorded(tmp_path / "vllm.json") is None
    assert not (tmp_path / "vllm.json").exists()


def test_a_server_that_exits_at_start_shows_its_log(tmp_path: Path) -> None:
    port = free_port()
    server = VLLMServer(Path(sys.executable), ["-c", "import sys; print('no GPU here'); "
                                               "sys.exit(3)"], {}, f"http://127.0.0.1:{port}",
                        tmp_path / "vllm.log")
    server.start()
    with pytest.raises(VLLMStartError, match=r"exited with 3 during startup(.|\n)*no GPU here"):
        server.wait_healthy(30)
    with pytest.raises(VLLMStartError, match=r"does not exist: install vLLM first"):
        VLLMServer(tmp_path / "nope", [], {}, "http://127.0.0.1:1", tmp_path / "l").start()
