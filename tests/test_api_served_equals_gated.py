"""Served = gated: what agents get from `production` scores as the gate measured it.

On a real stack (Postgres, the artifact store, the gate service, the API with its real
lifespan) with the real SmolLM2-135M: a few SFT steps on demonstrations rendered by the chat
format make a version that calls tools on its own; the gate evaluates it against the base
model on a frozen holdout, greedy, and promotes it; then every holdout task is sent as an
agent sends it — its messages and OpenAI-shaped `tools`, the gate's seed, `temperature: 0`,
no `tool_choice` — through `POST /v1/chat/completions` with the official `openai` client,
and the returned `tool_calls` are scored by the same verifier; then once more through
`POST /v1/responses` (`client.responses.create`, the task's messages as input items), whose
`function_call` items score task by task as the chat answers do, from the same prompts.
The success rates agree task by task (greedy decoding on both sides), and the served
prompts are token for token the ones the policy's chat format renders for the gate.

The sides must also agree on failures: with the gate's 40-token budget a `create_ticket`
call (about 41 tokens in the chat format) is cut before its closing tag on both sides, so
success is strictly between 0 and 1. Measured on the shared 2-core machine: gated 0.625 =
served 0.625 on 8 tasks, task by task, base model 0.000; 103 s at load average ~8 (SFT 42,
gate 36, served 25), 636 s at ~14; with the Responses pass, the same 0.625 through both
endpoints task by task, 777 s at ~17 (SFT 485, gate 184, served both ways 109).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from flywheel.config import (
    ApiSettings,
    DbSettings,
    GateSettings,
    RolloutSettings,
    Settings,
    TrainerSettings,
)
from flywheel.db.engine import make_engine
from flywheel.environments import load_environment
from flywheel.environments.prompt import task_messages, task_tools
from flywheel.environments.toolset import ToolsetEnvironment
from flywheel.events import ScoredRollout, Turn
from flywheel.gate import evaluate as gate_evaluate
from flywheel.gate.decision import metrics
from flywheel.gate.evaluate import load_holdout, round_seed, scored_group
from flywheel.mining.demos import demonstration_from_task
from flywheel.mining.episodes import toolset_tools
from flywheel.mining.store import freeze_eval_set, store_task
from flywheel.policy.chat_format import openai_tools
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.rollout.loop import score, turn_tokens
from flywheel.tasks import EpisodeSpec, ExpectedCall, TaskSpec, ToolCallSpec
from flywheel.tools.descriptors import Registration
from flywheel.tools.runtime import Catalog
from flywheel.toolsets import PythonClass
from tests.support.serving_helpers import live_api, register_version
from tests.support.toolsets import registered

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

TOKEN = "tok-agent"
SFT_STEPS, SFT_BATCH, SFT_LR = 4, 4, 2e-3
MAX_TOKENS = 40
DESK = "tests.support.py_toolset:Desk"
TOOLS = [  # as the miner stores an agent's tools (flat); the agent sends them nested
    {"type": "function", "name": "get_weather", "description": "Current weather for a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}},
    {"type": "function", "name": "create_ticket", "description": "Open a support ticket",
     "parameters": {"type": "object", "properties": {
         "title": {"type": "string"}, "priority": {"type": "integer"}},
         "required": ["title", "priority"]}}]


def _task(prompt: str, name: str, args: dict[str, Any], split: str) -> TaskSpec:
    return TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                    messages=[{"role": "user", "content": prompt}],
                    verifier=ToolCallSpec(expected=ExpectedCall(name=name, arguments=args)),
                    failure_mode="bad_arguments", fingerprint=f"{split}-{prompt}", split=split)


def _tasks(cities: list[str], printers: list[tuple[int, int]], split: str) -> list[TaskSpec]:
    return ([_task(f"What's the weather in {c}?", "get_weather", {"city": c}, split)
             for c in cities]
            + [_task(f"Printer {n} is jammed, open a ticket with priority {p}.",
                     "create_ticket", {"title": f"Printer {n} jammed", "priority": p}, split)
               for n, p in printers])


TRAIN = _tasks(["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Cairo", "Delhi", "Hanoi"],
               [(1000 + i, 1 + i % 4) for i in range(8)], "train")
HOLDOUT = _tasks(["Pune", "Quito", "Accra", "Tunis", "Minsk"], [(7001, 2), (7002, 3), (7003, 1)],
                 "holdout")


def _episodes(desk: Registration) -> list[TaskSpec]:
    """Episode tasks on the `Desk` toolset (the two tools above as a Python class): a first
    request, the agent's turns on the tools, its answer, then the scripted user's second
    request; the end state (the tickets) is checked against the reference calls'."""
    def task(first: str, then: str, title: str, priority: int) -> TaskSpec:
        return TaskSpec(
            task_id=uuid.uuid4(), env="toolset", tools=toolset_tools(desk),
            messages=[{"role": "user", "content": first}],
            verifier=EpisodeSpec(toolset="desk", toolset_version=desk.version,
                                 initial_state={"tickets": []}, check_state=True,
                                 user_turns=[then], reference_calls=[ExpectedCall(
                                     name="create_ticket",
                                     arguments={"title": title, "priority": priority})]),
            failure_mode="incomplete", fingerprint=f"episode-{first}", split="holdout")

    return [task("What's the weather in Pune?",
                 "Printer 7004 is jammed, open a ticket with priority 2.",
                 "Printer 7004 jammed", 2),
            task("Printer 7005 is jammed, open a ticket with priority 3.",
                 "What's the weather in Quito?", "Printer 7005 jammed", 3)]


