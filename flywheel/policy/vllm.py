"""The GPU policy engine: N vLLM replicas driven only through their public HTTP API.

`VLLMPolicy` is the replicas and sampling: each call goes to one replica with retries and
backoff, a replica that fails twice in a row or whose engine is dead is benched for a
cooldown, and errors are typed by what retrying can do (`vllm_errors`). Which adapter
version is loaded where, and for how long (placement, pins, retention), is
`vllm_placement.AdapterPlacement`, which the engine holds and hands its per-replica call.

`sample` sends one chat completion with `n = G` to the least-loaded healthy replica that
serves the adapter and returns token ids and sampling log-probs exactly as vLLM sampled them
(the server must run with `--logprobs-mode processed_logprobs`: see infra/vllm.md), the EOS
token included when the model ended its turn (in the tokens, not the text). Sampling never
loads an adapter by itself.

The request carries the task's `tools`, so vLLM renders the prompt with them through its chat
template — which must be the policy's (`--chat-template $(flywheel policy chat-template)`) —
and `prompt_token_ids` are what vLLM rendered. `tool_choice: "none"` makes vLLM return the raw
text (the tools are still rendered into the prompt): the reply is parsed here by the policy's
`chat_format`, exactly as the local engine's is. The first answer of each replica is checked
against `chat_format.render`: a replica started with another template is refused. Serving's
`tool_choice` "required" or a named function sends its call grammar
(`SamplingParams.grammar`, `flywheel.policy.call_grammar`) as vLLM's structured output
`{"grammar": ...}`: its `auto` backend hands a grammar xgrammar cannot read (llguidance's
Lark with inline `%json`) to its `guidance` backend, the library the local engine masks with.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from flywheel.policy.base import (
    AdapterNotServed,
    AdapterRef,
    Completion,
    PolicyError,
    SamplingParams,
)
from flywheel.policy.chat_format import ChatFormat, api_messages, openai_tools
from flywheel.policy.vllm_errors import (
    AdapterLoadError,
    ReplicaUnavailable,
    VLLMError,
    classify,
    error_message,
    is_retryable,
)
from flywheel.policy.vllm_placement import AdapterPlacement, served_versions

__all__ = ["AdapterLoadError", "NoChatFormat", "ReplicaUnavailable", "VLLMError", "VLLMPolicy",
           "is_retryable", "served_versions"]
log = logging.getLogger(__name__)
_TOKEN_ID = "token_id:"


class NoChatFormat(PolicyError, AttributeError):
    """Built without a chat format (an AttributeError too: such an engine is no `Policy`)."""


class _AdapterGone(PolicyError):
    """A replica no longer serves an adapter it had (restart, eviction): try another one."""


def _sampling_retryable(exc: BaseException) -> bool:
    return isinstance(exc, _AdapterGone) or is_retryable(exc)


def _replica_retryable(exc: BaseException) -> bool:
    """Retrying the same replica: pointless once its engine is dead."""
    return is_retryable(exc) and not (isinstance(exc, VLLMError) and exc.kind == "dead")


@dataclass(eq=False)
class _Replica:
    url: str
    in_flight: int = 0
    failures: int = 0
    down_until: float = 0.0
    adapters: dict[str, str] = field(default_factory=dict)
    """Adapter names verified in this replica's /v1/models, with their paths (kept by the
    placement; sampling routes only here)."""


class VLLMPolicy:
    """A `Policy` over vLLM replicas; one instance manages the versions of one policy."""

    def __init__(self, base_urls: Sequence[str], *, model: str, policy_name: str = "policy",
                 timeout_s: float = 300, max_retries: int = 4, retention: int = 3,
                 pinned: set[str] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, api_key: str | None = None,
                 backoff_s: float = 0.5, cooldown_s: float = 30.0, verify_attempts: int = 5,
                 verify_delay_s: float = 0.5,
                 chat_format: ChatFormat | Callable[[], ChatFormat] | None = None) -> None:
        if not base_urls:
            raise ValueError("VLLMPolicy needs at least one replica URL")
        self.model, self.policy_name = model, policy_name
        self._replicas = [_Replica(url.rstrip("/")) for url in base_urls]
        self.placement = AdapterPlacement(
            self._replicas, self._call_retrying, policy_name=policy_name, retention=retention,
            pinned=pinned, verify_attempts=verify_attempts, verify_delay_s=verify_delay_s)
        self._max_retries, self._backoff_s, self._cooldown_s = max_retries, backoff_s, cooldown_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(transport=transport, timeout=timeout_s, headers=headers)
        self._rr = 0
        self._format = chat_format
        self._format_lock = threading.Lock()
        self._rendering_checked: set[str] = set()
        """Replicas whose prompt ids were seen to equal `chat_format.render`."""

    @property
    def chat_format(self) -> ChatFormat:
        """The policy's format; loaded (the tokenizer of `rollout.model_dir`) on first use."""
        if self._format is None:
            raise NoChatFormat("this VLLMPolicy has no chat format to parse replies with; pass "
                               "chat_format= (make_policy does, from rollout.model_dir)")
        with self._format_lock:
            if not isinstance(self._format, ChatFormat):
                self._format = self._format()
            return self._format

    # -- adapters: the placement's ------------------------------------------------------------
    @property
    def pinned(self) -> frozenset[str]:
        return self.placement.pinned

    def pin(self, name: str) -> None:
        """Never unload `name` (production and baseline versions)."""
        self.placement.pin(name)

    def unpin(self, name: str) -> None:
        self.placement.unpin(name)

    def pin_production(self, name: str | None) -> None:
        """Pin what production serves now (None: the base model); see
        `AdapterPlacement.pin_production`."""
        self.placement.pin_production(name)

    def replicas_serving(self, name: str) -> list[str]:
        """The replicas `name` was placed and verified on (where sampling may go)."""
        return self.placement.replicas_serving(name)

    async def ensure_adapter(self, adapter: AdapterRef) -> None:
        """Load and verify `adapter` on every reachable replica, then apply retention."""
        await self.placement.ensure(adapter)

    async def retire_adapter(self, adapter: AdapterRef) -> None:
        await self.placement.retire(adapter)

    # -- sampling ------------------------------------------------------------------------------
    async def sample(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams, *,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     adapter: AdapterRef | None = None) -> list[Completion]:
        if params.n < 1:
            raise PolicyError(f"SamplingParams.n must be >= 1, got {params.n}")
        model = adapter.name if adapter else self.model
        candidates = await self.placement.serving(adapter) if adapter else self._replicas
        body = chat_body(messages, params, model, tools)
        started = time.monotonic()
        data, r = await self._post_chat(body, candidates, adapter)
        latency_ms = (time.monotonic() - started) * 1000
        prompt_ids = data.get("prompt_token_ids")  # vLLM >= 0.10.2 with return_token_ids
        if prompt_ids is None:
            tok = await self._call_retrying(r, "POST", "/tokenize", {
                k: body[k] for k in ("model", "messages", "tools", "add_generation_prompt",
                                     "continue_final_message") if k in body})
            prompt_ids = tok["tokens"]
        await self._check_rendering(r, messages, tools, list(prompt_ids), params.prefill)
        return [_completion(c, list(prompt_ids), adapter.name if adapter else None, latency_ms,
                            r.url) for c in sorted(data["choices"], key=lambda c: c["index"])]

    async def _check_rendering(self, r: _Replica, messages: Sequence[Mapping[str, Any]],
                               tools: Sequence[Mapping[str, Any]] | None,
                               prompt_ids: list[int], prefill: str = "") -> None:
        """Once per replica: vLLM rendered the prompt exactly as the policy's format does
        (else SFT demonstrations would be trained under another prompt than rollouts)."""
        if r.url in self._rendering_checked or self._format is None:
            return
        # A thread: the first call loads the tokenizer.
        fmt = self.chat_format
        mine = await asyncio.to_thread(
            lambda: fmt.encode(fmt.render_text(messages, tools) + prefill))
        if mine != prompt_ids:
            at = next((i for i, (a, b) in enumerate(zip(mine, prompt_ids, strict=False))
                       if a != b), min(len(mine), len(prompt_ids)))
            what = (f"{r.url} renders prompts differently from the policy's chat format "
                    f"{fmt.version} (first difference at token {at} of {len(prompt_ids)})")
            if fmt.path is not None:  # our template normalises tools: a wrong --chat-template
                raise PolicyError(f"{what}: start vLLM with --chat-template {fmt.path} "
                                  "(`flywheel policy chat-template` prints it)")
            # The model's own template: vLLM serialises tool dicts its own way (nulls,
            # extra keys), which a template dumping them whole shows; SFT sees the difference.
            log.warning("%s; rollouts keep vLLM's prompt ids, SFT demonstrations are "
                        "rendered locally", what)
        self._rendering_checked.add(r.url)

    async def _post_chat(self, body: dict[str, Any], candidates: list[_Replica],
                         adapter: AdapterRef | None) -> tuple[dict[str, Any], _Replica]:
        tried: set[_Replica] = set()
        try:
            async for attempt in self._retrying(_sampling_retryable):
                with attempt:
                    pool = [r for r in candidates if adapter is None or adapter.name in r.adapters]
                    if not pool:
                        raise AdapterNotServed(f"no replica serves {body['model']} any more; "
                                               "call ensure_adapter again")
                    r = self._pick(pool, avoid=tried)
                    tried.add(r)
                    try:
                        return await self._call(r, "POST", "/v1/chat/completions", body), r
                    except VLLMError as e:
                        if adapter is not None and e.status == 404:
                            r.adapters.pop(adapter.name, None)
                            raise _AdapterGone(f"{r.url} lost {adapter.name}: {e.message}") from e
                        raise
        except _AdapterGone as e:
            raise AdapterNotServed(f"sampling {body['model']} failed on every replica tried "
                                   f"({len(tried)}): {e!r}") from e
        except httpx.TransportError as e:
            raise PolicyError(f"sampling {body['model']} failed on every replica tried "
                              f"({len(tried)}): {e!r}") from e
        raise AssertionError("unreachable: tenacity re-raises the last error")

    # -- transport -----------------------------------------------------------------------------
    def _retrying(self, retryable: Any = _replica_retryable,
                  attempts: int | None = None) -> AsyncRetrying:
        return AsyncRetrying(
            retry=retry_if_exception(retryable),
            stop=stop_after_attempt(attempts or self._max_retries + 1),
            # exponential backoff with jitter, spelled portably across tenacity 8 and 9
            wait=wait_exponential(multiplier=self._backoff_s, max=self._backoff_s * 16)
            + wait_random(0, self._backoff_s),
            reraise=True)

    def _pick(self, pool: list[_Replica], avoid: set[_Replica]) -> _Replica:
        """Least-loaded healthy replica, round-robin among equals; avoids ones that just failed.
        Once every replica was tried, one not benched comes before a benched one (a replica
        that was slow once is a better bet than one refusing connections)."""
        now = time.monotonic()
        up = [r for r in pool if r.down_until <= now]
        choices = ([r for r in up if r not in avoid] or [r for r in pool if r not in avoid]
                   or up or pool)
        self._rr += 1
        start = self._rr % len(choices)
        return min(choices[start:] + choices[:start], key=lambda r: r.in_flight)

    async def _call_retrying(self, r: _Replica, method: str, path: str,
                             body: dict[str, Any] | None = None) -> Any:
        """One replica, with retries: fan-out operations must reach this replica, not another.
        A benched replica gets one attempt: it is down until it proves otherwise."""
        attempts = 1 if r.down_until > time.monotonic() else None
        try:
            async for attempt in self._retrying(attempts=attempts):
                with attempt:
                    return await self._call(r, method, path, body)
        except httpx.TransportError as e:
            raise ReplicaUnavailable(f"replica {r.url} unreachable for {method} {path}: {e!r}"
                                     ) from e
        raise AssertionError("unreachable: tenacity re-raises the last error")

    async def _call(self, r: _Replica, method: str, path: str,
                    body: dict[str, Any] | None = None) -> Any:
        """One attempt; keeps the replica's load and health counters."""
        r.in_flight += 1
        try:
            resp = await self._client.request(method, r.url + path, json=body)
        except httpx.TransportError:
            self._mark_failure(r)
            raise
        finally:
            r.in_flight -= 1
        if resp.status_code >= 400:
            message = error_message(resp)
            kind = classify(path, resp.status_code, message)
            if kind == "dead":
                r.down_until = time.monotonic() + self._cooldown_s
                log.error("%s: vLLM engine is dead (%s); benched until restarted", r.url,
                          message)
            elif kind == "transient":
                self._mark_failure(r)
            raise VLLMError(r.url, resp.status_code, message, kind)
        r.failures = 0
        try:
            return resp.json()
        except ValueError:
            return resp.text  # load/unload answer plain text

    def _mark_failure(self, r: _Replica) -> None:
        r.failures += 1
        if r.failures >= 2:  # one blip is noise; a second in a row benches the replica
            r.down_until = time.monotonic() + self._cooldown_s

    async def close(self) -> None:
        await self._client.aclose()


