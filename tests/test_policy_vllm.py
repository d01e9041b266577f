"""VLLMPolicy against a fake vLLM cluster (httpx.MockTransport).

The fake speaks the parts of vLLM's HTTP API Flywheel uses, per replica, with the shapes
and messages a real vLLM 0.32 server answers (tests/test_policy_vllm_server.py checks the client
against one): /v1/models (full cards, `root` = the path as sent), /v1/load_lora_adapter
(plain-text success without a content type; 400 for a name already loaded, 404 for a path
it cannot read, **500** for an adapter its worker refuses), /v1/unload_lora_adapter,
/v1/chat/completions (top-level `prompt_token_ids`, logprob tokens as "token_id:N", `token_ids`
per choice, the EOS token in the tokens but not the text, tools rendered into the prompt even
under `tool_choice: "none"`), /tokenize and /detokenize (special tokens kept), and the
`--max-cpu-loras` cache: an evicted adapter whose directory was deleted kills the engine
(EngineDeadError: HTTP 500 for every request from then on). Its tokenizer is one token per
character (id = ord(c), EOS = 2), so expected ids and cuts are easy to compute by hand; a
replica can instead render with a real chat format (`render`), as a vLLM started with
`--chat-template` does.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from flywheel.policy.base import (
    AdapterNotServed,
    AdapterRef,
    Policy,
    PolicyError,
    SamplingParams,
)
from flywheel.policy.vllm import (
    AdapterLoadError,
    ReplicaUnavailable,
    VLLMError,
    VLLMPolicy,
    api_messages,
    chat_body,
    is_retryable,
    served_versions,
)

MESSAGES = [{"role": "user", "content": "hi"}]
EOS = 2
"""The fake's end-of-turn token id (SmolLM2's `<|im_end|>`): in token_ids, never in content."""


def _logprob(j: int) -> float:
    return -0.25 - j / 100


def _render(messages: list[dict[str, Any]], add_generation_prompt: bool,
            tools: list[dict[str, Any]] | None = None) -> str:
    names = ",".join(t["function"]["name"] for t in tools or [])
    text = (f"<tools>{names}</tools>" if names else "") + "".join(
        f"<{m['role']}>{m['content'] or json.dumps(m.get('tool_calls'))}" for m in messages)
    return text + ("<assistant>" if add_generation_prompt else "")


def _json(status: int, body: Any) -> httpx.Response:
    return httpx.Response(status, json=body)


EOS_ID, EOS_TEXT = 2, "<|im_end|>"
_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def _error(status: int, message: str, kind: str | None = None,
           param: str | None = None) -> httpx.Response:
    return _json(status, {"error": {"message": message, "type": kind or _TYPES.get(
        status, "Error"), "param": param, "code": status}})


def _worker_failed(why: str) -> httpx.Response:
    return _error(500, f"Call to add_lora method failed: Worker failed with error '{why}', "
                  "please check the stack trace above for the root cause")


def _card(name: str, root: str, parent: str | None) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 1796120817, "owned_by": "vllm",
            "root": root, "parent": parent, "max_model_len": None if parent else 2048,
            "permission": [{"id": "modelperm-1", "object": "model_permission",
                            "allow_sampling": True, "allow_logprobs": True}]}


@dataclass
class Disk:
    """The adapter volume as the replicas see it: every path exists unless deleted."""

    missing: set[str] = field(default_factory=set)
    ranks: dict[str, int] = field(default_factory=dict)
    corrupt: set[str] = field(default_factory=set)


@dataclass
class FakeReplica:
    url: str
    disk: Disk = field(default_factory=Disk)
    base_model: str = "base"
    loaded: dict[str, str] = field(default_factory=dict)
    lora_enabled: bool = True
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    """None: every loaded adapter stays in memory."""
    dead: bool = False
    """EngineDeadError: the engine is gone, every request answers 500."""
    unreachable: bool = False
    """Nothing listens: every request is refused."""
    _cpu: list[str] = field(default_factory=list)
    lag_once: bool = False
    """The first /v1/models after a load does not list the new adapter yet."""
    never_list: bool = False
    runtime_lora: bool = True
    returns_prompt_ids: bool = True
    chat_failures: list[int | str] = field(default_factory=list)
    """Queue of failures to answer chat requests with: an HTTP status or "connect"."""
    texts: list[str] = field(default_factory=lambda: ["abc"])
    render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]] | None = None
    """The server's chat template (prompt ids from messages and tools); None = `_render`."""
    calls: Counter[str] = field(default_factory=Counter)
    bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    _hidden: set[str] = field(default_factory=set)

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls[path] += 1
        body = json.loads(request.content) if request.content else {}
        self.bodies.append((path, body))
        if self.unreachable:
            raise httpx.ConnectError("connection refused", request=request)
        if self.dead:
            if path == "/health":
                return httpx.Response(503)
            return _error(500, "EngineCore encountered an issue. See stack trace (above) for "
                          "the root cause.")
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            visible = {n: p for n, p in self.loaded.items()
                       if not self.never_list and n not in self._hidden}
            self._hidden.clear()
            cards = [_card(self.base_model, "/models/SmolLM2-135M-Instruct", None)]
            cards += [_card(n, p, self.base_model) for n, p in visible.items()]
            return _json(200, {"object": "list", "data": cards})
        if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and not self.runtime_lora:
            return _json(404, {"detail": "Not Found"})
        if path == "/v1/load_lora_adapter":
            return self._load(body["lora_name"], body["lora_path"])
        if path == "/v1/unload_lora_adapter":
            name = body["lora_name"]
            if self.loaded.pop(name, None) is None:
                return _error(404, f"The lora adapter '{name}' cannot be found.")
            if name in self._cpu:
                self._cpu.remove(name)
            # vLLM answers plain text without a content type.
            return httpx.Response(200, content=f"Success: LoRA adapter '{name}' removed "
                                  "successfully.".encode())
        if path == "/tokenize":
            ids = self._prompt_ids(body)
            return _json(200, {"count": len(ids), "max_model_len": 4096, "tokens": ids,
                               "token_strs": None})
        if path == "/detokenize":  # special tokens are kept
            return _json(200, {"prompt": "".join(EOS_TEXT if t == EOS_ID else chr(t)
                                                 for t in body["tokens"])})
        if path == "/v1/chat/completions":
            return self._chat(request, body)
        return _json(404, {"detail": "Not Found"})

    def _load(self, name: str, path: str) -> httpx.Response:
        if name in self.loaded:  # whatever the path: only the client's root check sees that
            return _error(400, f"The lora adapter '{name}' has already been loaded. If you "
                          "want to load the adapter in place, set 'load_inplace' to True.",
                          "InvalidUserInput")
        if path in self.disk.missing:
            return _error(404, f"Loading lora {name} failed: No adapter found for {path}")
        if not self.lora_enabled:
            return _worker_failed("LoRA is not enabled. Use --enable-lora to enable LoRA.")
        rank = self.disk.ranks.get(path, 16)
        if rank > self.max_lora_rank:
            return _worker_failed(f"LoRA rank {rank} is greater than max_lora_rank "
                                  f"{self.max_lora_rank}.")
        if path in self.disk.corrupt:
            return _worker_failed("Error while deserializing header: incomplete metadata, "
                                  "file not fully covered")
        self.loaded[name] = path
        self._use(name)
        if self.lag_once:
            self._hidden.add(name)
            self.lag_once = False
        return httpx.Response(200, content=f"Success: LoRA adapter '{name}' added "
                              "successfully.".encode())

    def _use(self, name: str) -> bool:
        """Bring an adapter into the CPU cache (LRU); False when its files are gone."""
        if name in self._cpu:
            self._cpu.remove(name)
        elif self.loaded[name] in self.disk.missing:
            self.dead = True  # FileNotFoundError in the worker → EngineDeadError
            return False
        self._cpu.append(name)
        if self.max_cpu_loras is not None:
            del self._cpu[:-self.max_cpu_loras]
        return True

    def _chat(self, request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if self.chat_failures:
            failure = self.chat_failures.pop(0)
            if failure == "connect":
                raise httpx.ConnectError("connection refused", request=request)
            if failure == "timeout":  # a replica too loaded to answer within timeout_s
                raise httpx.ReadTimeout("", request=request)
            return _error(int(failure), f"injected failure {failure}")
        model = body["model"]
        if model != self.base_model and model not in self.loaded:
            return _error(404, f"The model `{model}` does not exist. Valid aliases: "
                          f"{self.base_model}.", param="model")
        if model != self.base_model and not self._use(model):
            return _error(500, "EngineCore encountered an issue. See stack trace (above) for "
                          "the root cause.")
        choices = []
        for i in range(body["n"]):
            text, finish, stop_reason = self.texts[i % len(self.texts)], "stop", None
            ids = [ord(c) for c in text] + [EOS_ID]  # the model ends its turn
            for stop in body.get("stop", []):
                if stop in text:
                    text, stop_reason = text[:text.index(stop) + len(stop)], stop
                    ids = [ord(c) for c in text]
            if len(ids) > body["max_tokens"]:
                ids, finish = ids[:body["max_tokens"]], "length"
            text = "".join(chr(t) for t in ids if t != EOS_ID)
            content = [{"token": f"token_id:{t}", "logprob": _logprob(j),
                        "bytes": list((EOS_TEXT if t == EOS_ID else chr(t)).encode()),
                        "top_logprobs": []} for j, t in enumerate(ids)]
            message = {"role": "assistant", "content": text, "refusal": None,
                       "annotations": None, "audio": None, "function_call": None,
                       "reasoning": None}  # tool_choice "none": no tool_calls key
            choices.append({"index": i, "message": message, "logprobs": {"content": content},
                            "finish_reason": finish, "stop_reason": stop_reason,
                            "token_ids": ids})
        data: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion",
                                "model": model, "choices": choices,
                                "system_fingerprint": "vllm-0.32.0-fake"}
        if self.returns_prompt_ids:
            data["prompt_token_ids"] = self._prompt_ids(body)
        return _json(200, data)

    def _prompt_ids(self, body: dict[str, Any]) -> list[int]:
        if self.render is not None:
            return self.render(body["messages"], body.get("tools"))
        return [ord(c) for c in _render(body["messages"], body.get("add_generation_prompt", True),
                                        body.get("tools"))]


