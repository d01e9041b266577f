"""Two vLLM replicas, one killed mid-run: the survivor keeps serving, errors are typed.

By default the second replica is a second address of the session's one server: a TCP
forwarder in its own process, killed (SIGKILL) while requests run through it, so the client
sees exactly what a dying replica does to its connections. On the shared 2-core machine two
vLLM servers (4 GB and one bound core each) do not fit next to the tests;
`FLYWHEEL_TEST_VLLM_REPLICAS=2` starts a second real server instead and kills that.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from flywheel.policy.base import AdapterRef, PolicyError, SamplingParams
from flywheel.policy.vllm import VLLMPolicy
from flywheel.stack.vllm_server import stop_group
from tests.support.vllm_server import (
    REPORT,
    SERVED,
    CountingTransport,
    Proxy,
    RealVLLM,
    start_server,
    unload,
    vllm_python,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MESSAGES = [{"role": "user", "content": "Tell me a short story about a robot."}]


@pytest.fixture
def second_replica(vllm_server: RealVLLM, services_dir: Path
                   ) -> Iterator[tuple[str, Callable[[], None]]]:
    """(url, kill) of a second replica."""
    python = vllm_python()
    if os.environ.get("FLYWHEEL_TEST_VLLM_REPLICAS") == "2" and python is not None:
        other = start_server(python, services_dir / "vllm-2")
        assert other.server.proc is not None
        pid = other.server.proc.pid
        REPORT["second replica"] = "a second vLLM server"
        yield other.url, lambda: stop_group(pid, grace_s=0)
        other.server.stop()
        return
    proxy = Proxy(vllm_server.cfg.port)
    REPORT["second replica"] = "the same server behind a TCP forwarder (killed with SIGKILL)"
    try:
        yield proxy.url, proxy.kill
    finally:
        proxy.kill()


def listed(url: str) -> set[str]:
    data = httpx.get(f"{url}/v1/models", timeout=30).raise_for_status().json()
    return {card["id"] for card in data["data"]}


async def test_a_replica_killed_mid_run_leaves_the_survivor_serving(
        vllm_server: RealVLLM, vllm_adapters: dict[str, Path],
        second_replica: tuple[str, Callable[[], None]]) -> None:
    survivor, (doomed, kill) = vllm_server.url, second_replica
    transport = CountingTransport()
    policy = VLLMPolicy([survivor, doomed], model=SERVED, policy_name="replicas",
                        transport=transport, backoff_s=0.1, cooldown_s=600)
    v1 = AdapterRef("replicas", 1, vllm_adapters["v1"])
    v2 = AdapterRef("replicas", 2, vllm_adapters["v2"])
    try:
        await policy.ensure_adapter(v1)
        assert all("replicas@v1" in listed(url) for url in (survivor, doomed))
        params = SamplingParams(n=4, max_tokens=48, temperature=1.0)
        groups = [asyncio.create_task(policy.sample(MESSAGES, replace(params, seed=i),
                                                    adapter=v1)) for i in range(6)]
        deadline = time.monotonic() + 120
        while policy._replicas[1].in_flight == 0:  # kill it while it is answering
            assert time.monotonic() < deadline, "no request reached the second replica"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        kill()
        results = await asyncio.gather(*groups)
        assert all(len(g) == 4 and all(len(c.token_ids) == len(c.logprobs) > 0 for c in g)
                   for g in results)
        assert transport.failed.get(doomed, 0) >= 1  # requests were cut mid-answer
        for i in range(3):
            (c,) = await policy.sample(MESSAGES, replace(params, n=1, seed=100 + i),
                                       adapter=v1)
            assert c.extra["replica"] == survivor
        assert policy._replicas[1].down_until > time.monotonic()  # benched

        # A new version while a replica is down: placed and verified on the survivor, the dead
        # one skipped (one attempt: it is benched) until it answers again.
        started = time.monotonic()
        await policy.ensure_adapter(v2)
        assert time.monotonic() - started < 10
        (c,) = await policy.sample(MESSAGES, replace(params, n=1, seed=7), adapter=v2)
        assert c.extra["replica"] == survivor and c.adapter == "replicas@v2"
        # Errors stay typed: an unload cannot reach the dead replica, and says so.
        with pytest.raises(PolicyError, match=rf"{doomed}.*unreachable"):
            await policy.retire_adapter(v1)
    finally:
        await policy.close()
        unload(survivor, "replicas@v1", "replicas@v2")