async def _served_episode(base_url: str, task: TaskSpec, catalog: Catalog, s: Settings
                          ) -> ScoredRollout:
    """The episode as an agent runs its own loop: `POST /v1/chat/completions` through the
    official async client, each answer's message sent back as the client returns it
    (`model_dump`, arguments as JSON strings, the server's call ids), the calls executed by
    the agent on a session of its own, their results sent as `tool` messages; after an answer
    without calls, the scripted user's next request. Scored by the gate's own rule."""
    env = ToolsetEnvironment(catalog)
    session = f"agent-{uuid.uuid4().hex[:8]}"
    assert isinstance(task.verifier, EpisodeSpec)
    assert await env.aopen([session], task.verifier) == [None]
    seed = round_seed(s, task, 0)
    budget = s.rollout.max_steps * (1 + len(task.verifier.user_turns))  # as the rollouts count
    messages, turns = task_messages(task), []
    try:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=TOKEN, max_retries=0,
                                      timeout=600) as client:
            for step in range(budget):
                answer = await client.chat.completions.create(
                    model="production", messages=messages, tools=openai_tools(task.tools),
                    temperature=0, seed=seed + step,
                    # The gate's limit for a turn of an episode (`episode_max_tokens`).
                    max_tokens=turn_tokens(task, gate_evaluate._config(s)),
                    extra_body={"return_token_ids": True})
                (choice,) = answer.choices
                assert answer.model == "policy@v1", answer.model
                turns.append(Turn(prompt_token_ids=answer.model_extra["prompt_token_ids"],
                                  token_ids=choice.model_extra["token_ids"], logprobs=[],
                                  text="", finish_reason=choice.finish_reason))
                messages.append(choice.message.model_dump(exclude_none=True))
                if choice.message.tool_calls:
                    for call in choice.message.tool_calls:
                        done = await env.astep(session, call.function.name,
                                               json.loads(call.function.arguments))
                        if done.end:
                            break
                        messages.append({"role": "tool", "tool_call_id": call.id,
                                         "content": done.observation})
                    continue
                if choice.finish_reason == "length":
                    break
                user = await env.anext_user(session, choice.message.content or "")
                if user is None:
                    break
                messages.append({"role": "user", "content": user})
        result = score(env.verify_task(task, await env.asession_output(session)), turns)
    finally:
        await env.aclose(session)
    return ScoredRollout(index=0, reward=result.reward, reward_components=result.reward_components,
                         failure_mode=result.failure_mode, not_run=None, turns=turns,
                         latency_ms=0.0, reason=result.details.get("reason"))


def _settings(db_url: str, home: Path) -> Settings:
    return Settings(
        home=home, db=DbSettings(url=db_url),
        api=ApiSettings(tokens={TOKEN: ["publish"]}, serve=True),
        rollout=RolloutSettings(model_dir=resolve_model_dir(None), max_tokens=MAX_TOKENS,
                                max_steps=3),
        trainer=TrainerSettings(adapters_dir=home / "adapters"),
        # Greedy, one sample per task, so one round and the fixed exact test; 8 greedy pairs
        # cannot reach a first candidate's level (5 wins: p = 1/32 > 0.0304), and what is
        # compared here is served vs gated, not the decision rule: the documented test-only
        # override passes significance and gain. The latency guard is loosened only because
        # this shared 2-core machine makes latency noise.
        gate=GateSettings(mode="auto", samples_per_task=1, round_samples=1, temperature=0.0,
                          test="mcnemar", latency_p95_ratio=100.0, test_only_accept=True))


