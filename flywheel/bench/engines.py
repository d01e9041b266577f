"""`flywheel bench rollout --engine vllm`: groups through vLLM against the local engine.

Both engines run the rollout loop (`run_group`: prompt, group sampling, verification) on the
same tool_call tasks with the same group size, token limit, temperature and seeds, in the
same run, one group after another as a worker runs them, after one warm-up group each (the
first request after a vLLM start is slow). The two engines never run at once. Reports
completions/s and tokens/s of each and `vllm_over_local` (tokens/s ratio); `--lora` adds the
same comparison through a LoRA version (a fresh adapter, placed on both engines). When no
`--vllm-url` is given, the run starts a local vLLM server exactly as `flywheel vllm serve`
does, reports its start time, and stops it.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from flywheel.bench.learning import fixed_tasks
from flywheel.config import RolloutSettings, Settings
from flywheel.environments import load_environment
from flywheel.policy.base import AdapterRef, Policy
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import TaskSpec


async def _side(policy: Policy, tasks: list[TaskSpec], cfg: GroupConfig,
                adapter: AdapterRef | None) -> dict[str, Any]:
    env = load_environment("tool_call")
    if adapter is not None:
        await policy.ensure_adapter(adapter)
    await run_group(policy, tasks[0], env, cfg, adapter=adapter, seed=0, group_key="warm")
    started, tokens, completions, prompts = time.perf_counter(), 0, 0, []
    for i, task in enumerate(tasks[1:], start=1):
        group = await run_group(policy, task, env, cfg, adapter=adapter, seed=1000 + i,
                                group_key=f"bench{i}")
        failed = [r.not_run for r in group.rollouts if r.not_run is not None]
        if failed:  # a throughput of attempts that did not run would be a made-up figure
            raise RuntimeError(f"{len(failed)} of {len(group.rollouts)} attempts did not run "
                               f"({', '.join(sorted(set(failed)))})")
        for rollout in group.rollouts:
            tokens += sum(len(t.token_ids) for t in rollout.turns)
            completions += len(rollout.turns)
        prompts.append(group.rollouts[0].turns[0].prompt_token_ids)
    seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 2), "completions": completions, "tokens": tokens,
            "completions_per_s": round(completions / seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "_prompts": prompts}


def _fresh_adapter(policy_name: str, out: Path, rank: int) -> AdapterRef:
    from flywheel.policy.model_cache import resolve_model_dir
    from flywheel.trainer.engine import LoRASpec, LoRATrainer
    from flywheel.trainer.grpo import GRPOConfig

    trainer = LoRATrainer(resolve_model_dir(None), lora=LoRASpec(r=rank), grpo=GRPOConfig(),
                          lr=1e-4)
    trainer.save(out)
    return AdapterRef(policy_name, 1, out)


async def _compare(settings: Settings, url: str, tasks: list[TaskSpec], cfg: GroupConfig,
                   adapter: AdapterRef | None) -> dict[str, Any]:
    from flywheel.policy.factory import make_policy

    served = settings.model_copy(update={"rollout": settings.rollout.model_copy(
        update={"engine": "vllm", "vllm_urls": [url]})})
    out: dict[str, Any] = {}
    for name, s in (("vllm", served), ("local", settings)):
        policy = make_policy(s)
        try:
            out[name] = await _side(policy, tasks, cfg, adapter)
        finally:
            await policy.close()
    same = out["vllm"].pop("_prompts") == out["local"].pop("_prompts")
    out["vllm_over_local"] = round(out["vllm"]["tokens_per_s"] / out["local"]["tokens_per_s"], 2)
    out["same_prompt_ids"] = same
    return out


def run_engine_bench(groups: int = 6, *, group_size: int = 8, max_tokens: int = 32,
                     vllm_url: str | None = None, python: Path | None = None,
                     lora: bool = False, gpu: bool = False) -> dict[str, Any]:
    from flywheel.policy.vllm_flags import default_python, server_args, server_config, server_env
    from flywheel.stack.broker import free_port
    from flywheel.stack.vllm_server import VLLMServer

    settings = Settings(rollout=RolloutSettings(vllm_model="policy-base"))
    # No deadline: on a busy CPU a group may take minutes, and an attempt cut off would not
    # count (the worker types it `timeout` and excludes it).
    cfg = GroupConfig(group_size=group_size, max_tokens=max_tokens,
                      temperature=settings.rollout.temperature, rollout_timeout_s=3600)
    tasks = fixed_tasks(groups + 1, seed=3)
    result: dict[str, Any] = {"groups": groups, "group_size": group_size,
                              "max_tokens": max_tokens, "vllm_device": "gpu" if gpu else "cpu"}
    server = None
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-vllm-") as work:
        if vllm_url is None:
            flags = server_config(settings, port=free_port(), device="gpu" if gpu else "cpu")
            server = VLLMServer(python or settings.rollout.vllm_python or default_python(),
                                server_args(flags), server_env(flags), flags.url,
                                Path(work) / "vllm.log")
            server.start()
            result["engine_start_s"] = round(server.wait_healthy(), 1)
            vllm_url = flags.url
        try:
            result["base"] = asyncio.run(_compare(settings, vllm_url, tasks, cfg, None))
            if lora:
                adapter = _fresh_adapter(settings.policy, Path(work) / "v1",
                                         settings.trainer.lora_r)
                result["lora"] = asyncio.run(_compare(settings, vllm_url, tasks, cfg, adapter))
        finally:
            if server is not None:
                server.stop()
    return result