def chat_body(messages: Sequence[Mapping[str, Any]], p: SamplingParams, model: str,
              tools: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "messages": api_messages(messages), "n": p.n,
        "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
        "logprobs": True, "return_tokens_as_token_ids": True, "return_token_ids": True,
        # SamplingParams keeps stop strings in the text; vLLM drops them by default.
        "include_stop_str_in_output": True,
    }
    if tools:
        # Rendered into the prompt all the same; "none" keeps vLLM's own tool parser (and
        # guided decoding) out of it, so the raw text comes back for `chat_format.parse`.
        body["tools"], body["tool_choice"] = openai_tools(tools), "none"
    if p.seed is not None:
        body["seed"] = p.seed  # vLLM gives sample i of the group seed + i
    if p.stop:
        body["stop"] = list(p.stop)
    if p.grammar:  # serving's tool_choice: the continuation sampled under the call grammar
        body["structured_outputs"] = {"grammar": p.grammar}
    if p.prefill:  # serving's tool_choice prefill: vLLM continues the assistant turn
        body["messages"].append({"role": "assistant", "content": p.prefill})
        body["continue_final_message"], body["add_generation_prompt"] = True, False
    return body


def _completion(choice: dict[str, Any], prompt_ids: list[int], adapter: str | None,
                latency_ms: float, replica: str) -> Completion:
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        raise PolicyError(f"{replica} returned no logprobs; Flywheel needs vLLM's logprobs=True")
    logprobs = [float(e["logprob"]) for e in content]
    if all(e["token"].startswith(_TOKEN_ID) for e in content):
        token_ids = [int(e["token"][len(_TOKEN_ID):]) for e in content]
    elif len(choice.get("token_ids") or ()) == len(content):
        token_ids = list(choice["token_ids"])
    else:
        raise PolicyError(f"{replica} returned tokens as text, not 'token_id:N'; it ignored "
                          "return_tokens_as_token_ids (is it vLLM?)")
    reason = choice.get("finish_reason")
    return Completion(
        text=(choice.get("message") or {}).get("content") or "", token_ids=token_ids,
        logprobs=logprobs, prompt_token_ids=prompt_ids,
        finish_reason="length" if reason == "length" else "stop", adapter=adapter,
        latency_ms=latency_ms,
        extra={"replica": replica, "finish_reason": reason,
               "stop_reason": choice.get("stop_reason")})