class FakeCluster:
    def __init__(self, n: int) -> None:
        self.disk = Disk()
        self.replicas = [FakeReplica(f"http://replica{i}:8000", self.disk) for i in range(n)]
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


async def test_production_pinned_from_the_database_survives_retention_in_another_process(
        tmp_path: Path) -> None:
    """Every service's engine shares the replicas: a rollout worker placing its newest
    versions must not unload what the serving endpoint answers with."""
    from flywheel.config import Settings
    from flywheel.serving.completions import sample_placed
    from flywheel.serving.sync import ServingSync, Target

    cluster = FakeCluster(2)
    serving_engine, worker = cluster.policy(retention=3), cluster.policy(retention=1)
    serving_engine.pin_production("policy@v1")
    await serving_engine.ensure_adapter(ref(1))
    for version in (2, 3):  # a worker that never heard of production
        await worker.ensure_adapter(ref(version))
    assert all("policy@v1" not in r.loaded for r in cluster.replicas)
    with pytest.raises(AdapterNotServed):
        await serving_engine.sample(MESSAGES, SamplingParams(n=1), adapter=ref(1))

    # The endpoint places it again and answers rather than failing the request.
    settings = Settings(trainer={"adapters_dir": str(tmp_path)})  # type: ignore[arg-type]
    serving = ServingSync(settings, engine=None, policy=serving_engine)  # type: ignore[arg-type]
    out = await sample_placed(serving, Target(1, ref(1)), MESSAGES, SamplingParams(n=2), None)
    assert [c.adapter for c in out] == ["policy@v1"] * 2
    assert all("policy@v1" in r.loaded for r in cluster.replicas)

    # A worker that pins production (AdapterResolver.protect_production) keeps it.
    worker.pin_production("policy@v1")
    for version in (4, 5):
        await worker.ensure_adapter(ref(version))
    assert all(sorted(r.loaded) == ["policy@v1", "policy@v5"] for r in cluster.replicas)
    worker.pin_production("policy@v5")  # promoted: v1 is an ordinary old version again
    await worker.ensure_adapter(ref(6))
    assert all(sorted(r.loaded) == ["policy@v5", "policy@v6"] for r in cluster.replicas)


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
    with pytest.raises(PolicyError, match="was retired"):
        await policy.sample(MESSAGES, SamplingParams(n=1), adapter=ref(1))
    assert all(r.calls["/v1/load_lora_adapter"] == 1 for r in cluster.replicas)  # no reload


