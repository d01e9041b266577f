"""The GPU policy engine: N vLLM replicas driven only through their public HTTP API.

Owns adapter placement and routing. `ensure_adapter` loads an immutable version name
(`<policy>@v<N>`) on every replica, verifies each through `/v1/models` and only then routes to
it; a name already listed is never loaded again (reloading a name serves stale prefix-cache
entries), and a name once placed from one directory is refused from any other, even after
it was retired. Retention keeps the newest `retention` versions plus the pinned ones
(production, baseline). Errors are typed by what retrying can do (`vllm_errors`): an adapter
the server refuses (rank too big, unreadable weights: HTTP 500 from vLLM) fails at once with
the fix and never benches a healthy replica; a dead engine is benched at once.

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
against `chat_format.render`: a replica started with another template is refused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

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
    served_name,
)
from flywheel.policy.chat_format import ChatFormat, api_messages, openai_tools
from flywheel.policy.vllm_errors import (
    AdapterLoadError,
    ReplicaUnavailable,
    VLLMError,
    classify,
    error_message,
    is_retryable,
    load_fix,
    unavailable,
)

__all__ = ["AdapterLoadError", "NoChatFormat", "ReplicaUnavailable", "VLLMError", "VLLMPolicy",
           "is_retryable", "served_versions"]
log = logging.getLogger(__name__)
T = TypeVar("T")
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


def _same_path(root: str | None, path: str) -> bool:
    # vLLM lists the path it was given as `root`; a server that omits it cannot contradict us.
    return root is None or os.path.normpath(root) == os.path.normpath(path)


@dataclass(eq=False)
class _Replica:
    url: str
    in_flight: int = 0
    failures: int = 0
    down_until: float = 0.0
    adapters: dict[str, str] = field(default_factory=dict)
    """Adapter names verified in this replica's /v1/models, with their paths."""


