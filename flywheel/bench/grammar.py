"""`flywheel bench grammar`: what decoding `tool_choice: required` under the call grammar costs
the local engine, against the same requests decoded without it.

The same B requests (the demo's tool_call tasks: its tools, one request each), the same
prefill (the call opening `required` writes), G rows each, on the in-process engine: once
with the call grammar (`SamplingParams.grammar`: every row's logits masked by its llguidance
matcher at every step) and once without (the prefill alone, which is how `required` was
served before). Generated tokens per second of wall time on each side, best of `repeats`
runs after a warm-up (the first constrained request also builds llguidance's tokenizer,
reported apart); and how many rows of each side answered with a call to an offered tool
whose arguments validate against its schema, since that is what the mask buys.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any


def run_grammar_bench(*, requests: int = 8, group_size: int = 4, max_tokens: int = 64,
                      temperature: float = 1.0, repeats: int = 2) -> dict[str, Any]:
    return asyncio.run(_run(requests, group_size, max_tokens, temperature, repeats))


async def _run(requests: int, group_size: int, max_tokens: int, temperature: float,
               repeats: int) -> dict[str, Any]:
    import jsonschema

    from flywheel.bench.learning import fixed_tasks
    from flywheel.environments.prompt import task_messages, task_tools
    from flywheel.policy.base import SamplingParams
    from flywheel.policy.chat_format import openai_tools
    from flywheel.policy.local import LocalPolicy
    from flywheel.policy.model_cache import resolve_model_dir
    from flywheel.policy.tool_choice import decoding

    policy = LocalPolicy(resolve_model_dir(None), max_batch=max(8, group_size),
                         max_rows=requests * group_size)
    try:
        tasks = fixed_tasks(requests)
        prompts = [task_messages(t) for t in tasks]
        tools = openai_tools(task_tools(tasks[0])) or []
        fmt = policy.chat_format
        d = decoding(fmt, prompts[0], tools, "required", parallel=False)
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}

        def valid(text: str) -> bool:
            calls = fmt.parse(d.prefill + text)["tool_calls"]
            if not calls:
                return False
            for call in calls:
                fn = call["function"]
                if fn["name"] not in schemas:
                    return False
                try:
                    jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])
                except jsonschema.ValidationError:
                    return False
            return True

        async def side(grammar: str | None, seed: int) -> tuple[float, int, int]:
            params = SamplingParams(n=group_size, max_tokens=max_tokens, temperature=temperature,
                                    seed=seed, prefill=d.prefill, grammar=grammar)
            started = time.perf_counter()
            groups = await policy.sample_many(prompts, params, tools=tools)
            wall = time.perf_counter() - started
            rows = [c for g in groups for c in g]
            return wall, sum(len(c.token_ids) for c in rows), sum(valid(c.text) for c in rows)

        started = time.perf_counter()
        await side(d.grammar, 0)  # warm-up; builds llguidance's view of the tokenizer
        first_constrained_s = time.perf_counter() - started
        await side(None, 0)
        out: dict[str, Any] = {}
        for name, grammar in (("grammar", d.grammar), ("no_grammar", None)):
            best: tuple[float, int, int] | None = None
            for r in range(repeats):
                wall, tokens, ok = await side(grammar, 1 + r)
                if best is None or tokens / wall > best[1] / best[0]:
                    best = (wall, tokens, ok)
            assert best is not None
            wall, tokens, ok = best
            out[name] = {"tokens_per_s": round(tokens / wall, 1), "tokens": tokens,
                         "wall_s": round(wall, 2),
                         "valid_calls": f"{ok}/{requests * group_size}"}
        ratio = out["grammar"]["tokens_per_s"] / out["no_grammar"]["tokens_per_s"]
        return {"requests": requests, "group_size": group_size, "max_tokens": max_tokens,
                "temperature": temperature, "repeats": repeats, "tools": len(tools),
                **out, "grammar_vs_no_grammar_tokens_per_s": round(ratio, 3),
                "first_constrained_request_s": round(first_constrained_s, 2)}
    finally:
        await policy.close()