async def test_runtime_lora_disabled_names_the_setting_to_fix() -> None:
    cluster = FakeCluster(1)
    cluster.replicas[0].runtime_lora = False
    with pytest.raises(PolicyError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        await cluster.policy().ensure_adapter(ref(1))


@pytest.mark.parametrize(("setup", "fix"), [
    (lambda c: c.disk.ranks.update({"/adapters/policy/v1": 32}),
     r"rank 32 but the server serves at most 16: start vLLM with --max-lora-rank ≥ 32"),
    (lambda c: c.disk.corrupt.add("/adapters/policy/v1"),
     r"incomplete metadata.*publish the weights again as a new version"),
    (lambda c: [setattr(r, "lora_enabled", False) for r in c.replicas],
     r"start vLLM with --enable-lora"),
    (lambda c: c.disk.missing.add("/adapters/policy/v1"),
     r"No adapter found.*mount the adapter volume at the same path"),
])
async def test_an_adapter_the_server_refuses_fails_at_once_with_the_fix(setup: Any,
                                                                       fix: str) -> None:
    """vLLM answers 500 for a refused adapter; it must not be retried nor bench the replica."""
    cluster = FakeCluster(2)
    setup(cluster)
    policy = cluster.policy()
    with pytest.raises(AdapterLoadError, match=fix) as caught:
        await policy.ensure_adapter(ref(1))
    assert "policy@v1" in str(caught.value)
    for r in cluster.replicas:
        assert r.calls["/v1/load_lora_adapter"] == 1  # no retry
    assert all(r.failures == 0 and r.down_until == 0 for r in policy._replicas)
    for _ in range(4):  # both replicas still serve the base model
        await policy.sample(MESSAGES, SamplingParams(n=1))
    assert all(r.calls["/v1/chat/completions"] == 2 for r in cluster.replicas)


async def test_an_evicted_adapter_whose_directory_was_deleted_kills_that_replica() -> None:
    cluster = FakeCluster(2)
    cluster.replicas[0].max_cpu_loras = 1
    policy = cluster.policy(cooldown_s=60)
    await policy.ensure_adapter(ref(1))
    await policy.ensure_adapter(ref(2))  # v1 falls out of replica0's CPU cache
    cluster.disk.missing.add("/adapters/policy/v1")  # what retention must never do
    for _ in range(3):
        out = await policy.sample(MESSAGES, SamplingParams(n=1), adapter=ref(1))
        assert out[0].extra["replica"] == "http://replica1:8000"
    assert cluster.replicas[0].dead
    assert cluster.replicas[0].calls["/v1/chat/completions"] == 1  # benched at once
    cluster.replicas[1].dead = True
    with pytest.raises(VLLMError, match=r"engine is dead.*restarted") as caught:
        await policy.sample(MESSAGES, SamplingParams(n=1))
    assert caught.value.kind == "dead"


async def test_a_version_name_never_comes_back_with_other_weights() -> None:
    cluster = FakeCluster(2)
    policy = cluster.policy()
    await policy.ensure_adapter(ref(1))
    await policy.retire_adapter(ref(1))
    with pytest.raises(PolicyError, match=r"placed from /adapters/policy/v1 before.*immutable"):
        await policy.ensure_adapter(ref(1, "/adapters/policy/v1-retrained"))
    assert all("policy@v1" not in r.loaded for r in cluster.replicas)
    await policy.ensure_adapter(ref(1))  # the same immutable files may be placed again
    assert all(r.loaded == {"policy@v1": "/adapters/policy/v1"} for r in cluster.replicas)


async def test_a_replica_that_is_down_does_not_stop_a_new_version_on_the_others() -> None:
    cluster = FakeCluster(3)
    cluster.replicas[2].unreachable = True
    policy = cluster.policy()
    await policy.ensure_adapter(ref(1))
    assert [sorted(r.loaded) for r in cluster.replicas] == [["policy@v1"], ["policy@v1"], []]
    for _ in range(4):
        (c,) = await policy.sample(MESSAGES, SamplingParams(n=1), adapter=ref(1))
        assert c.extra["replica"] != "http://replica2:8000"
    calls = cluster.replicas[2].calls["/v1/models"]
    await policy.ensure_adapter(ref(2))  # benched: one attempt, not max_retries
    assert cluster.replicas[2].calls["/v1/models"] == calls + 1
    cluster.replicas[2].unreachable = False  # back (restarted, empty)
    await policy.ensure_adapter(ref(2))
    assert sorted(cluster.replicas[2].loaded) == ["policy@v2"]


async def test_with_every_replica_down_placement_fails_typed() -> None:
    cluster = FakeCluster(2)
    for r in cluster.replicas:
        r.unreachable = True
    with pytest.raises(ReplicaUnavailable, match=r"no replica is available.*replica0.*replica1"):
        await cluster.policy(max_retries=1).ensure_adapter(ref(1))


async def test_the_eos_token_is_in_the_tokens_not_in_the_text() -> None:
    cluster = FakeCluster(1)
    (c,) = await cluster.policy().sample(MESSAGES, SamplingParams(n=1))
    assert c.text == "abc" and c.finish_reason == "stop"
    assert c.token_ids == [*map(ord, "abc"), EOS_ID]
    assert len(c.logprobs) == 4


async def test_served_versions_lists_every_replica_and_refuses_to_guess() -> None:
    cluster = FakeCluster(2)
    policy = cluster.policy()
    await policy.ensure_adapter(ref(3))
    cluster.replicas[1].loaded["policy@v1"] = "/adapters/policy/v1"
    cluster.replicas[1].loaded["other@v7"] = "/adapters/other/v7"
    urls = [r.url for r in cluster.replicas]
    assert await served_versions(urls, "policy", transport=cluster.transport) == {1, 3}

    def down(request: httpx.Request) -> httpx.Response:
        if request.url.host == "replica0":
            raise httpx.ConnectError("connection refused", request=request)
        return cluster.transport.handler(request)  # type: ignore[attr-defined,no-any-return]

    with pytest.raises(PolicyError, match=r"replica0.*unreachable"):
        await served_versions(urls, "policy", transport=httpx.MockTransport(down))


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


async def test_after_trying_every_replica_a_slow_one_comes_before_a_benched_one() -> None:
    # Seen on a real CPU replica: the survivor of a killed replica timed out once under the
    # load it inherited; the retries then alternated with the dead one (min in-flight, round
    # robin) and gave up on connection refusals while the survivor would have answered.
    cluster = FakeCluster(2)
    slow, dead = cluster.replicas
    dead.chat_failures = ["connect"] * 20
    policy = cluster.policy(max_retries=4)
    for _ in range(2):  # two refusals in a row bench the dead one
        await policy.sample(MESSAGES, SamplingParams(n=1))
    assert policy._replicas[1].down_until > time.monotonic()
    slow.chat_failures = ["timeout"]
    out = await policy.sample(MESSAGES, SamplingParams(n=1))
    assert out[0].extra["replica"] == slow.url
    # the timeout, one try on the benched replica (untried), then the slow one again
    assert slow.calls["/v1/chat/completions"] == 4 and dead.calls["/v1/chat/completions"] <= 3


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


WEATHER = {"type": "function", "name": "get_weather", "x-unsafe": False,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_0_0", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
           {"role": "tool", "tool_call_id": "call_0_0", "content": {"temp_c": 3}},
           {"role": "assistant", "content": "x", "parse_error": "ours, not the API's"}]


async def test_the_request_carries_the_tools_and_asks_for_the_raw_text() -> None:
    cluster = FakeCluster(1)
    policy = cluster.policy()
    params = SamplingParams(n=2, seed=7, stop=("\n",), max_tokens=9, temperature=0.7)
    out = await policy.sample(HISTORY, params, tools=[WEATHER])
    body = next(b for p, b in cluster.replicas[0].bodies if p == "/v1/chat/completions")
    # OpenAI's shape: nested tools without Flywheel's keys; tools rendered, vLLM's own tool
    # parser kept out (the reply is parsed by the policy's chat format).
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["parameters"]}}]
    assert body["tool_choice"] == "none"
    assert body["messages"] == api_messages(HISTORY)
    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert body["messages"][2]["content"] == '{"temp_c": 3}'
    assert "parse_error" not in body["messages"][3]
    assert "continue_final_message" not in body and "add_generation_prompt" not in body
    assert (body["n"], body["seed"], body["stop"], body["max_tokens"]) == (2, 7, ["\n"], 9)
    assert body["temperature"] == 0.7 and body["top_p"] == 1.0
    assert body["logprobs"] is True and body["return_tokens_as_token_ids"] is True
    assert body["include_stop_str_in_output"] is True
    assert out[0].text == "abc"
    # The prompt ids are what vLLM rendered (with the tools), never re-tokenized here.
    assert out[0].prompt_token_ids == [ord(c) for c in _render(
        body["messages"], True, body["tools"])]
    assert out[0].prompt_token_ids[:7] == [ord(c) for c in "<tools>"]


