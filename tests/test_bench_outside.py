"""`flywheel bench outside`: the agent loop from outside, on the real example MCP server.

The models here are scripted Chat Completions endpoints (a test's stand-in for the API, served
over HTTP and called through the official `openai` client): one walks each episode's
reference path — its calls after the setup, as many per user turn as the episode's reference
turns allow, then an answer — and one answers at once without a call. The tools run on the
example MCP server (`flywheel.tools.mcp_serve` serving the workplace world over stdio); the
scoring is the episode verifier on the end states the server reached. What is checked: the
right path wins every held-out episode and the idle one none, paired; the requests carried
the server's tools (never its reset protocol) and the tool results it gave; a destructive
call is refused, never run, and scored unsafe; an endpoint that errs leaves attempts not run,
out of the pairs. The real API and model are measured by hand (docs/EPISODES.md).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from flywheel.bench import outside
from flywheel.bench.episode_learning import split_episodes
from flywheel.config import Settings
from flywheel.demo import simulate_episodes as desk
from flywheel.tasks import EpisodeSpec, TaskSpec
from flywheel.tools.mcp_backend import list_all_tools
from flywheel.tools.registry import read_toolset
from flywheel.toolsets import McpStdio
from tests.support.serving_helpers import served

SERVER = [sys.executable, "-m", "flywheel.tools.mcp_serve",
          "flywheel.environments.workplace_tools:WorkplaceTools"]
SEED = 29


def _key(messages: list[dict[str, Any]]) -> str:
    return json.dumps([(m["role"], m.get("content")) for m in messages])


def _reply(model: str, message: dict[str, Any], *, finish: str = "stop", tokens: int = 5
           ) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 1, "completion_tokens": tokens,
                      "total_tokens": 1 + tokens}}


class Scripted:
    """The stand-in models, and what they were sent."""

    def __init__(self, tasks: list[TaskSpec]) -> None:
        self.tasks = {_key(t.messages): t for t in tasks}
        self.requests: list[dict[str, Any]] = []

    def answer(self, body: dict[str, Any]) -> dict[str, Any] | None:
        self.requests.append(body)
        messages, model = body["messages"], body["model"]
        task = next((t for k, t in self.tasks.items()
                     if _key(messages[:len(t.messages)]) == k), None)
        assert task is not None and isinstance(task.verifier, EpisodeSpec)
        spec = task.verifier
        if model == "idle":
            return _reply(model, {"role": "assistant", "content": "Done."})
        if model == "purge":
            return _reply(model, {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_p", "type": "function",
                "function": {"name": "tickets_purge", "arguments": "{}"}}]})
        if model == "cut":  # a call cut by the token limit: serving parses none
            return _reply(model, {"role": "assistant", "content": '<tool_call>\n{"name": "tic'},
                          finish="length", tokens=body["max_tokens"])
        if model != "right":
            return None
        after = messages[len(task.messages):]
        made = sum(len(m.get("tool_calls") or ()) for m in after)
        turn = sum(1 for m in after if m["role"] == "user")
        limit = (spec.reference_turns[turn] if turn < len(spec.reference_turns)
                 else len(spec.reference_calls)) - len(spec.setup)
        path = spec.reference_calls[len(spec.setup):]
        if made < limit:
            call = path[made]
            return _reply(model, {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{made}", "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}]})
        return _reply(model, {"role": "assistant", "content": "Done."})


def scripted_api(script: Scripted) -> Any:
    """The stand-in models behind `POST /v1/chat/completions`, served over HTTP."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        found = script.answer(body)
        if found is None:
            return JSONResponse({"error": {"message": f"unknown model {body['model']!r}",
                                           "type": "invalid_request_error", "param": "model",
                                           "code": "model_not_found"}}, status_code=404)
        return JSONResponse(found)

    return served(app, 30)


async def _bench(url: str, before: str, after: str, episodes: int, *, samples: int = 1,
                 max_steps: int = 2) -> dict[str, Any]:
    return await outside._run(
        api_url=url, api_key="t", before=before, after=after, mcp=" ".join(SERVER),
        records=1600, seed=SEED, episodes=episodes, samples=samples, temperature=0.7,
        max_tokens=64, max_steps=max_steps, in_flight=4, request_timeout_s=60)


@pytest.fixture(scope="module")
async def holdout() -> list[TaskSpec]:
    """The held-out episodes `bench outside` runs at SEED: mined with the server's toolset
    registered, as the bench mines them."""
    reg = (await read_toolset(desk.TOOLSET, McpStdio(command=SERVER[0], args=SERVER[1:],
                                                     sessions="shared"))
           ).model_copy(update={"version": 1})
    _, held, _, _ = split_episodes(reg, 1600, SEED, Settings().miner.holdout_fraction)
    return held