class VLLMPolicy:
    """A `Policy` over vLLM replicas; one instance manages the versions of one policy."""

    def __init__(self, base_urls: Sequence[str], *, model: str, policy_name: str = "policy",
                 timeout_s: float = 60, max_retries: int = 4, retention: int = 3,
                 pinned: set[str] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, api_key: str | None = None,
                 backoff_s: float = 0.5, cooldown_s: float = 30.0, verify_attempts: int = 5,
                 verify_delay_s: float = 0.5,
                 chat_format: ChatFormat | Callable[[], ChatFormat] | None = None) -> None:
        if not base_urls:
            raise ValueError("VLLMPolicy needs at least one replica URL")
        if retention < 1:
            raise ValueError(f"retention must be >= 1 (max staleness + 1), got {retention}")
        self.model, self.policy_name, self.retention = model, policy_name, retention
        self._replicas = [_Replica(url.rstrip("/")) for url in base_urls]
        self._pinned: set[str] = set(pinned or ())
        self._production: str | None = None
        self._max_retries, self._backoff_s, self._cooldown_s = max_retries, backoff_s, cooldown_s
        self._verify_attempts, self._verify_delay_s = verify_attempts, verify_delay_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(transport=transport, timeout=timeout_s, headers=headers)
        self._admin = asyncio.Lock()  # loads/unloads are rare; serialising them avoids races
        self._rr = 0
        self._paths: dict[str, str] = {}
        """Every adapter name this instance placed → its directory; kept after retiring, so
        a version name never comes back with other weights."""
        self._retired: set[str] = set()
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

    # -- pins ---------------------------------------------------------------------------------
    @property
    def pinned(self) -> frozenset[str]:
        return frozenset(self._pinned)

    def pin(self, name: str) -> None:
        """Never unload `name` (production and baseline versions)."""
        self._pinned.add(name)

    def unpin(self, name: str) -> None:
        self._pinned.discard(name)

    def pin_production(self, name: str | None) -> None:
        """Pin what production serves now (None: the base model), unpinning what it served
        before. Every process's engine shares the replicas, and retention in any of them
        (a rollout worker placing its newest version) would otherwise unload production
        under the serving endpoint: each service pins it from the database
        (`AdapterResolver.protect_production`) before it places anything."""
        if name == self._production:
            return
        if self._production is not None:
            self._pinned.discard(self._production)
        self._production = name
        if name is not None:
            self._pinned.add(name)

    def replicas_serving(self, name: str) -> list[str]:
        """The replicas `name` was placed and verified on (where sampling may go)."""
        return [r.url for r in self._replicas if name in r.adapters]

    # -- adapters ------------------------------------------------------------------------------
    async def ensure_adapter(self, adapter: AdapterRef) -> None:
        self._check_policy(adapter)
        known = self._paths.get(adapter.name)
        if known is not None and not _same_path(known, str(adapter.path)):
            raise PolicyError(f"{adapter.name} was placed from {known} before, not "
                              f"{adapter.path}: a version name is immutable; publish the new "
                              "weights as a new version")
        async with self._admin:
            # Check every reachable replica before loading anywhere: a name served from
            # another path is a broken invariant. A replica that is down is skipped (it is
            # checked and loaded on a later call once it answers): one dead replica must not
            # stop new versions from serving on the others, and sampling only ever routes to
            # replicas verified here.
            up = await self._reachable([self._listing(r) for r in self._replicas],
                                       self._replicas, f"place {adapter.name}")
            for r, listing in up:
                if adapter.name in listing:
                    self._check_root(r, adapter.name, listing[adapter.name], str(adapter.path))
            self._paths[adapter.name] = str(adapter.path)
            self._retired.discard(adapter.name)
            placed = await self._reachable([self._place(r, adapter, listing) for r, listing in up],
                                           [r for r, _ in up], f"place {adapter.name}")
            await self._enforce_retention(adapter.name, [listing for _, listing in placed])

    async def _reachable(self, calls: Sequence[Awaitable[T]], replicas: Sequence[_Replica],
                         what: str) -> list[tuple[_Replica, T]]:
        """Run one call per replica to the end; results of those that answered. Replicas that
        are unavailable are logged and left out, unless all are; any other error is raised."""
        results = await asyncio.gather(*calls, return_exceptions=True)
        down = [(r, e) for r, e in zip(replicas, results, strict=True)
                if isinstance(e, BaseException) and unavailable(e)]
        await _fan_out([_raise(e) for e in results if isinstance(e, BaseException)
                        and not unavailable(e)])
        answered = [(r, v) for r, v in zip(replicas, results, strict=True)
                    if not isinstance(v, BaseException)]
        if down and not answered:
            raise ReplicaUnavailable(f"cannot {what}: no replica is available ("
                                     + "; ".join(str(e) for _, e in down) + ")") from down[0][1]
        for r, e in down:
            log.warning("could not %s on %s (skipped until it answers again): %s", what, r.url, e)
        return answered

    async def retire_adapter(self, adapter: AdapterRef) -> None:
        self._check_policy(adapter)
        if adapter.name in self._pinned:
            raise PolicyError(f"{adapter.name} is pinned (production or baseline); unpin it "
                              "before retiring it")
        async with self._admin:
            await self._unload_everywhere(adapter.name)
            self._retired.add(adapter.name)

    async def _place(self, r: _Replica, adapter: AdapterRef,
                     listing: dict[str, str | None]) -> dict[str, str | None]:
        """Load `adapter` on `r` unless it is listed there already, then verify the listing."""
        name, path = adapter.name, str(adapter.path)
        if name not in listing:
            try:
                await self._call_retrying(r, "POST", "/v1/load_lora_adapter",
                                          {"lora_name": name, "lora_path": path})
                log.info("loaded %s from %s on %s", name, path, r.url)
            except VLLMError as e:
                # "already been loaded": a concurrent loader won; verification checks its path.
                if not (e.status == 400 and "already" in e.message):
                    if e.kind != "permanent":
                        raise
                    raise AdapterLoadError(r.url, name, e.status, e.message,
                                           load_fix(e, path)) from e
            listing = await self._verify(r, name, path)
        r.adapters[name] = path
        return listing

    async def _verify(self, r: _Replica, name: str, path: str) -> dict[str, str | None]:
        for attempt in range(self._verify_attempts):
            listing = await self._listing(r)
            if name in listing:
                self._check_root(r, name, listing[name], path)
                return listing
            await asyncio.sleep(self._verify_delay_s * (attempt + 1))
        raise PolicyError(f"replica {r.url} accepted {name} but does not list it in /v1/models "
                          f"after {self._verify_attempts} checks; not routing to it")

    def _check_root(self, r: _Replica, name: str, root: str | None, path: str) -> None:
        if not _same_path(root, path):
            raise PolicyError(f"replica {r.url} serves {name} from {root}, not {path}: a version "
                              "name is immutable; publish the new weights as a new version")

    async def _enforce_retention(self, keep: str, listings: list[dict[str, str | None]]) -> None:
        pattern = re.compile(rf"^{re.escape(self.policy_name)}@v(\d+)$")
        versions = sorted({int(m.group(1)) for listing in listings for name in listing
                           if (m := pattern.match(name))})
        newest = set(versions[-self.retention:])
        for version in versions:
            name = served_name(self.policy_name, version)
            if version in newest or name == keep or name in self._pinned:
                continue
            try:
                await self._unload_everywhere(name)
            except PolicyError as e:
                # The new version is already servable; a failed cleanup is retried next time.
                log.warning("retention could not unload %s: %s", name, e)

    async def _unload_everywhere(self, name: str) -> None:
        async def unload(r: _Replica) -> None:
            r.adapters.pop(name, None)  # stop routing here before the server drops it
            try:
                await self._call_retrying(r, "POST", "/v1/unload_lora_adapter", {"lora_name": name})
                log.info("unloaded %s on %s", name, r.url)
            except VLLMError as e:
                if not (e.status in (400, 404) and "cannot be found" in e.message):
                    if e.status == 404 and e.message.strip() == "Not Found":
                        raise PolicyError(f"unloading {name} on {r.url}: {load_fix(e, '')}"
                                          ) from e
                    raise

        await _fan_out([unload(r) for r in self._replicas])

    def _check_policy(self, adapter: AdapterRef) -> None:
        if adapter.policy != self.policy_name:
            raise PolicyError(f"{adapter.name} belongs to policy {adapter.policy!r}; this "
                              f"VLLMPolicy manages {self.policy_name!r}")

    async def _listing(self, r: _Replica) -> dict[str, str | None]:
        data = await self._call_retrying(r, "GET", "/v1/models")
        return {card["id"]: card.get("root") for card in data.get("data", [])}

    async def _serving(self, adapter: AdapterRef) -> list[_Replica]:
        """Replicas verified to serve `adapter`; asks /v1/models once when none is known."""
        serving = [r for r in self._replicas if adapter.name in r.adapters]
        if serving:
            return serving
        results = await asyncio.gather(*(self._listing(r) for r in self._replicas),
                                       return_exceptions=True)
        found = [(r, listing[adapter.name]) for r, listing in zip(self._replicas, results,
                 strict=True) if isinstance(listing, dict) and adapter.name in listing]
        for r, root in found:  # all checked before any is routed to
            self._check_root(r, adapter.name, root, str(adapter.path))
        for r, _ in found:
            r.adapters[adapter.name] = str(adapter.path)
        serving = [r for r in self._replicas if adapter.name in r.adapters]
        if not serving:
            if adapter.name in self._retired:
                raise PolicyError(f"{adapter.name} was retired; call ensure_adapter first "
                                  "(sampling never loads an adapter by itself)")
            raise AdapterNotServed(f"{adapter.name} is not loaded on any replica; call "
                                   "ensure_adapter first (sampling never loads an adapter by "
                                   "itself)")
        return serving

    # -- sampling ------------------------------------------------------------------------------
    async def sample(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams, *,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     adapter: AdapterRef | None = None) -> list[Completion]:
        if params.n < 1:
            raise PolicyError(f"SamplingParams.n must be >= 1, got {params.n}")
        model = adapter.name if adapter else self.model
        candidates = await self._serving(adapter) if adapter else self._replicas
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
        """Least-loaded healthy replica, round-robin among equals; avoids ones that just failed."""
        now = time.monotonic()
        healthy = [r for r in pool if r not in avoid and r.down_until <= now]
        choices = healthy or [r for r in pool if r not in avoid] or pool
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