async def test_without_tools_the_request_names_none() -> None:
    cluster = FakeCluster(1)
    await cluster.policy().sample(MESSAGES, SamplingParams(n=1), tools=[])
    body = next(b for p, b in cluster.replicas[0].bodies if p == "/v1/chat/completions")
    assert "tools" not in body and "tool_choice" not in body


async def test_token_ids_logprobs_and_finish_reasons_are_parsed() -> None:
    cluster = FakeCluster(1)
    cluster.replicas[0].texts = ["hello", "ab\ncd", "hi"]
    out = await cluster.policy().sample(MESSAGES, SamplingParams(n=3, max_tokens=4, stop=("\n",)))
    assert [c.text for c in out] == ["hell", "ab\n", "hi"]
    assert out[0].token_ids == [ord(c) for c in "hell"]
    assert out[0].logprobs == [_logprob(j) for j in range(4)]
    assert out[2].token_ids == [ord("h"), ord("i"), EOS]  # the trainer learns to stop
    assert len(out[2].logprobs) == 3
    assert [c.finish_reason for c in out] == ["length", "stop", "stop"]
    assert out[1].extra["stop_reason"] == "\n"
    assert out[0].prompt_token_ids == [ord(c) for c in "<user>hi<assistant>"]


async def test_prompt_ids_come_from_tokenize_when_the_server_does_not_return_them() -> None:
    cluster = FakeCluster(1)
    cluster.replicas[0].returns_prompt_ids = False
    out = await cluster.policy().sample(MESSAGES, SamplingParams(n=2), tools=[WEATHER])
    assert cluster.replicas[0].calls["/tokenize"] == 1
    tokenize = next(b for p, b in cluster.replicas[0].bodies if p == "/tokenize")
    assert tokenize["tools"][0]["function"]["name"] == "get_weather"
    assert out[1].prompt_token_ids == [ord(c) for c in "<tools>get_weather</tools><user>hi"
                                                        "<assistant>"]