async def test_the_right_path_wins_every_held_out_episode_and_an_idle_agent_none(
        holdout: list[TaskSpec]) -> None:
    episodes = 6
    tasks = holdout[:episodes]
    # Some of them go on after the agent's answer (the scripted user) and check the state
    # there; each kind of check is exercised by the right path below.
    assert any(isinstance(t.verifier, EpisodeSpec) and t.verifier.setup for t in tasks)
    script = Scripted(holdout)
    with scripted_api(script) as url:
        out = await _bench(url, "idle", "right", episodes, samples=2, max_steps=4)
    assert out["episodes_run"] == episodes
    assert out["before"]["wins"] == 0 and out["before"]["attempts"] == 2 * episodes
    assert out["after"]["wins"] == 2 * episodes, out["after"]
    assert out["after"]["answered_by"] == ["right"]
    gain = out["gain"]
    assert gain["pairs"] == 2 * episodes and gain["pairs_gained"] == 2 * episodes
    assert gain["gain_exact_success"] == 1.0 and gain["mcnemar_p_two_sided"] < 0.001
    # What the agent sent: the server's tools (its reset protocol never offered), the same
    # seed on both sides for the same attempt and reply, the server's results as tool messages.
    sent = script.requests[0]
    names = [t["function"]["name"] for t in sent["tools"]]
    assert "tickets_purge" in names and not [n for n in names if n.startswith("flywheel_")]
    seeds: dict[str, set[int]] = {}
    for body in script.requests:
        if len(body["messages"]) == len(next(t for t in holdout if _key(t.messages) ==
                                             _key(body["messages"][:len(t.messages)])
                                             ).messages):
            seeds.setdefault(body["model"], set()).add(body["seed"])
    assert seeds["idle"] == seeds["right"]
    results = [m["content"] for b in script.requests if b["model"] == "right"
               for m in b["messages"][-1:] if m["role"] == "tool"]
    assert results and all(r and not r.startswith("error") for r in results), results[:5]


async def test_a_destructive_call_is_refused_and_scored_unsafe(holdout: list[TaskSpec]
                                                               ) -> None:
    import openai
    from mcp import Client, StdioServerParameters

    task = holdout[0]
    script = Scripted(holdout)
    with scripted_api(script) as url:
        async with Client(StdioServerParameters(command=SERVER[0], args=SERVER[1:])) as client, \
                openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="t", max_retries=0) as chat:
            tools = outside.Tools(client, await list_all_tools(client))
            assert "tickets_purge" in tools.unsafe
            refs = await outside.References.of(tools, task.verifier)  # type: ignore[arg-type]
            got = await outside.run_attempt(chat, "purge", tools, task, 0, refs, seed=1,
                                            temperature=0.0, max_tokens=64, max_steps=4)
    assert got.failure_mode == "unsafe_action" and got.reward == 0.0
    assert got.calls == [{"name": "tickets_purge", "arguments": {}, "unsafe": True,
                          "rule": None, "status": "error", "source": "refused",
                          "output": "error: tickets_purge is destructive; it was not executed"}]
    assert got.replies == 1  # the attempt ended at the refused call


async def test_an_endpoint_that_errs_leaves_attempts_not_run(holdout: list[TaskSpec]) -> None:
    script = Scripted(holdout)
    with scripted_api(script) as url:
        out = await _bench(url, "missing", "idle", 2)
    assert out["before"]["not_run"] == {"crash": 2} and out["before"]["attempts"] == 0
    assert out["after"]["attempts"] == 2
    assert out["gain"] == {"pairs": 0, "tasks": 0}


async def test_a_reply_cut_by_the_token_limit_scores_as_the_gate_scores_it(
        holdout: list[TaskSpec]) -> None:
    """Cut before its call closed: no call, no answer — the gate's `truncated` (reward 0),
    not the verifier's `empty`."""
    script = Scripted(holdout)
    with scripted_api(script) as url:
        out = await _bench(url, "cut", "idle", 2)
    assert out["before"]["outcomes"] == {"truncated": 2}, out["before"]
    assert script.requests[0]["max_tokens"] == 64


def test_the_cli_finds_the_local_stacks_publish_token(tmp_path: Any) -> None:
    """`bench outside` without --api-key takes a publish token from the stack's tokens.json
    (either grant shape), never one that only operates."""
    from flywheel.cli.bench import _publish_token

    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"op": {"scopes": ["operate"]},
                                "pub": {"scopes": ["publish"], "agent": "bot"}}))
    assert _publish_token(Settings(home=tmp_path)) == "pub"
    path.write_text(json.dumps({"op": ["operate"]}))
    assert _publish_token(Settings(home=tmp_path)) is None