async def served_versions(base_urls: Sequence[str], policy_name: str, *,
                          timeout_s: float = 10.0, api_key: str | None = None,
                          transport: httpx.AsyncBaseTransport | None = None) -> set[int]:
    """Versions of `policy_name` that any replica still lists in `/v1/models`. vLLM reads a
    listed adapter's directory again whenever it falls out of `--max-cpu-loras`, so none of
    these may be deleted. Raises PolicyError when a replica cannot be asked: then nothing
    may be deleted."""
    pattern = re.compile(rf"^{re.escape(policy_name)}@v(\d+)$")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(transport=transport, timeout=timeout_s,
                                 headers=headers) as client:
        async def listing(url: str) -> list[str]:
            try:
                resp = await client.get(url.rstrip("/") + "/v1/models")
            except httpx.TransportError as e:
                raise PolicyError(f"replica {url} unreachable for GET /v1/models: {e!r}") from e
            if resp.status_code >= 400:
                raise VLLMError(url, resp.status_code, error_message(resp))
            return [str(card["id"]) for card in resp.json().get("data", [])]

        names = await _fan_out([listing(url) for url in base_urls])
    return {int(m.group(1)) for listed in names for name in listed if (m := pattern.match(name))}


async def _raise(e: BaseException) -> None:
    raise e


async def _fan_out(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Run every call to the end (no replica is left half-done); raise all failures together."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [e for e in results if isinstance(e, BaseException)]
    for e in errors:
        if not isinstance(e, Exception):
            raise e  # cancellation and friends
    if len(errors) == 1:
        raise errors[0]
    if errors and all(isinstance(e, AdapterLoadError) for e in errors):
        first = errors[0]
        assert isinstance(first, AdapterLoadError)
        first.others = [e for e in errors[1:] if isinstance(e, AdapterLoadError)]
        raise first
    if errors:
        raise PolicyError("; ".join(str(e) for e in errors)) from errors[0]
    return [r for r in results if not isinstance(r, BaseException)]