async def test_without_a_chat_format_there_is_nothing_to_parse_with() -> None:
    policy = FakeCluster(1).policy()
    with pytest.raises(PolicyError, match="no chat format"):
        _ = policy.chat_format
    assert not isinstance(policy, Policy)


@pytest.fixture(scope="module")
def fmt() -> Any:
    from flywheel.policy.chat_format import load_chat_format
    from flywheel.policy.model_cache import resolve_model_dir

    pytest.importorskip("transformers")
    return load_chat_format(resolve_model_dir(None))


async def test_a_replica_rendering_like_the_policy_is_checked_once_and_parsed_alike(
        fmt: Any) -> None:
    """A replica started with the policy's --chat-template renders exactly `render`: its
    prompt ids pass the check (once), and its text parses like the local engine's."""
    cluster = FakeCluster(2)
    loads: list[int] = []

    def load() -> Any:
        loads.append(1)
        return fmt

    for r in cluster.replicas:
        r.render = fmt.render
        r.texts = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                   "</tool_call>"]
    policy = cluster.policy(chat_format=load)
    for _ in range(3):
        (c,) = await policy.sample(HISTORY[:1], SamplingParams(n=1, max_tokens=128),
                                   tools=[WEATHER])
        assert c.prompt_token_ids == fmt.render(HISTORY[:1], [WEATHER])
        assert policy.chat_format.parse(c.text)["tool_calls"][0]["function"] == {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    await policy.sample(HISTORY, SamplingParams(n=1), tools=[WEATHER])
    assert loads == [1]  # the tokenizer is loaded once, lazily
    assert len(policy._rendering_checked) == 2  # every replica, once each


def test_with_a_chat_format_it_is_a_policy(fmt: Any) -> None:
    assert isinstance(FakeCluster(1).policy(chat_format=fmt), Policy)


async def test_a_replica_started_without_the_policys_template_is_refused(fmt: Any) -> None:
    """vLLM without --chat-template renders SmolLM2's stock template, which drops the tools:
    training on those prompts would teach another format than SFT and serving use."""
    cluster = FakeCluster(1)
    stock = fmt.tokenizer.chat_template

    def stock_render(messages: list[dict[str, Any]], tools: Any) -> list[int]:
        text = fmt.tokenizer.apply_chat_template(messages, tools=tools, chat_template=stock,
                                                 add_generation_prompt=True, tokenize=False)
        return fmt.encode(text)

    cluster.replicas[0].render = stock_render
    policy = cluster.policy(chat_format=fmt)
    with pytest.raises(PolicyError, match=r"--chat-template .*tool_chatml\.v1\.jinja"):
        await policy.sample(MESSAGES, SamplingParams(n=1), tools=[WEATHER])


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


async def test_a_models_own_template_rendered_otherwise_is_only_warned_about(
        fmt: Any, caplog: pytest.LogCaptureFixture) -> None:
    """With the model's own template (no file of ours), vLLM's own serialisation of tool
    dicts may differ from ours; rollouts keep vLLM's ids, so that is a warning, not a stop."""
    from flywheel.policy.chat_format import ChatFormat

    own = ChatFormat(fmt.tokenizer, name="model", chat_template=fmt.template,
                     response_template=fmt.response_template)
    assert own.path is None
    cluster = FakeCluster(1)  # renders with `_render`: not what `own` renders
    with caplog.at_level("WARNING", logger="flywheel.policy.vllm"):
        (c,) = await cluster.policy(chat_format=own).sample(MESSAGES, SamplingParams(n=1),
                                                            tools=[WEATHER])
    assert c.prompt_token_ids[:7] == [ord(ch) for ch in "<tools>"]
    assert "renders prompts differently" in caplog.text


def test_a_grammar_goes_as_vllms_structured_output() -> None:
    """`tool_choice` required/named: the continuation of the prefill under the call grammar."""
    body = chat_body(MESSAGES, SamplingParams(n=1, prefill="<tool_call>", grammar="start: x"),
                     "m", [{"type": "function", "function": {"name": "f"}}])
    assert body["structured_outputs"] == {"grammar": "start: x"}
    assert body["messages"][-1] == {"role": "assistant", "content": "<tool_call>"}
    assert body["tool_choice"] == "none"  # vLLM's own tool parsing stays out of it
    assert "structured_outputs" not in chat_body(MESSAGES, SamplingParams(n=1), "m")
