"""Every turn of an episode is trained on the exact prompt ids it was sampled after — also
where the chat template is not prefix-preserving across turns. The template here drops
earlier turns' reasoning (`<think>…</think>`, as reasoning models' templates do), so turn
k+1's prompt is *not* turn k's prompt + completion + the tool result: a trainer that
re-tokenised the conversation would train tokens the model never saw. The episode runs on
the workplace toolset with a scripted user (whose words are prompt, never trained)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest

from flywheel.environments.toolset import ToolsetEnvironment
from flywheel.events import GroupScoredPayload
from flywheel.mining.episodes import toolset_tools
from flywheel.policy.base import AdapterRef, Completion, SamplingParams
from flywheel.policy.chat_format import ChatFormat, bundled_template, load_chat_format
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.tasks import EpisodeSpec, ExpectedCall, TaskSpec
from flywheel.tools.runtime import Catalog
from flywheel.toolsets import PythonClass
from flywheel.trainer.engine import samples_from_groups
from flywheel.trainer.grpo import GRPOConfig
from tests.support.scripted import Lockstep, tool_call
from tests.support.toolsets import registered

WORKPLACE = "flywheel.environments.workplace_tools:WorkplaceTools"
KEEP = ("{%- set content = message['content'] if message['content'] is defined and "
        "message['content'] is string else '' -%}")
DROP = KEEP + ("{%- if not loop.last and '</think>' in content -%}"
               "{%- set content = content.split('</think>')[-1] | trim -%}{%- endif -%}")
USER2 = "Now email ana@example.com about it."
REPLIES = ["<think>A ticket first.</think>\n" + tool_call("tickets_create", title="printer",
                                                           priority=2),
           "<think>It was filed.</think>Filed.",
           "<think>Now the email.</think>\n" + tool_call("email_send", to="ana@example.com",
                                                         subject="printer"),
           "Emailed Ana."]


@pytest.fixture(scope="module")
def drops_reasoning() -> ChatFormat:
    stock = load_chat_format(resolve_model_dir(None))
    template = bundled_template().read_text()
    assert KEEP in template
    return ChatFormat(stock.tokenizer, name="drops-reasoning",
                      chat_template=template.replace(KEEP, DROP),
                      response_template=stock.response_template)


class Tokenized(Lockstep):
    """The script's replies as real token ids (as an engine samples them)."""

    async def sample(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams, *,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     adapter: AdapterRef | None = None) -> list[Completion]:
        out = await super().sample(messages, params, tools=tools, adapter=adapter)
        fmt = self.chat_format
        return [replace(c, token_ids=ids, logprobs=[-0.5] * len(ids))
                for c in out for ids in [fmt.encode(c.text + fmt.end_of_turn)]]


def _startswith(ids: list[int], prefix: list[int]) -> bool:
    return ids[:len(prefix)] == prefix


async def test_each_turn_trains_on_its_sampled_prompt_ids_not_a_retokenised_conversation(
        drops_reasoning: ChatFormat) -> None:
    fmt = drops_reasoning
    reg = await registered("workplace", PythonClass(target=WORKPLACE))

    async def reply(messages: list[dict[str, Any]], _seed: int | None, _i: int) -> str:
        return REPLIES[sum(1 for m in messages if m["role"] == "assistant")]

    spec = EpisodeSpec(toolset="workplace", initial_state={}, check_state=True,
                       user_turns=[USER2], reference_calls=[
                           ExpectedCall(name="tickets_create",
                                        arguments={"title": "printer", "priority": 2}),
                           ExpectedCall(name="email_send",
                                        arguments={"to": "ana@example.com",
                                                   "subject": "printer"})])
    task = TaskSpec(task_id=uuid.uuid4(), env="toolset", tools=toolset_tools(reg),
                    messages=[{"role": "user", "content": "File a P2 ticket: printer."}],
                    verifier=spec, failure_mode="incomplete", fingerprint="p", split="train")
    policy = Tokenized(reply, fmt)
    catalog = Catalog.of([reg])
    try:
        out = await run_group(policy, task, ToolsetEnvironment(catalog),
                              GroupConfig(group_size=2, rollout_timeout_s=30, max_steps=6),
                              adapter=None, seed=0, group_key="prompts")
    finally:
        await catalog.aclose()
    assert [r.reward for r in out.rollouts] == [1.0, 1.0]
    group = GroupScoredPayload(group_id=uuid.uuid4(), task_id=task.task_id, env="toolset",
                               adapter=None, adapter_version=None, temperature=1.0,
                               rollouts=out.rollouts, reward_mean=1.0, reward_std=0.0,
                               trainable=True, worker="test")
    samples = samples_from_groups([group], GRPOConfig())
    turns = out.rollouts[0].turns
    assert len(turns) == 4 and len(samples) == 8  # every turn of both episodes
    sent = [m for m, _ in policy.sent][::2]  # the lockstep batch sends both episodes in turn
    for k, (sample, turn) in enumerate(zip(samples[:4], turns, strict=True)):
        # Trained on exactly the ids sampled after, which are the prompt as rendered then.
        assert sample.prompt_ids == turn.prompt_token_ids == fmt.render(sent[k], task.tools)
        assert sample.completion_ids == turn.token_ids == fmt.encode(REPLIES[k]
                                                                     + fmt.end_of_turn)
    for k in range(1, 4):
        before = samples[k - 1].prompt_ids + samples[k - 1].completion_ids
        # The template is not prefix-preserving: the turn before, as sampled, is not how
        # this prompt renders it — re-tokenising the conversation would train other text.
        assert not _startswith(samples[k].prompt_ids, before)
    assert "A ticket first." in fmt.tokenizer.decode(samples[0].completion_ids)
    assert "A ticket first." not in fmt.tokenizer.decode(samples[1].prompt_ids)
    # The scripted user's words are in prompts only, never in what is trained.
    assert USER2 in fmt.tokenizer.decode(samples[2].prompt_ids)
    assert all(USER2 not in fmt.tokenizer.decode(s.completion_ids) for s in samples)
