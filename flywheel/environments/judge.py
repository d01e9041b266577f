"""`judge`: an LLM scores the answer against the task's rubric (optional, off by default).

Talks to any OpenAI-compatible `POST {base_url}/chat/completions`. Configuration comes from
the constructor, else from `FLYWHEEL_JUDGE__BASE_URL`, `FLYWHEEL_JUDGE__MODEL` and
`FLYWHEEL_JUDGE__API_KEY`, read when the environment is built (never at import). With no
base URL the judge is off: every verify raises `RolloutNotRun("judge_unavailable")`, so a
missing judge never turns into reward 0. An empty answer is the model's doing: it scores 0
(`empty`) without asking the judge.

The judge must reply with JSON `{"score": 0..10, "reason": "…"}` (a code fence or text
around the object is tolerated). reward = score / 10; success ⇔ reward ≥ `pass_threshold`.
An unreachable endpoint, an HTTP error or an unreadable reply is `judge_unavailable`: the
attempt is not at fault. No retries here; the caller owns retry policy.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from flywheel.environments.base import (
    AnySpec,
    Environment,
    ToolSchemas,
    abstained,
    expect_spec,
    result,
)
from flywheel.tasks import JudgeSpec, RolloutNotRun, TaskSpec, VerifierResult

_SYSTEM = ("You grade an AI assistant's answer against a rubric. Reply with only a JSON "
           'object {"score": <integer 0-10>, "reason": "<one sentence>"}; 10 means the answer '
           "fully satisfies the rubric, 0 means it does not address it at all.")


def judge_messages(spec: JudgeSpec, answer: str,
                   conversation: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, str]]:
    """The chat messages sent to the judge (pure)."""
    parts = [f"Rubric:\n{spec.rubric}"]
    request = [m["content"] for m in conversation
               if m.get("role") == "user" and isinstance(m.get("content"), str)]
    if request:
        parts.append(f"User request:\n{request[-1]}")
    if spec.reference:
        parts.append(f"Reference answer:\n{spec.reference}")
    parts.append(f"Answer to grade:\n{answer}")
    return [{"role": "system", "content": _SYSTEM},
            {"role": "user", "content": "\n\n".join(parts)}]


def parse_judge_reply(text: str) -> tuple[float, str]:
    """(reward in [0, 1], reason) from the judge's reply, or ValueError saying what is wrong."""
    found = re.search(r"\{.*\}", text, re.S)
    if not found:
        raise ValueError(f"judge reply has no JSON object: {text[:200]!r}")
    try:
        obj = json.loads(found.group(0))
    except json.JSONDecodeError as exc:
        raise ValueError(f"judge reply is not valid JSON ({exc}): {text[:200]!r}") from None
    score = obj.get("score") if isinstance(obj, dict) else None
    if isinstance(score, bool) or not isinstance(score, int | float) or not 0 <= score <= 10:
        raise ValueError(f"judge reply needs a numeric score in 0..10, got {score!r}")
    return float(score) / 10.0, str(obj.get("reason", ""))


class JudgeEnvironment(Environment):
    """Single-step: the output is the model's final answer text."""

    name = "judge"

    def __init__(self, base_url: str | None = None, model: str | None = None,
                 api_key: str | None = None, *, timeout_s: float = 30.0,
                 pass_threshold: float = 0.7) -> None:
        self.base_url = (base_url or os.environ.get("FLYWHEEL_JUDGE__BASE_URL") or "") \
            .rstrip("/")
        self.model = model or os.environ.get("FLYWHEEL_JUDGE__MODEL") or "judge"
        self.api_key = api_key or os.environ.get("FLYWHEEL_JUDGE__API_KEY")
        self.timeout_s = timeout_s
        self.pass_threshold = pass_threshold

    def verify(self, spec: AnySpec, output: object, *,
               tools: ToolSchemas | None = None) -> VerifierResult:
        return self._score(expect_spec(spec, JudgeSpec, self.name), output, ())

    def verify_task(self, task: TaskSpec, output: object) -> VerifierResult:
        """Like verify, and the judge also sees the user's request."""
        return self._score(expect_spec(task.verifier, JudgeSpec, self.name), output,
                           task.messages)

    def _score(self, spec: JudgeSpec, output: object,
               conversation: Sequence[Mapping[str, Any]]) -> VerifierResult:
        if output is None or (isinstance(output, str) and not output.strip()):
            return abstained({"judge_score": 0.0}, "the attempt produced no answer to judge")
        if not isinstance(output, str):
            raise TypeError(f"judge scores the answer text, got {type(output).__name__}")
        reply = self._ask(judge_messages(spec, output, conversation))
        try:
            reward, reason = parse_judge_reply(reply)
        except ValueError as exc:
            raise RolloutNotRun("judge_unavailable", str(exc)) from exc
        mode = None if reward >= self.pass_threshold else "other"
        return result(reward, {"judge_score": reward}, mode, reason=reason, model=self.model)

    def _ask(self, messages: list[dict[str, str]]) -> str:
        if not self.base_url:
            raise RolloutNotRun("judge_unavailable", "no judge configured; set "
                                "FLYWHEEL_JUDGE__BASE_URL (and _MODEL, _API_KEY) to enable it")
        import httpx  # lazily: importing flywheel stays cheap

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": self.model, "messages": messages, "temperature": 0.0}
        try:
            response = httpx.post(f"{self.base_url}/chat/completions", json=body,
                                  headers=headers, timeout=self.timeout_s)
            response.raise_for_status()
            content = response.json()["choices"][0]["message"]["content"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise RolloutNotRun("judge_unavailable",
                                f"judge at {self.base_url} failed: {exc}") from exc
        if not isinstance(content, str):
            raise RolloutNotRun("judge_unavailable", "judge reply has no message content")
        return content
