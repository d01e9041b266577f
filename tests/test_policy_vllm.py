"""VLLMPolicy against a fake vLLM cluster (httpx.MockTransport), plus one real-vLLM check.

The fake speaks the parts of vLLM's HTTP API Flywheel uses, per replica: /v1/models (with
`root`), /v1/load_lora_adapter, /v1/unload_lora_adapter, /v1/chat/completions (logprob tokens
as "token_id:N"), /tokenize and /detokenize. Its tokenizer is one token per character
(id = ord(c)), so expected ids and cuts are easy to compute by hand.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from flywheel.policy.base import AdapterRef, Policy, PolicyError, SamplingParams
from flywheel.policy.vllm import VLLMPolicy, is_retryable, json_object_end

MESSAGES = [{"role": "user", "content": "hi"}]


def _logprob(j: int) -> float:
    return -0.25 - j / 100


def _render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
    return text + ("<assistant>" if add_generation_prompt else "")


def _json(status: int, body: Any) -> httpx.Response:
    return httpx.Response(status, json=body)


def _error(status: int, message: str) -> httpx.Response:
    return _json(status, {"error": {"message": message, "type": "Error", "code": status}})


@dataclass
class FakeReplica:
    url: str
    base_model: str = "base"
    loaded: dict[str, str] = field(default_factory=dict)
    lag_once: bool = False
    """The first /v1/models after a load does not list the new adapter yet."""
    never_list: bool = False
    runtime_lora: bool = True
    returns_prompt_ids: bool = True
    chat_failures: list[int | str] = field(default_factory=list)
    """Queue of failures to answer chat requests with: an HTTP status or "connect"."""
    texts: list[str] = field(default_factory=lambda: ["abc"])
    calls: Counter[str] = field(default_factory=Counter)
    bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    _hidden: set[str] = field(default_factory=set)

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls[path] += 1
        body = json.loads(request.content) if request.content else {}
        self.bodies.append((path, body))
        if path == "/v1/models":
            visible = {n: p for n, p in self.loaded.items()
                       if not self.never_list and n not in self._hidden}
            self._hidden.clear()
            cards = [{"id": self.base_model, "root": "/models/base", "parent": None}]
            cards += [{"id": n, "root": p, "parent": self.base_model} for n, p in visible.items()]
            return _json(200, {"object": "list", "data": cards})
        if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and not self.runtime_lora:
            return _json(404, {"detail": "Not Found"})
        if path == "/v1/load_lora_adapter":
            name = body["lora_name"]
            if name in self.loaded:
                return _error(400, f"The lora adapter '{name}' has already been loaded.")
            self.loaded[name] = body["lora_path"]
            if self.lag_once:
                self._hidden.add(name)
                self.lag_once = False
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")
        if path == "/v1/unload_lora_adapter":
            name = body["lora_name"]
            if self.loaded.pop(name, None) is None:
                return _error(404, f"The lora adapter '{name}' cannot be found.")
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' removed.")
        if path == "/tokenize":
            ids = [ord(c) for c in _render(body["messages"],
                                           body.get("add_generation_prompt", True))]
            return _json(200, {"tokens": ids, "count": len(ids), "max_model_len": 4096})
        if path == "/detokenize":
            return _json(200, {"prompt": "".join(chr(t) for t in body["tokens"])})
        if path == "/v1/chat/completions":
            return self._chat(request, body)
        return _json(404, {"detail": "Not Found"})

    def _chat(self, request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if self.chat_failures:
            failure = self.chat_failures.pop(0)
            if failure == "connect":
                raise httpx.ConnectError("connection refused", request=request)
            return _error(int(failure), f"injected failure {failure}")
        if body["model"] != self.base_model and body["model"] not in self.loaded:
            return _error(404, f"The model `{body['model']}` does not exist.")
        choices = []
        for i in range(body["n"]):
            text, finish, stop_reason = self.texts[i % len(self.texts)], "stop", None
            for stop in body.get("stop", []):
                if stop in text:
                    text, stop_reason = text[:text.index(stop) + len(stop)], stop
            if len(text) > body["max_tokens"]:
                text, finish = text[:body["max_tokens"]], "length"
            content = [{"token": f"token_id:{ord(c)}", "logprob": _logprob(j), "bytes": []}
                       for j, c in enumerate(text)]
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "logprobs": {"content": content}, "finish_reason": finish,
                            "stop_reason": stop_reason})
        data: dict[str, Any] = {"id": "chatcmpl-1", "model": body["model"], "choices": choices}
        if self.returns_prompt_ids:
            data["prompt_token_ids"] = [ord(c) for c in _render(
                body["messages"], body.get("add_generation_prompt", True))]
        return _json(200, data)


class FakeCluster:
    def __init__(self, n: int) -> None:
        self.replicas = [FakeReplica(f"http://replica{i}:8000") for i in range(n)]
        self.transport = httpx.MockTransport(self._route)

    def _route(self, request: httpx.Request) -> httpx.Response:
        origin = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        return next(r for r in self.replicas if r.url == origin).handle(request)

    def policy(self, **kwargs: Any) -> VLLMPolicy:
        opts: dict[str, Any] = {"model": "base", "backoff_s": 0, "verify_delay_s": 0, **kwargs}
        return VLLMPolicy([r.url for r in self.replicas], transport=self.transport, **opts)

    def chat_calls(self) -> int:
        return sum(r.calls["/v1/chat/completions"] for r in self.replicas)


def ref(version: int, path: str | None = None) -> AdapterRef:
    return AdapterRef("policy", version, Path(path or f"/adapters/policy/v{version}"))


async def test_each_version_is_served_under_its_own_name_on_every_replica() -> None:
    cluster = FakeCluster(3)
    policy = cluster.policy()
    assert isinstance(policy, Policy)
    await policy.ensure_adapter(ref(1))
    await policy.ensure_adapter(ref(2))
    for r in cluster.replicas:
        assert r.loaded == {"policy@v1": "/adapters/policy/v1", "policy@v2": "/adapters/policy/v2"}
    out = await policy.sample(MESSAGES, SamplingParams(n=2), adapter=ref(2))
    assert [c.adapter for c in out] == ["policy@v2", "policy@v2"]
    last_chat = [b for r in cluster.replicas for p, b in r.bodies if p == "/v1/chat/completions"]
    assert last_chat[-1]["model"] == "policy@v2"
    base = await policy.sample(MESSAGES, SamplingParams(n=1))
    assert base[0].adapter is None
    await policy.close()


async def test_a_lagging_replica_is_verified_again_until_it_lists_the_adapter() -> None:
    cluster = FakeCluster(2)
    cluster.replicas[1].lag_once = True
    policy = cluster.policy()
    await policy.ensure_adapter(ref(1))
    assert cluster.replicas[1].calls["/v1/models"] > cluster.replicas[0].calls["/v1/models"]
    out = await policy.sample(MESSAGES, SamplingParams(n=1), adapter=ref(1))
    assert out[0].adapter == "policy@v1"


async def test_a_replica_that_never_lists_the_adapter_is_named_and_never_routed_to() -> None:
    cluster = FakeCluster(3)
    cluster.replicas[2].never_list = True
    policy = cluster.policy(verify_attempts=3)
    with pytest.raises(PolicyError, match=r"replica2.*does not list it"):
        await policy.ensure_adapter(ref(1))
    for _ in range(4):
        await policy.sample(MESSAGES, SamplingParams(n=1), adapter=ref(1))
    assert cluster.replicas[2].calls["/v1/chat/completions"] == 0


async def test_an_adapter_already_listed_is_never_loaded_again() -> None:
    cluster = FakeCluster(2)
    cluster.replicas[0].loaded["policy@v1"] = "/adapters/policy/v1"
    policy = cluster.policy()
    await policy.ensure_adapter(ref(1))
    await policy.ensure_adapter(ref(1))  # idempotent
    assert cluster.replicas[0].calls["/v1/load_lora_adapter"] == 0
    assert cluster.replicas[1].calls["/v1/load_lora_adapter"] == 1


async def test_the_same_name_from_a_different_path_is_refused() -> None:
    cluster = FakeCluster(2)
    cluster.replicas[1].loaded["policy@v1"] = "/adapters/elsewhere"
    policy = cluster.policy()
    with pytest.raises(PolicyError, match=r"replica1.*/adapters/elsewhere.*immutable"):
        await policy.ensure_adapter(ref(1))
    assert all(r.calls["/v1/load_lora_adapter"] == 0 for r in cluster.replicas)  # nowhere
    assert cluster.replicas[1].loaded["policy@v1"] == "/adapters/elsewhere"
    with pytest.raises(PolicyError, match="immutable"):
        await policy.sample(MESSAGES, SamplingParams(n=1), adapter=ref(1))


async def test_retention_unloads_the_oldest_versions_but_never_pinned_ones() -> None:
    cluster = FakeCluster(2)
    policy = cluster.policy(retention=2, pinned={"policy@v1"})
    for version in range(1, 6):
        await policy.ensure_adapter(ref(version))
    for r in cluster.replicas:
        assert sorted(r.loaded) == ["policy@v1", "policy@v4", "policy@v5"]
    with pytest.raises(PolicyError, match="pinned"):
        await policy.retire_adapter(ref(1))
    policy.unpin("policy@v1")
    policy.pin("policy@v4")
    await policy.ensure_adapter(ref(6))
    for r in cluster.replicas:
        assert sorted(r.loaded) == ["policy@v4", "policy@v5", "policy@v6"]


async def test_rolling_back_to_an_old_version_does_not_unload_it_again() -> None:
    cluster = FakeCluster(1)
    policy = cluster.policy(retention=1)
    await policy.ensure_adapter(ref(2))
    await policy.ensure_adapter(ref(1))
    assert sorted(cluster.replicas[0].loaded) == ["policy@v1", "policy@v2"]


async def test_retire_unloads_everywhere_and_ignores_replicas_without_it() -> None:
    cluster = FakeCluster(2)
    policy = cluster.policy()
    await policy.ensure_adapter(ref(1))
    del cluster.replicas[0].loaded["policy@v1"]  # e.g. a restarted replica
    await policy.retire_adapter(ref(1))
    assert all(not r.loaded for r in cluster.replicas)
    with pytest.raises(PolicyError, match="not loaded on any replica"):
        await policy.sample(MESSAGES, SamplingParams(n=1), adapter=ref(1))


async def test_runtime_lora_disabled_names_the_setting_to_fix() -> None:
    cluster = FakeCluster(1)
    cluster.replicas[0].runtime_lora = False
    with pytest.raises(PolicyError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        await cluster.policy().ensure_adapter(ref(1))


async def test_a_503_is_retried_and_then_succeeds() -> None:
    cluster = FakeCluster(1)
    cluster.replicas[0].chat_failures = [503]
    out = await cluster.policy().sample(MESSAGES, SamplingParams(n=2))
    assert len(out) == 2
    assert cluster.chat_calls() == 2


async def test_a_400_fails_at_once_with_the_servers_message() -> None:
    cluster = FakeCluster(2)
    for r in cluster.replicas:
        r.chat_failures = [400]
    with pytest.raises(PolicyError, match="injected failure 400"):
        await cluster.policy().sample(MESSAGES, SamplingParams(n=2))
    assert cluster.chat_calls() == 1


async def test_an_unreachable_replica_is_skipped_and_benched() -> None:
    cluster = FakeCluster(2)
    cluster.replicas[0].chat_failures = ["connect"] * 10
    policy = cluster.policy()
    for _ in range(6):
        out = await policy.sample(MESSAGES, SamplingParams(n=1))
        assert out[0].extra["replica"] == "http://replica1:8000"
    assert cluster.replicas[0].calls["/v1/chat/completions"] <= 2  # then benched


async def test_every_replica_down_raises_policy_error_after_bounded_retries() -> None:
    cluster = FakeCluster(2)
    for r in cluster.replicas:
        r.chat_failures = ["connect"] * 10
    with pytest.raises(PolicyError, match="failed on every replica"):
        await cluster.policy(max_retries=3).sample(MESSAGES, SamplingParams(n=1))
    assert cluster.chat_calls() == 4


async def test_a_replica_that_lost_the_adapter_is_dropped_and_another_serves() -> None:
    cluster = FakeCluster(2)
    policy = cluster.policy()
    await policy.ensure_adapter(ref(1))
    for r in cluster.replicas:
        r.loaded.clear()
    cluster.replicas[1].loaded["policy@v1"] = "/adapters/policy/v1"
    for _ in range(3):
        out = await policy.sample(MESSAGES, SamplingParams(n=1), adapter=ref(1))
        assert out[0].extra["replica"] == "http://replica1:8000"
    assert cluster.replicas[0].calls["/v1/chat/completions"] <= 1


async def test_prefill_continues_the_assistant_turn() -> None:
    cluster = FakeCluster(1)
    policy = cluster.policy()
    params = SamplingParams(n=1, prefill='{"tool": ', seed=7, stop=("\n",), max_tokens=9)
    out = await policy.sample(MESSAGES, params)
    body = next(b for p, b in cluster.replicas[0].bodies if p == "/v1/chat/completions")
    assert body["messages"] == [*MESSAGES, {"role": "assistant", "content": '{"tool": '}]
    assert body["continue_final_message"] is True
    assert body["add_generation_prompt"] is False
    assert (body["n"], body["seed"], body["stop"], body["max_tokens"]) == (1, 7, ["\n"], 9)
    assert body["logprobs"] is True and body["return_tokens_as_token_ids"] is True
    assert body["include_stop_str_in_output"] is True
    assert out[0].text == "abc"  # the prefill is prompt, not completion
    assert out[0].prompt_token_ids == [ord(c) for c in '<user>hi<assistant>{"tool": ']


async def test_token_ids_logprobs_and_finish_reasons_are_parsed() -> None:
    cluster = FakeCluster(1)
    cluster.replicas[0].texts = ["hello", "ab\ncd"]
    out = await cluster.policy().sample(MESSAGES, SamplingParams(n=3, max_tokens=4, stop=("\n",)))
    assert [c.text for c in out] == ["hell", "ab\n", "hell"]
    assert out[0].token_ids == [ord(c) for c in "hell"]
    assert out[0].logprobs == [_logprob(j) for j in range(4)]
    assert [c.finish_reason for c in out] == ["length", "stop", "length"]
    assert out[1].extra["stop_reason"] == "\n"
    assert out[0].prompt_token_ids == [ord(c) for c in "<user>hi<assistant>"]


async def test_prompt_ids_come_from_tokenize_when_the_server_does_not_return_them() -> None:
    cluster = FakeCluster(1)
    cluster.replicas[0].returns_prompt_ids = False
    out = await cluster.policy().sample(MESSAGES, SamplingParams(n=2))
    assert cluster.replicas[0].calls["/tokenize"] == 1
    assert out[1].prompt_token_ids == [ord(c) for c in "<user>hi<assistant>"]


async def test_stop_at_json_end_cuts_text_tokens_and_logprobs() -> None:
    cluster = FakeCluster(1)
    cluster.replicas[0].texts = ['"a}{b\\"", "x": {"y": [1]}} and then chatter', '"s"}']
    params = SamplingParams(n=2, max_tokens=64, prefill='{"tool": ', stop_at_json_end=True)
    cut, whole = await cluster.policy().sample(MESSAGES, params)
    expected = '"a}{b\\"", "x": {"y": [1]}}'
    assert cut.text == expected
    assert cut.token_ids == [ord(c) for c in expected]
    assert cut.logprobs == [_logprob(j) for j in range(len(expected))]
    assert cut.finish_reason == "stop"
    assert cut.extra["cut_at_json_end"] == len(" and then chatter")
    assert whole.text == '"s"}' and "cut_at_json_end" not in whole.extra


def test_json_object_end() -> None:
    assert json_object_end('{"a": 1} tail') == 8
    assert json_object_end('x {"a": "}"} y') == 12
    assert json_object_end('{"a": [{"b": 2}]}') == 17
    assert json_object_end('{"a": "\\"}"}!') == 12
    assert json_object_end('{"a": 1') is None
    assert json_object_end("no json") is None


def test_retry_classifier() -> None:
    request = httpx.Request("POST", "http://replica0:8000/v1/chat/completions")
    assert is_retryable(httpx.Response(503))
    assert is_retryable(httpx.Response(429))
    assert not is_retryable(httpx.Response(400))
    assert not is_retryable(httpx.Response(404))
    assert is_retryable(httpx.ConnectError("refused", request=request))
    assert is_retryable(httpx.ReadTimeout("slow", request=request))
    assert not is_retryable(PolicyError("bad input"))
    assert not is_retryable(ValueError("bug"))


@pytest.mark.gpu
async def test_real_vllm_serves_two_adapter_versions() -> None:
    """Needs a running vLLM (infra/gpu-check.sh sets these up)."""
    url = os.environ.get("FLYWHEEL_TEST_VLLM_URL")
    if not url:
        pytest.skip("set FLYWHEEL_TEST_VLLM_URL (and _MODEL, _ADAPTERS) to a running vLLM")
    model = os.environ["FLYWHEEL_TEST_VLLM_MODEL"]
    paths = os.environ["FLYWHEEL_TEST_VLLM_ADAPTERS"].split(os.pathsep)
    policy = VLLMPolicy(url.split(","), model=model, policy_name="gpucheck")
    try:
        params = SamplingParams(n=8, max_tokens=16, temperature=1.0, seed=1)
        for version, path in enumerate(paths[:2], start=1):
            adapter = AdapterRef("gpucheck", version, Path(path))
            await policy.ensure_adapter(adapter)
            out = await policy.sample(MESSAGES, params, adapter=adapter)
            assert len(out) == 8 and all(c.adapter == adapter.name for c in out)
            assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in out)
            assert all(c.prompt_token_ids for c in out)
            assert all(lp <= 0 for c in out for lp in c.logprobs)
        for version, path in enumerate(paths[:2], start=1):
            await policy.retire_adapter(AdapterRef("gpucheck", version, Path(path)))
    finally:
        await policy.close()