def _warm_start(path: Path) -> list[float]:
    """The trainer's SFT warm start on the train tasks' demonstrations (the chat format
    renders prompt and reply, loss on the reply and its end-of-turn token)."""
    from flywheel.trainer.engine import LoRASpec, LoRATrainer
    from flywheel.trainer.grpo import GRPOConfig

    demos = [d for t in TRAIN if (d := demonstration_from_task(t, uuid.uuid4())) is not None]
    assert len(demos) == len(TRAIN)
    torch.manual_seed(0)
    trainer = LoRATrainer(resolve_model_dir(None), lora=LoRASpec(), grpo=GRPOConfig(), lr=SFT_LR)
    order = random.Random(0).sample(demos, len(demos))
    losses = [trainer.sft_step([order[(s * SFT_BATCH + j) % len(order)]
                                for j in range(SFT_BATCH)])["loss"] for s in range(SFT_STEPS)]
    trainer.save(path)
    return losses


def _served_success(base_url: str, tasks: list[TaskSpec], settings: Settings
                    ) -> tuple[dict[str, bool], list[tuple[Any, TaskSpec]]]:
    env = load_environment("tool_call")
    out: dict[str, bool] = {}
    answers = []
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=TOKEN, max_retries=0,
                       timeout=600) as client:
        for task in tasks:
            answer = client.chat.completions.create(
                model="production", messages=task.messages, tools=openai_tools(task.tools),
                temperature=0, seed=settings.gate.seed ^ zlib.crc32(task.task_id.bytes),
                max_tokens=settings.rollout.max_tokens, extra_body={"return_token_ids": True})
            message = answer.choices[0].message.model_dump(exclude_none=True)
            result = env.verify(task.verifier, message, tools=task.tools)
            # The gate's success rule (flywheel.gate.evaluate: no failure mode, full reward).
            out[str(task.task_id)] = result.failure_mode is None and result.reward >= 1.0
            answers.append((answer, task))
    return out, answers


def _responses_input(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A task's chat messages as the Responses input items an agent would send."""
    items: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
            continue
        if m.get("content"):
            items.append({"role": m["role"], "content": m["content"]})
        items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                   "arguments": c["function"]["arguments"]} for c in m.get("tool_calls") or ()]
    return items


def _served_by_responses(base_url: str, tasks: list[TaskSpec], settings: Settings
                         ) -> tuple[dict[str, bool], list[tuple[Any, TaskSpec]]]:
    """The same tasks through `POST /v1/responses` (`client.responses.create`, flat function
    tools), the answer's `function_call` items scored by the same verifier."""
    env = load_environment("tool_call")
    out: dict[str, bool] = {}
    answers = []
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=TOKEN, max_retries=0,
                       timeout=600) as client:
        for task in tasks:
            answer = client.responses.create(
                model="production", input=_responses_input(task.messages),
                tools=[{"type": "function", "name": t["name"], "description": t["description"],
                        "parameters": t["parameters"]} for t in task.tools],
                temperature=0, max_output_tokens=settings.rollout.max_tokens,
                extra_body={"seed": settings.gate.seed ^ zlib.crc32(task.task_id.bytes),
                            "return_token_ids": True})
            calls = [{"id": o.call_id, "type": "function",
                      "function": {"name": o.name, "arguments": o.arguments}}
                     for o in answer.output if o.type == "function_call"]
            message: dict[str, Any] = {"role": "assistant", "content": answer.output_text or None}
            if calls:
                message["tool_calls"] = calls
            message = {k: v for k, v in message.items() if v is not None}
            result = env.verify(task.verifier, message, tools=task.tools)
            out[str(task.task_id)] = result.failure_mode is None and result.reward >= 1.0
            answers.append((answer, task))
    return out, answers


