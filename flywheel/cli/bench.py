"""`flywheel bench …`: benchmarks, each a ratio against a baseline measured in the same run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from flywheel.cli.common import JsonOpt, fail, load_settings, print_result

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (ratios against a baseline "
                        "measured in the same run).")


@bench_app.command("ingest")
def bench_ingest(
    n: Annotated[int, typer.Option(help="Trajectories to push through.")] = 50_000,
    workers: Annotated[int, typer.Option(help="Ingest processes (one consumer group).")] = 1,
    as_json: JsonOpt = False,
) -> None:
    """Producer → Kafka → Postgres until every row is durable, against raw COPY."""
    from flywheel.bench.ingest import run_bench

    result = run_bench(n, workers=workers, progress=not as_json)
    print_result(result, as_json)


@bench_app.command("otlp")
def bench_otlp(
    n: Annotated[int, typer.Option(help="Conversations (4 spans each) per leg.")] = 2000,
    batch: Annotated[int, typer.Option(help="Conversations per request.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """OTLP spans → /v1/traces → Postgres, against the gateway's trajectories/s, one run."""
    from flywheel.bench.otlp import run_bench

    print_result(run_bench(n, batch=batch), as_json)


@bench_app.command("rollout")
def bench_rollout(
    groups: Annotated[int, typer.Option(help="Groups to sample on each side.")] = 6,
    group_size: Annotated[int, typer.Option(help="G: completions per group.")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Token limit per completion.")] = 32,
    worker: Annotated[bool, typer.Option(
        help="Also run the groups through the rollout worker (Kafka, Postgres).")] = True,
    engine: Annotated[str, typer.Option(help="`worker`: the rollout worker vs the configured "
                                        "engine called directly; `vllm`: vLLM vs the local "
                                        "engine on the same groups.")] = "worker",
    vllm_url: Annotated[str | None, typer.Option(help="With --engine vllm: a running "
                                                 "server (default: start one, then stop it)."
                                                 )] = None,
    lora: Annotated[bool, typer.Option(help="With --engine vllm: also through a LoRA "
                                       "version.")] = False,
    gpu: Annotated[bool, typer.Option(help="With --engine vllm: start vLLM with the GPU "
                                      "flags.")] = False,
    in_flight: Annotated[int | None, typer.Option(
        "--in-flight", help="Instead: groups/s of the configured engine with this many "
        "groups in flight vs one at a time (same tasks and seeds).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Groups through the rollout worker vs the engine directly, and the engine with prompts
    shared vs run in full (same prompts and seeds); or (`--engine vllm`) vLLM vs the local
    engine on the same groups; or (`--in-flight N`) N groups at once vs one at a time."""
    if engine == "vllm":
        from flywheel.bench.engines import run_engine_bench
        from flywheel.stack.vllm_server import VLLMStartError

        try:
            result = run_engine_bench(groups, group_size=group_size, max_tokens=max_tokens,
                                      vllm_url=vllm_url, lora=lora, gpu=gpu)
        except VLLMStartError as err:
            fail(str(err))
        print_result(result, as_json)
        return
    if engine != "worker":
        fail(f"--engine must be worker or vllm, not {engine!r}")
    if in_flight is not None:
        from flywheel.bench.inflight import run_inflight_rollout_bench

        print_result(run_inflight_rollout_bench(groups=groups, inflight=in_flight,
                                                group_size=group_size, max_tokens=max_tokens,
                                                settings=load_settings()), as_json)
        return
    from flywheel.bench.rollout import run_bench

    result = run_bench(groups, group_size=group_size, max_tokens=max_tokens, worker=worker)
    print_result(result, as_json)


@bench_app.command("gate")
def bench_gate(
    tasks: Annotated[int, typer.Option(help="Holdout tasks of each set.")] = 24,
    inflight: Annotated[int, typer.Option(help="Tasks in flight on the new path.")] = 64,
    rounds: Annotated[int, typer.Option(help="Gate rounds on each side.")] = 1,
    as_json: JsonOpt = False,
) -> None:
    """Samples/s of gate rounds on the same holdouts (the demo's tasks; the same with large
    tool schemas): one task after another vs all in flight, on the configured engine."""
    from flywheel.bench.inflight import run_gate_bench

    print_result(run_gate_bench(tasks=tasks, inflight=inflight, rounds=rounds,
                                settings=load_settings()), as_json)


@bench_app.command("learning")
def bench_learning(
    steps: Annotated[int, typer.Option(help="GRPO steps.")] = 30,
    tasks: Annotated[int, typer.Option(help="Fixed tool_call tasks.")] = 6,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 2e-4,
    sft_steps: Annotated[int, typer.Option(
        help="SFT warm-start steps before GRPO, on demonstrations of other requests (the "
             "untuned model calls no tool, so GRPO alone has no signal).")] = 12,
    max_tokens: Annotated[int, typer.Option(
        help="Most tokens per completion (a tool call in the chat format is 40-50).")] = 64,
    heldout_tasks: Annotated[int, typer.Option(
        help="Requests never trained on, for GRPO's gain over its start.")] = 25,
    heldout_samples: Annotated[int, typer.Option(
        help="Samples per held-out request and side (tasks × samples ≥ 200).")] = 8,
    as_json: JsonOpt = False,
) -> None:
    """Mean reward on fixed tasks: base policy [vs SFT] vs after K GRPO steps (local engine),
    and GRPO's gain over its start on ≥ 200 held-out samples with 95% intervals."""
    from flywheel.bench.learning import run_learning

    if heldout_tasks * heldout_samples < 200:
        fail(f"--heldout-tasks × --heldout-samples is {heldout_tasks * heldout_samples}: "
              "use at least 200 held-out samples")
    result = run_learning(steps, tasks=tasks, lr=lr, sft_steps=sft_steps,
                          max_tokens=max_tokens, heldout_tasks=heldout_tasks,
                          heldout_samples=heldout_samples)
    print_result(result, as_json)


@bench_app.command("prefix")
def bench_prefix(
    batch: Annotated[int, typer.Option(help="B: prompts (groups) per step.")] = 4,
    group_size: Annotated[int, typer.Option(help="G: completions per prompt.")] = 8,
    tokens: Annotated[int, typer.Option(help="Tokens per completion.")] = 32,
    repeats: Annotated[int, typer.Option(help="Timed runs per side (best counts).")] = 1,
    as_json: JsonOpt = False,
) -> None:
    """A GRPO and an SFT step: each prompt run once vs every prompt + completion in full."""
    from flywheel.bench.prefix import run_prefix_bench

    print_result(run_prefix_bench(batch=batch, group_size=group_size, tokens=tokens,
                                  repeats=repeats), as_json)


@bench_app.command("trainer")
def bench_trainer(
    steps: Annotated[int, typer.Option(help="GRPO steps on each side.")] = 3,
    batch: Annotated[int, typer.Option(help="B: trainable groups per step.")] = 2,
    group_size: Annotated[int, typer.Option(help="G: completions per group.")] = 8,
    max_tokens: Annotated[int, typer.Option(
        help="Token limit per completion (a tool call in the chat format is 40-50).")] = 64,
    staleness: Annotated[int, typer.Option(help="Versions sampling may run ahead of "
                                           "training.")] = 1,
    sequential: Annotated[bool, typer.Option(help="Also time the same pipeline without "
                                             "overlap (all cores per phase).")] = True,
    trl: Annotated[bool, typer.Option(help="Also run TRL's GRPOTrainer (the baseline).")] = True,
    in_flight: Annotated[int | None, typer.Option(
        help="Groups sampled at once (default: rollout.max_inflight_groups, as a rollout "
             "worker).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """K GRPO steps: Flywheel's overlapped sampling + training vs TRL's GRPOTrainer (CPU)."""
    from flywheel.bench.trainer import run_trainer_bench

    if min(steps, batch, staleness) < 1 or (in_flight is not None and in_flight < 1) \
            or group_size < 2:
        fail("--steps, --batch, --staleness and --in-flight must be ≥ 1, --group-size ≥ 2")
    result = run_trainer_bench(steps, batch=batch, group_size=group_size,
                               max_tokens=max_tokens, staleness=staleness,
                               sequential=sequential, trl=trl, inflight=in_flight)
    print_result(result, as_json)


@bench_app.command("tools")
def bench_tools(
    calls: Annotated[int, typer.Option(help="Sequential calls per round-trip leg.")] = 300,
    episodes: Annotated[int, typer.Option(help="Scripted episodes per throughput leg.")] = 64,
    in_flight: Annotated[int, typer.Option(help="N: episodes in flight.")] = 32,
    sessions: Annotated[int, typer.Option(
        help="stdio sessions (a server process each) held for the memory figure.")] = 32,
    as_json: JsonOpt = False,
) -> None:
    """Toolset sessions on the workplace world: one call's round trip over MCP stdio and
    HTTP against the Python toolset, episodes/s with N in flight vs one at a time, and the
    memory of N stdio sessions in flight."""
    from flywheel.bench.tools import run_tools_bench

    print_result(run_tools_bench(calls=calls, episodes=episodes, in_flight=in_flight,
                                 sessions=sessions), as_json)


@bench_app.command("episodes")
def bench_episodes(
    tasks: Annotated[int, typer.Option(help="Failures mined both ways (pairs of tasks).")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the simulated helpdesk traffic.")] = 5,
    adapter: Annotated[Path | None, typer.Option(
        help="A saved LoRA adapter directory to sample instead of the base model (e.g. an "
             "SFT checkpoint that works several turns).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """What a whole episode costs against the single step it replaced: the same simulated
    failures mined as episode tasks and as single-step tasks, the same engine and group
    config: seconds per group and per gate round, turns and tokens per attempt."""
    from flywheel.bench.episodes import run_episodes_bench
    from flywheel.policy.base import PolicyError

    try:  # the engine checks the adapter directory when it loads it
        result = run_episodes_bench(tasks=tasks, seed=seed, adapter=adapter)
    except PolicyError as err:
        fail(str(err))
    print_result(result, as_json)


@bench_app.command("episode-learning")
def bench_episode_learning(
    seed: Annotated[int, typer.Option(help="Seed of the simulated helpdesk traffic.")] = 11,
    holdout_tasks: Annotated[int, typer.Option(help="Holdout episodes rolled out.")] = 20,
    samples: Annotated[int, typer.Option(help="Attempts per holdout episode.")] = 4,
    sft_steps: Annotated[str, typer.Option(help="SFT checkpoints to evaluate, e.g. 12,24.")
                         ] = "12,24",
    base: Annotated[bool, typer.Option(help="Evaluate the base model first.")] = True,
    grpo_steps: Annotated[int, typer.Option(help="GRPO steps after the last SFT checkpoint."
                                            )] = 0,
    grpo_batch: Annotated[int, typer.Option(help="Groups per GRPO step.")] = 2,
    as_json: JsonOpt = False,
) -> None:
    """Simulated helpdesk failures mined as episode tasks: holdout episode success of the
    base model, after an SFT warm start on the train episodes' corrections and the agent's
    successes, and after GRPO on the train episodes, paired, with McNemar's p."""
    from flywheel.bench.episode_learning import run_episode_learning

    steps = tuple(int(x) for x in sft_steps.split(",") if x.strip())
    print_result(run_episode_learning(seed=seed, holdout_tasks=holdout_tasks, samples=samples,
                                      sft_steps=steps, base=base, grpo_steps=grpo_steps,
                                      grpo_batch=grpo_batch), as_json)


@bench_app.command("outside")
def bench_outside(
    api: Annotated[str | None, typer.Option(help="Base URL of the API (default: the local "
                                            "stack's).")] = None,
    api_key: Annotated[str | None, typer.Option(
        envvar="OPENAI_API_KEY", help="Bearer token with the publish scope (default: the "
        "local stack's publish token).")] = None,
    before: Annotated[str, typer.Option(help="The model compared against.")] = "base",
    after: Annotated[str, typer.Option(help="The model measured.")] = "production",
    mcp: Annotated[str | None, typer.Option(
        help="Command of the MCP server the agent runs the tools on (stdio; default: the "
             "example server, the workplace world).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the simulated helpdesk traffic the "
                                      "held-out episodes are mined from.")] = 29,
    episodes: Annotated[int, typer.Option(help="Held-out episodes run.")] = 20,
    samples: Annotated[int, typer.Option(help="Attempts per episode and model.")] = 2,
    temperature: Annotated[float | None, typer.Option(
        help="Sampling temperature (default: the gate's).")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        help="Token limit of a reply (default: the rollouts' for a turn of an episode).")
    ] = None,
    in_flight: Annotated[int, typer.Option(help="Attempts run at once.")] = 8,
    as_json: JsonOpt = False,
) -> None:
    """Held-out episodes measured from outside: an agent loop with the official `openai`
    client against /v1/chat/completions, executing the tools itself on an MCP server, for
    two models (default base and production), attempts paired by seed: success of each,
    the gain with a bootstrap interval and McNemar's p."""
    from flywheel.bench.outside import run_outside
    from flywheel.runtime.endpoints import StackNotRunning, resolve_api_url

    settings = load_settings()
    try:
        url = api or resolve_api_url(settings)
    except StackNotRunning as err:
        fail(str(err))
    key = api_key or _publish_token(settings)
    if key is None:
        fail("no token: pass --api-key (a token with the publish scope)")
    print_result(run_outside(api_url=url, api_key=key, before=before, after=after, mcp=mcp,
                             seed=seed, episodes=episodes, samples=samples,
                             temperature=temperature, max_tokens=max_tokens,
                             in_flight=in_flight), as_json)


def _publish_token(settings: Any) -> str | None:
    """A configured token with the publish scope, else the local stack's (tokens.json)."""
    import json

    from flywheel.config import ApiSettings

    tokens = settings.api.tokens
    path = settings.home / "tokens.json"
    if not tokens and path.exists():  # read through the settings model: grants one shape
        tokens = ApiSettings(tokens=json.loads(path.read_text())).tokens
    return next((token for token, grant in tokens.items()
                 if "publish" in (grant if isinstance(grant, list) else grant.scopes)), None)


@bench_app.command("gpu", context_settings={"allow_extra_args": True,
                                           "ignore_unknown_options": True})
def bench_gpu(ctx: typer.Context) -> None:
    """The GPU path on random-init models of given shapes: engine tokens/s (1/16/64 groups in
    flight) against `generate` and the memory/compute bounds, and the bf16 trainer step
    against fp32; one JSON. Options: `python -m flywheel.bench.gpu --help` (the same command,
    for a machine with only torch, transformers and peft: infra/gpu-check.sh)."""
    from flywheel.bench.gpu import main

    main(list(ctx.args))


@bench_app.command("grammar")
def bench_grammar(
    requests: Annotated[int, typer.Option(help="B: requests (the demo's tool_call tasks).")] = 8,
    group_size: Annotated[int, typer.Option(help="G: rows per request.")] = 4,
    max_tokens: Annotated[int, typer.Option(help="Token limit per row.")] = 64,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0: greedy).")] = 1.0,
    repeats: Annotated[int, typer.Option(help="Timed runs per side (best counts).")] = 2,
    as_json: JsonOpt = False,
) -> None:
    """`tool_choice: required` on the local engine: tokens/s under the call grammar vs the
    same requests without it, and how many rows answered with a valid call on each side."""
    from flywheel.bench.grammar import run_grammar_bench

    if min(requests, group_size, max_tokens, repeats) < 1:
        fail("--requests, --group-size, --max-tokens and --repeats must be ≥ 1")
    print_result(run_grammar_bench(requests=requests, group_size=group_size,
                                   max_tokens=max_tokens, temperature=temperature,
                                   repeats=repeats), as_json)
