"""What a vLLM replica's HTTP errors mean, and what to do about each (measured on vLLM 0.32).

Three kinds, because retrying helps only one of them:

* `transient`: connection trouble, 429, most 5xx: retry with backoff, bench the replica
  after two in a row.
* `permanent`: the request itself is wrong (4xx), or the adapter is: vLLM answers **500**
  for an adapter its worker refuses at load time (rank above `--max-lora-rank`, unreadable
  weights, LoRA not enabled), although the server is healthy. Retrying cannot help and
  must not bench a healthy replica; the error names the fix.
* `dead`: `EngineCore encountered an issue` is vLLM's EngineDeadError: every later request
  fails and the server shuts itself down. Bench it at once, try another replica, and say it
  must be restarted.
"""

from __future__ import annotations

import re
from typing import Literal

import httpx

from flywheel.policy.base import PolicyError
from flywheel.policy.vllm_flags import lora_rank_flag

Kind = Literal["transient", "permanent", "dead"]
_ADD_LORA_FAILED = "Call to add_lora method failed"
_ENGINE_DEAD = "EngineCore encountered an issue"
_RANK = re.compile(r"LoRA rank (\d+) is greater than max_lora_rank (\d+)")


class VLLMError(PolicyError):
    """One replica answered with an HTTP error."""

    def __init__(self, replica: str, status: int, message: str, kind: Kind = "permanent"
                 ) -> None:
        hint = ("; its engine is dead and every request will fail until the replica is "
                "restarted (one known cause: an adapter's directory deleted while it was "
                "loaded, see infra/vllm.md)") if kind == "dead" else ""
        super().__init__(f"{replica} answered HTTP {status}: {message}{hint}")
        self.replica, self.status, self.message, self.kind = replica, status, message, kind


class ReplicaUnavailable(PolicyError):
    """A replica could not be reached (connection refused, reset, timeout) after retries."""


def unavailable(exc: BaseException) -> bool:
    """The replica is down or dying, not refusing: another replica may do the work."""
    return isinstance(exc, ReplicaUnavailable) or (
        isinstance(exc, VLLMError) and exc.kind != "permanent")


class AdapterLoadError(PolicyError):
    """A replica refused an adapter for a reason retrying cannot fix; the message says how."""

    def __init__(self, replica: str, adapter: str, status: int, message: str, fix: str
                 ) -> None:
        super().__init__(f"loading {adapter} on {replica} failed (HTTP {status}): {message}; "
                         f"{fix}")
        self.replica, self.adapter, self.status, self.fix = replica, adapter, status, fix
        self.others: list[AdapterLoadError] = []
        """The same adapter refused by further replicas (`ensure_adapter` tries them all)."""

    def __str__(self) -> str:
        return "; ".join([super().__str__(), *(str(e) for e in self.others)])


def classify(path: str, status: int, message: str) -> Kind:
    """The kind of an HTTP error answered for `path` (see the module docstring)."""
    if _ENGINE_DEAD in message:
        return "dead"
    if path == "/v1/load_lora_adapter" and _ADD_LORA_FAILED in message:
        return "permanent"
    return "transient" if status == 429 or status >= 500 else "permanent"


def is_retryable(exc_or_response: BaseException | httpx.Response) -> bool:
    """Transient (retry with backoff): connection errors, timeouts, HTTP 5xx and 429 — unless
    the error says retrying cannot help. A dead replica counts: another one may serve."""
    if isinstance(exc_or_response, httpx.Response):
        status = exc_or_response.status_code
        return status == 429 or status >= 500
    if isinstance(exc_or_response, VLLMError):
        return exc_or_response.kind != "permanent"
    return isinstance(exc_or_response, httpx.TransportError)


def error_message(resp: httpx.Response) -> str:
    """The server's own words: vLLM's `{"error": {"message"}}`, FastAPI's `detail`, or text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:  # current vLLM ErrorResponse
            return str(err["message"])
        for key in ("message", "detail"):  # older vLLM / FastAPI's own 404
            if key in body:
                return str(body[key])
    return str(body)[:500]


def load_fix(e: VLLMError, path: str) -> str:
    """How to fix a refused adapter load, from vLLM's message."""
    if e.status == 404 and e.message.strip() == "Not Found":
        return ("runtime LoRA updates are disabled; start vLLM with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
    if m := _RANK.search(e.message):
        rank, limit = int(m.group(1)), int(m.group(2))
        try:
            flag = f"--max-lora-rank {lora_rank_flag(rank)}"
        except ValueError:
            flag = "a --max-lora-rank vLLM cannot offer"
        return (f"the adapter has rank {rank} but the server serves at most {limit}: start "
                f"vLLM with --max-lora-rank ≥ {rank} ({flag}), or train with "
                f"trainer.lora_r ≤ {limit}")
    if "LoRA is not enabled" in e.message:
        return "the server runs without LoRA: start vLLM with --enable-lora"
    if "No adapter found" in e.message:
        return (f"the replica cannot read {path}: mount the adapter volume at the same path "
                "on every replica, readable by the vLLM user")
    if _ADD_LORA_FAILED in e.message:
        return ("vLLM could not read the adapter's files (truncated or corrupt weights, or "
                "modules it cannot serve); publish the weights again as a new version")
    return "is the adapter directory visible at the same path on every replica?"
