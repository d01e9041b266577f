"""judge: a real local OpenAI-compatible HTTP server stands in for the judge model."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from flywheel.environments.judge import JudgeEnvironment, parse_judge_reply
from flywheel.tasks import JudgeSpec, RolloutNotRun

SPEC = JudgeSpec(rubric="Mentions the refund deadline.", reference="Refunds within 30 days.")


class FakeJudge:
    """What the fake endpoint answers, and what it was asked."""

    def __init__(self) -> None:
        self.reply: str = '{"score": 8, "reason": "mentions the deadline"}'
        self.status = 200
        self.delay_s = 0.0
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []


@pytest.fixture
def judge_server() -> Iterator[tuple[str, FakeJudge]]:
    fake = FakeJudge()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            fake.requests.append({"path": self.path, **body})
            fake.headers.append(dict(self.headers))
            time.sleep(fake.delay_s)
            payload = json.dumps({"choices": [{"message": {"role": "assistant",
                                                           "content": fake.reply}}]})
            self.send_response(fake.status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(payload.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", fake
    server.shutdown()
    server.server_close()


def test_judge_score_becomes_reward(judge_server: tuple[str, FakeJudge]) -> None:
    url, fake = judge_server
    env = JudgeEnvironment(url, "grader", "sk-test", timeout_s=2.0)
    r = env.verify(SPEC, "You can get a refund within 30 days.")
    assert (r.reward, r.failure_mode) == (0.8, None)
    assert r.reward_components == {"judge_score": 0.8}
    assert r.details["reason"] == "mentions the deadline"
    sent = fake.requests[0]
    assert (sent["path"], sent["model"]) == ("/v1/chat/completions", "grader")
    assert "Mentions the refund deadline." in sent["messages"][1]["content"]
    assert "within 30 days" in sent["messages"][1]["content"]
    assert fake.headers[0]["Authorization"] == "Bearer sk-test"


def test_low_score_is_a_scored_failure(judge_server: tuple[str, FakeJudge]) -> None:
    url, fake = judge_server
    fake.reply = 'Verdict:\n```json\n{"score": 2, "reason": "no deadline"}\n```'
    r = JudgeEnvironment(url, timeout_s=2.0).verify(SPEC, "Refunds exist.")
    assert (r.reward, r.failure_mode) == (0.2, "other")


def test_config_comes_from_the_environment(judge_server: tuple[str, FakeJudge],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    url, fake = judge_server
    monkeypatch.setenv("FLYWHEEL_JUDGE__BASE_URL", url)
    monkeypatch.setenv("FLYWHEEL_JUDGE__MODEL", "env-model")
    assert JudgeEnvironment(timeout_s=2.0).verify(SPEC, "30 days").reward == 0.8
    assert fake.requests[0]["model"] == "env-model"


@pytest.mark.parametrize("reply, status", [('{"score": 11}', 200), ("no idea", 200),
                                           ('{"score": "high"}', 200), ("{}", 500)])
def test_bad_judge_replies_are_not_the_attempts_fault(
        judge_server: tuple[str, FakeJudge], reply: str, status: int) -> None:
    url, fake = judge_server
    fake.reply, fake.status = reply, status
    with pytest.raises(RolloutNotRun) as info:
        JudgeEnvironment(url, timeout_s=2.0).verify(SPEC, "30 days")
    assert info.value.kind == "judge_unavailable"


def test_slow_judge_times_out(judge_server: tuple[str, FakeJudge]) -> None:
    url, fake = judge_server
    fake.delay_s = 1.0
    with pytest.raises(RolloutNotRun) as info:
        JudgeEnvironment(url, timeout_s=0.2).verify(SPEC, "30 days")
    assert info.value.kind == "judge_unavailable"


def test_unreachable_or_unconfigured_judge(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    with pytest.raises(RolloutNotRun) as info:
        JudgeEnvironment(f"http://127.0.0.1:{port}", timeout_s=1.0).verify(SPEC, "30 days")
    assert info.value.kind == "judge_unavailable"
    monkeypatch.delenv("FLYWHEEL_JUDGE__BASE_URL", raising=False)
    with pytest.raises(RolloutNotRun, match="FLYWHEEL_JUDGE__BASE_URL") as info:
        JudgeEnvironment().verify(SPEC, "30 days")
    assert info.value.kind == "judge_unavailable"


def test_empty_answer_is_scored_zero_without_asking_the_judge() -> None:
    got = JudgeEnvironment("http://127.0.0.1:9").verify(SPEC, "  ")  # nothing listens there
    assert got.reward == 0.0 and got.failure_mode == "empty"


def test_parse_judge_reply() -> None:
    assert parse_judge_reply('{"score": 10, "reason": "ok"}') == (1.0, "ok")
    assert parse_judge_reply('text {"score": 0} text') == (0.0, "")
    with pytest.raises(ValueError, match="numeric score"):
        parse_judge_reply('{"score": true}')