async def test_production_answers_score_as_the_gate_measured(db_url: str,
                                                             tmp_path: Path) -> None:
    from flywheel.gate.candidate import GateService
    from flywheel.policy.local import LocalPolicy

    started = time.perf_counter()
    s = _settings(db_url, tmp_path / "home")
    engine = make_engine(db_url)
    async with engine.begin() as conn:
        for task in HOLDOUT:
            await store_task(conn, task, uuid.uuid4(), "human_correction", s.topics)
        await freeze_eval_set(conn, s.topics)
    desk = await registered("desk", PythonClass(target=DESK))
    catalog, episodes = Catalog.of([desk]), _episodes(desk)
    losses = await asyncio.to_thread(_warm_start, tmp_path / "sft")
    await register_version(s, engine, 1, tmp_path / "sft", stage="sft")
    t_sft = time.perf_counter()

    policy = LocalPolicy(resolve_model_dir(None))
    try:
        gate = GateService(s, engine, policy)
        events = await gate.evaluate_version(1)
        async with engine.connect() as conn:
            record = (await conn.execute(text(
                "SELECT record FROM evaluations WHERE version = 1"))).scalar_one()
            holdout = await load_holdout(conn)
        assert [e.type for e in events] == ["AdapterEvaluated", "AdapterPromoted"], \
            f"the warm-started version was not promoted: {record['reasons']} (losses {losses})"
        gated = await gate.run_for(1, holdout, 1)  # production as the gate measured it (cached)
        fmt = policy.chat_format
        prompts = {str(t.task_id): fmt.render(task_messages(t), task_tools(t))
                   for t in holdout.tasks}
        # Episodes: production's rollouts of them exactly as the gate samples and scores them
        # (its group config, round seed and adapter; one greedy attempt each).
        adapter = await gate._adapter(1)
        gated_episodes = {}
        for task in episodes:
            outcome = await scored_group(policy, task, ToolsetEnvironment(catalog),
                                         gate_evaluate._config(s), s, adapter=adapter,
                                         seed=round_seed(s, task, 0),
                                         group_key=f"eval-{task.task_id}-r0")
            (gated_episodes[task.task_id],) = outcome.rollouts
    finally:
        await policy.close()
    t_gate = time.perf_counter()

    with live_api(s) as url:
        served, answers = await asyncio.to_thread(_served_success, url, holdout.tasks, s)
        by_responses, responses = await asyncio.to_thread(_served_by_responses, url,
                                                          holdout.tasks, s)
        t_served = time.perf_counter()
        served_episodes = {t.task_id: await _served_episode(url, t, catalog, s)
                           for t in episodes}
    t_episodes = time.perf_counter()
    await catalog.aclose()
    await engine.dispose()

    gated_by_task = {a.task: a.success for a in gated.attempts}
    gated_rate = metrics(gated).success_rate
    served_rate = sum(served.values()) / len(served)
    misses = [(t.messages[-1]["content"], a.choices[0].message.tool_calls
               or a.choices[0].message.content) for a, t in answers if not served[str(t.task_id)]]
    report = (f"gated {gated_rate:.3f} (record {record['candidate']['success_rate']:.3f}, base "
              f"{record['baseline']['success_rate']:.3f}) served {served_rate:.3f} on "
              f"{len(served)} tasks; per task gated {list(gated_by_task.values())} served "
              f"{[served[k] for k in gated_by_task]}; served misses {misses}; SFT losses "
              f"{[round(x, 3) for x in losses]}; {time.perf_counter() - started:.0f}s (SFT "
              f"{t_sft - started:.0f}, gate {t_gate - t_sft:.0f}, served {t_served - t_gate:.0f}, "
              f"served episodes {t_episodes - t_served:.0f})")
    print(report)
    assert record["candidate"]["success_rate"] == gated_rate
    assert gated_rate > 0 and served_rate > 0, report  # a comparison of zeros means nothing
    assert 0 < served_rate < 1, report  # the cut create_ticket calls fail on both sides
    # Greedy on both sides: they agree task by task, not only on the rate.
    assert set(gated_by_task) == set(served) == {str(t.task_id) for t in holdout.tasks}
    assert gated_by_task == served, report
    for answer, task in answers:
        assert answer.model == "policy@v1", answer.model
        assert answer.model_extra["prompt_token_ids"] == prompts[str(task.task_id)]
    # The Responses API answers task by task as Chat Completions does, from the same prompts.
    assert by_responses == served, (by_responses, report)
    for response, task in responses:
        assert response.model == "policy@v1", response.model
        assert response.model_extra["prompt_token_ids"] == prompts[str(task.task_id)]
    # Episodes: the agent's own loop over the API gets, turn by turn, what the gate rolled
    # out — the same prompt ids (the answers and tool messages sent back as the client sends
    # them), the same tokens, the same verdict.
    for task in episodes:
        gated_ep, served_ep = gated_episodes[task.task_id], served_episodes[task.task_id]
        shown = [(len(t.prompt_token_ids), fmt.tokenizer.decode(t.token_ids))
                 for t in gated_ep.turns]
        assert [t.prompt_token_ids for t in served_ep.turns] == \
            [t.prompt_token_ids for t in gated_ep.turns], shown
        assert [t.token_ids for t in served_ep.turns] == [t.token_ids for t in gated_ep.turns]
        assert (served_ep.reward, served_ep.failure_mode, served_ep.reason) == \
            (gated_ep.reward, gated_ep.failure_mode, gated_ep.reason), shown
    # ...and the comparison is of whole episodes: calls made and their results sent back in
    # for a later turn. (This adapter, at 40 tokens, keeps calling tools to the budget and
    # never answers, so the scripted user's turn is not reached here; the loop above sends it
    # as the rollouts do, and tests/test_environments_episode.py covers that turn.)
    turns = [t for task in episodes for t in gated_episodes[task.task_id].turns]
    assert any("<tool_call>" in fmt.tokenizer.decode(t.token_ids) for t in turns), turns
    assert any(len(gated_episodes[t.task_id].turns) >= 2 for t in episodes)
