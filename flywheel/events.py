"""Every event in the system: frozen pydantic models in one union discriminated on `type`.

An event is immutable: appended to the `events` table and published through the outbox in the
same transaction as the domain write it describes. `aggregate_id` is the Kafka key, so one
aggregate's events stay ordered. Later stages add their events here.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

# Namespace of event ids derived from their cause (a Kafka position, …), so that re-processing
# the same input yields the same event id and the append is a no-op.
EVENT_ID_NAMESPACE = uuid.UUID("0d5e3f8a-7c41-4b8e-b1c2-5a6f9e2d4c37")
TOOL_OUTPUT_CHARS = 300
"""How much of a tool result a `ToolStep` keeps."""


def derived_event_id(*parts: object) -> uuid.UUID:
    return uuid.uuid5(EVENT_ID_NAMESPACE, "/".join(str(p) for p in parts))


def storable_text(s: str) -> str:
    """Text Postgres takes (`text`, `jsonb`): an error message may quote the very input that
    was refused (a NUL, a lone surrogate), which must not make its dead letter unwritable."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def preview(value: bytes) -> str:
    """A dead letter's `raw_preview`: the first KiB of the message as storable text."""
    return storable_text(value[:1024].decode("utf-8", errors="replace"))


class _Payload(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    occurred_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    schema_version: int = 1
    aggregate_id: str


class DeadLetterPayload(_Payload):
    source_topic: str
    partition: int
    offset: int
    reason: Literal["not_json", "schema", "too_large", "unstorable"]
    """`unstorable`: Postgres refused a record validation let through (reported as a bug)."""
    error: str
    size_bytes: int
    raw_preview: str
    """The first KiB of the payload as text (the whole payload is in `dead_letters.raw`)."""


class DeadLettered(_Event):
    """An input could not be accepted; it was stored in `dead_letters` and sent to the DLQ."""

    type: Literal["DeadLettered"] = "DeadLettered"
    payload: DeadLetterPayload


class RecordParkedPayload(_Payload):
    consumer: str
    """Which consumer gave up on the record: `miner`, `feedback` (the miner's feedback
    subscriber), `rollout`, `trainer`, `gate`."""
    source_topic: str
    partition: int
    offset: int
    reason: Literal["permanent", "bug"]
    """`permanent`: bad input or a broken invariant; `bug`: an error in our code, still
    failing after its retries (the error ends with where it was raised)."""
    error: str
    size_bytes: int
    raw_preview: str
    """The first KiB of the message as text (the whole message is in `dead_letters.raw`)."""


class RecordParked(_Event):
    """A consumer could not process a message (not a transient failure: those are retried),
    stored it in `dead_letters` under its own name and moved on to the next one."""

    type: Literal["RecordParked"] = "RecordParked"
    payload: RecordParkedPayload


class IngestedRange(_Payload):
    topic: str
    partition: int
    first_offset: int
    last_offset: int


class TrajectoriesIngestedPayload(_Payload):
    inserted: int
    """New rows (re-delivered duplicates excluded)."""
    duplicates: int
    failures: int
    """How many of the inserted trajectories are failures (miner input)."""
    dead_lettered: int
    ranges: list[IngestedRange]
    replaced: int = 0
    """OTel trajectories stored again with more spans (late spans merged): not new rows."""


class TrajectoriesIngested(_Event):
    """A batch of trajectories became durable in Postgres."""

    type: Literal["TrajectoriesIngested"] = "TrajectoriesIngested"
    payload: TrajectoriesIngestedPayload


class FeedbackReceivedPayload(_Payload):
    feedback_id: uuid.UUID
    trajectory_id: uuid.UUID
    """The stored trajectory it was applied to (named by id or by `request_id`)."""
    request_id: str | None
    previous_status: str
    """The trajectory's status before: an outcome status or `awaiting_outcome`."""
    status: str
    """Its status with this feedback applied (what the miner mined it as)."""
    rating: Literal["up", "down"] | None
    correction: bool
    """Whether it carried a correction (the calls the agent should have made)."""
    structured: bool
    """Whether it carried structured feedback (`{"expected_call": …}`)."""


class FeedbackReceived(_Event):
    """Feedback was applied to a stored trajectory, which was mined again with it (feedback
    that names a trajectory not stored yet waits in `feedback` and is applied on arrival)."""

    type: Literal["FeedbackReceived"] = "FeedbackReceived"
    payload: FeedbackReceivedPayload


class TaskCreatedPayload(_Payload):
    task_id: uuid.UUID
    env: str
    failure_mode: str
    split: Literal["train", "holdout"]
    fingerprint: str
    source_trajectory_id: uuid.UUID
    expected_from: str
    """Where the expected behaviour came from: human_correction, feedback, retry:<id>, tests."""


class TaskCreated(_Event):
    """A failure became a new verifiable task (duplicates only add a source, no event)."""

    type: Literal["TaskCreated"] = "TaskCreated"
    payload: TaskCreatedPayload


class EvalSetFrozenPayload(_Payload):
    version: int
    task_ids: list[uuid.UUID]


class EvalSetFrozen(_Event):
    """The holdout tasks of this moment became eval-set `version`, unchangeable from now on."""

    type: Literal["EvalSetFrozen"] = "EvalSetFrozen"
    payload: EvalSetFrozenPayload


class RolloutRequestedPayload(_Payload):
    request_id: uuid.UUID
    task_id: uuid.UUID
    adapter_version: int | None
    """Policy version to sample (None = the base model)."""


class RolloutRequested(_Event):
    """The scheduler asks for one group of attempts at a task."""

    type: Literal["RolloutRequested"] = "RolloutRequested"
    payload: RolloutRequestedPayload


class ToolStep(_Payload):
    """One tool call of a turn on a toolset (`flywheel.tools`): where its answer came from."""

    name: str
    source: Literal["replay", "live", "stub", "refused", "invalid"]
    """`replay`: the logged result; `live`: the backend ran it; `stub`: a dry run's recorded
    answer; `refused`: a destructive tool not allowed live (never executed); `invalid`:
    answered with an error without reaching the backend (an unknown tool, bad arguments)."""
    status: Literal["ok", "error", "timeout"]
    rule: Literal["live", "end", "mask"] | None = None
    """The replay rule that fired at this call (it left the logged path), if any."""
    unsafe: bool = False
    """A call to a destructive tool not allowed live: an unsafe action."""
    ms: float = 0.0
    output: str = ""
    """The answer the agent was given, cut to `TOOL_OUTPUT_CHARS` (what the gate's "what
    changed" shows of an episode)."""


class Turn(_Payload):
    """One model turn: exactly the tokens sampled and their sampling log-probs."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    tools: list[ToolStep] | None = None
    """The turn's tool calls on a toolset, in order (None: not a toolset episode)."""


class ScoredRollout(_Payload):
    index: int
    reward: float | None
    """None when the attempt did not run (then `not_run` says why)."""
    reward_components: dict[str, float]
    failure_mode: str | None
    not_run: str | None
    turns: list[Turn]
    latency_ms: float
    reason: str | None = None
    """The verifier's reason in words, where it gives one (episode tasks)."""


class GroupScoredPayload(_Payload):
    group_id: uuid.UUID
    task_id: uuid.UUID
    env: str
    adapter: str | None
    """Served name that sampled the group (`<policy>@v<N>`), None = base model."""
    adapter_version: int | None
    temperature: float
    rollouts: list[ScoredRollout]
    reward_mean: float | None
    reward_std: float | None
    trainable: bool
    worker: str


class GroupScored(_Event):
    """A group of G attempts was sampled and scored. Only trainable groups reach the trainer."""

    type: Literal["GroupScored"] = "GroupScored"
    payload: GroupScoredPayload


class AdapterTrainedPayload(_Payload):
    policy: str
    version: int
    parent_version: int | None
    path: str
    stage: Literal["sft", "grpo"]
    steps: int
    """Optimizer steps since the base model."""
    groups: int
    """Groups trained into this version since its parent (ids are in the manifest)."""
    stale_dropped: int
    metrics: dict[str, float]
    gate: bool = True
    """Proposed to the gate (status `candidate`). False: a snapshot (status `snapshot`) that
    rollouts sample so they stay on-policy, published while a candidate awaits the gate or
    before enough new training to be worth evaluating (`trainer.propose_min_groups`)."""


class AdapterTrained(_Event):
    """A new immutable adapter version was published (the gate evaluates it when `gate`)."""

    type: Literal["AdapterTrained"] = "AdapterTrained"
    payload: AdapterTrainedPayload


class GateMetrics(_Payload):
    """One side of a holdout evaluation (k samples per task, fixed seeds)."""

    version: int | None
    """Adapter version evaluated; None = the base model."""
    tasks: int
    samples: int
    """Scored samples: every attempt the model made, failures such as an empty or truncated
    reply included (only what the infrastructure failed to run is left out, in `not_run`)."""
    not_run: int
    success_rate: float
    mean_reward: float
    invalid_rate: float
    unsafe_rate: float
    latency_mean_ms: float
    latency_p95_ms: float
    tokens_per_task: float
    """Generated tokens per attempt at a task (all turns)."""
    tokens_per_turn: float | None = None
    """Generated tokens per assistant turn (attempts cut before a turn count as one): what
    the cost check compares, so that an episode taking the turns its task needs is not read
    as a cost regression. None in records written before it was kept."""
    groups: dict[str, float]
    """Success rate per task group: `env:<name>`, `tool:<expected tool>`, `mode:<failure>`."""
    group_samples: dict[str, int]
    failure_modes: dict[str, int] = Field(default_factory=dict)
    """Scored attempts per failure mode, every mode listed (`empty` = abstained, `truncated`
    = cut by max_tokens, `timeout` = sampled past the deadline, …); empty in old records."""
    not_run_kinds: dict[str, int] = Field(default_factory=dict)
    """`not_run` by kind of infrastructure failure (`crash`, `sandbox`, …)."""


class GateCheck(_Payload):
    """One line of the decision rule, with its numbers."""

    name: str
    passed: bool
    detail: str


class GatePower(_Payload):
    """What an eval set can see at the gate's budget (`flywheel.gate.power`).

    The unit is the (task, sample) pair: both sides sample the same task with the same
    sample index and seed, and on a frozen holdout those pairs are independent."""

    tasks: int
    samples_per_task: int
    """The budget k per task and side."""
    pairs: int
    """(task, sample) pairs at the budget: tasks × k."""
    alpha: float
    power: float
    min_gain: float
    design_gain: float
    """The gain the sequential test bets on (default 2 × min_gain)."""
    production_success: float | None
    discordance: float
    """Share of pairs where the two sides disagree, used in the MDE."""
    discordance_source: str
    """Where it came from, in words (observed pairs, production's own samples, assumed)."""
    mde: float
    """Minimum detectable gain: the smallest true gain in holdout success the gate promotes
    with probability `power` within the budget."""
    pairs_needed: int
    """Pairs the gate would need for an MDE at or below `design_gain`."""
    warning: str | None = None
    """Set when the MDE is above `design_gain`: the gate cannot see the gains it is asked
    to find."""


class GateRound(_Payload):
    """The sequential test after one round (cumulative counts of the paired outcomes)."""

    round: int
    pairs: int
    wins: int
    """Pairs where only the candidate succeeded."""
    losses: int
    """Pairs where only production succeeded."""
    ties: int
    gain: float
    bet: float
    """The test's bet on this round's pairs, fixed before they were seen."""
    e_value: float
    """Evidence that the candidate is better (promotion when ≥ 1/alpha)."""
    e_loss: float
    """Evidence that it is worse."""
    e_futility: float
    """Evidence that its gain is below `design_gain`."""


class GateSequential(_Payload):
    """How the sequential evaluation went and why it stopped."""

    rounds: list[GateRound]
    rounds_planned: int
    samples_per_task: int
    """Attempts per task and side it used."""
    pairs: int
    stop: Literal["win", "loss", "futility", "budget", "incomplete"]
    """`incomplete`: the test needed a round whose pairs the infrastructure could not
    complete (after retries); such an evaluation is never a promotion."""
    reason: str
    e_value: float
    threshold: float
    """1/alpha: an e-value this large means p ≤ alpha, at any round."""


class LatencyProbe(_Payload):
    """Paired latency probes: one task per round sampled on both sides back to back."""

    pairs: int
    candidate_p95_ms: float
    production_p95_ms: float
    candidate_mean_ms: float
    production_mean_ms: float


class BehaviourFigures(_Payload):
    """How one side answered its holdout attempts (`flywheel.gate.behaviour`)."""

    attempts: int
    """Attempts observed (with their replies kept)."""
    empty_rate: float
    """Share with no answer: an empty reply, or no output before the deadline."""
    truncated_rate: float
    """Share cut by `max_tokens`."""
    reply_chars: float
    """Mean reply length in characters (every turn's text)."""
    calls_per_turn: float
    """Tool calls per turn that calls at least one (spraying calls raises it; calling tools
    where the other side answered in prose does not)."""


class CanaryResult(_Payload):
    """One known output re-scored by the verifier the candidate is judged by."""

    env: str
    task_id: str
    canary: str
    """`reference` (known right) or a known-wrong kind: `wrong_tool`, `wrong_values`,
    `empty`, `prose`, `unsafe_call`, `json_near_miss`, `extra_call`, … (see
    `flywheel.gate.canaries`)."""
    expect: Literal["success", "failure", "unsafe"]
    ok: bool
    got: str
    """What the verifier said, in words (reward, failure mode or why it did not score)."""


class GateCanaries(_Payload):
    """Verifier canaries of an evaluation: any wrongly scored one blocks promotion."""

    checked: int
    wrong: list[CanaryResult]
    """Every canary the verifier scored wrongly (empty when the verifiers held)."""
    per_env: dict[str, int]
    """Canaries checked per environment."""
    skipped: dict[str, str] = Field(default_factory=dict)
    """Environments without canaries, and why."""


class TrainGap(_Payload):
    """The candidate's success on a sample of its own training tasks vs on holdout."""

    tasks: int
    samples: int
    train_success: float
    holdout_success: float
    gap: float
    threshold: float
    warning: str | None = None


class EpisodeCall(_Payload):
    """One tool call of an episode as "what changed" shows it."""

    name: str
    arguments: str
    """The arguments as the model wrote them (JSON text, cut)."""
    result: str = ""
    """The tool result the agent got (cut); empty where none was kept."""
    source: str = ""
    """Where the result came from (`ToolStep.source`)."""


class EpisodeTurn(_Payload):
    """One assistant turn of an episode: its calls with their results, or its answer — and
    the scripted user's message that followed it, if one did."""

    calls: list[EpisodeCall] = []
    text: str = ""
    """The reply's text without its calls (an answer), cut."""
    user: str | None = None


class ChangedSide(_Payload):
    success: float
    """Share of this side's paired attempts at the task that succeeded."""
    reply: str
    """A representative reply (the paired attempt where the two sides differ, when any)."""
    failure_mode: str | None
    reason: str
    """The verifier's verdict on that reply, in words."""
    episode: list[EpisodeTurn] | None = None
    """That attempt turn by turn, for an episode task (None: a single step, or a run
    cached before episodes were kept)."""


class ChangedTask(_Payload):
    task_id: str
    groups: list[str]
    candidate: ChangedSide
    production: ChangedSide
    diverged_at: int | None = None
    """Episode tasks: the first turn (1-based) whose calls differ between the two shown
    attempts (one side's turn missing counts); None when their calls never differ."""


class ChangeCount(_Payload):
    fixed: int = 0
    broken: int = 0


class GateChanges(_Payload):
    """What changed task by task (`flywheel.gate.changes`): tasks the candidate fixed and
    broke on paired attempts, the largest changes first, counted per failure mode and tool."""

    tasks: int
    """Tasks compared."""
    fixed_count: int
    broken_count: int
    fixed: list[ChangedTask]
    broken: list[ChangedTask]
    """At most `GateSettings.changes_listed` of each."""
    per_mode: dict[str, ChangeCount]
    per_tool: dict[str, ChangeCount]
class GateLifetime(_Payload):
    """The candidate's share of production's false-promotion budget
    (`flywheel.gate.lifetime`): the k-th candidate against one production is tested at level
    alpha · γ_k, Σ γ_k ≤ 1, so all of them together promote a no-better one with probability
    at most alpha."""

    candidate_number: int
    """k: this candidate's number among those evaluated against this production since it
    was set (incomplete evaluations, which never promote, do not count)."""
    alpha: float
    """The lifetime bound (`gate.alpha`)."""
    level: float
    """This candidate's level alpha · γ_k (the sequential test promotes at 1/level)."""
    spent: float
    """The budget spent by candidates 1 … k: alpha · Σ_{j≤k} γ_j < alpha."""


class GroupTest(_Payload):
    """One task group's paired comparison over the pairs the test looked at
    (`flywheel.gate.groups`): descriptive, the decision rests on the whole holdout's test."""

    tasks: int
    pairs: int
    wins: int
    """Pairs where only the candidate succeeded."""
    losses: int
    ties: int
    gain: float
    """(wins − losses) / pairs: the group's success-rate change on its pairs."""
    ci_low: float | None
    """95% bootstrap interval of `gain` over the group's tasks (None under 2 tasks)."""
    ci_high: float | None
    p_value: float
    """Exact one-sided McNemar p of "no better on this group"."""
    p_holm: float
    """`p_value` Holm-adjusted over every group of the decision."""


class GateDecision(_Payload):
    """What the gate's rule decided and why (`flywheel.gate.decision.decide`)."""

    recommendation: Literal["promote", "reject", "incomplete"]
    """`incomplete`: the infrastructure could not complete the pairs the test needed;
    recorded and visible, never carried out as a promotion (re-evaluate the version)."""
    candidate: GateMetrics
    baseline: GateMetrics
    test: str
    statistic: float
    p_value: float
    thresholds: dict[str, float]
    checks: list[GateCheck]
    reasons: list[str]
    """The decision in plain words, one sentence per failed (or, when promoting, key) check."""
    power: GatePower | None = None
    """What this evaluation could see (None in records from before the MDE was kept)."""
    sequential: GateSequential | None = None
    """Rounds, samples used, the statistic and the stopping reason (sequential test only)."""
    latency: Literal["paired_probe", "attempts"] = "attempts"
    """How the latency guard was measured: `paired_probe` (both sides timed back to back,
    so load affects both alike) or `attempts` (each side's own attempts)."""
    latency_probe: LatencyProbe | None = None
    canaries: GateCanaries | None = None
    """Verifier canaries (None in records from before they ran)."""
    behaviour: dict[str, BehaviourFigures] = Field(default_factory=dict)
    """`candidate` and `production` behaviour figures (the `shift:*` checks judge them)."""
    train_gap: TrainGap | None = None
    changes: GateChanges | None = None
    warnings: list[str] = Field(default_factory=list)
    """What a reviewer should look at that does not block promotion (e.g. the train gap)."""
    lifetime: GateLifetime | None = None
    """Where this candidate stands in production's false-promotion budget (None in records
    from before it was kept, and under `gate.test_only_accept`)."""
    group_tests: dict[str, GroupTest] = Field(default_factory=dict)
    """Each task group's paired figures (empty in records from before they were kept)."""


class RoundTiming(_Payload):
    """How long one round of one side took (`cached`: read from `eval_runs`, not sampled)."""

    round: int
    side: Literal["candidate", "production"]
    seconds: float
    samples: int
    samples_per_s: float | None
    cached: bool


class AdapterEvaluatedPayload(GateDecision):
    """A decision and what it was about."""

    evaluation_id: uuid.UUID
    policy: str
    version: int
    baseline_version: int | None
    """Production when the evaluation ran (None = the base model)."""
    eval_set_version: int
    mode: Literal["auto", "manual"]
    selected_by: str | None = None
    """How the candidate was selected, in words: by the validation pass (its gain over
    production on the validation tasks) or by the trainer at publication. Never holdout."""

    rounds: list[RoundTiming] = Field(default_factory=list)
    """Every round of both sides in order, with its seconds and samples/s (empty in records
    from before they were kept)."""


class AdapterEvaluated(_Event):
    """The gate compared a candidate with production on the frozen holdout tasks."""

    type: Literal["AdapterEvaluated"] = "AdapterEvaluated"
    payload: AdapterEvaluatedPayload


class AdapterPromotedPayload(_Payload):
    policy: str
    version: int
    previous_version: int | None
    evaluation_id: uuid.UUID
    expected_revision: int
    """Revision of the production pointer this promotion replaces (conditional update)."""
    actor: str
    """`gate` in auto mode, else the operator who approved."""
    reason: str


class AdapterPromoted(_Event):
    """A candidate became production for its policy."""

    type: Literal["AdapterPromoted"] = "AdapterPromoted"
    payload: AdapterPromotedPayload


class AdapterRejectedPayload(_Payload):
    policy: str
    version: int
    evaluation_id: uuid.UUID | None
    """None when the candidate was never evaluated (superseded before the gate reached it)."""
    actor: str
    reason: str


class AdapterRejected(_Event):
    """A candidate will not be promoted (by the gate or an operator)."""

    type: Literal["AdapterRejected"] = "AdapterRejected"
    payload: AdapterRejectedPayload


class AdapterRolledBackPayload(_Payload):
    policy: str
    from_version: int | None
    """Production before (None = the base model, when returning to an earlier version)."""
    to_version: int | None
    """The earlier production version now serving (None = back to the base model)."""
    expected_revision: int
    actor: str
    reason: str


class AdapterRolledBack(_Event):
    """Production was re-pointed to an earlier version; `from_version` needs a new evaluation
    before it can be promoted again."""

    type: Literal["AdapterRolledBack"] = "AdapterRolledBack"
    payload: AdapterRolledBackPayload


class ServingSwitchedPayload(_Payload):
    policy: str
    version: int | None
    served_name: str
    replicas: list[str]
    """Every replica that loaded and verified the version before the alias moved."""
    cause_event_id: uuid.UUID | None = None
    """The promotion or rollback that moved production; None when no event did (serving
    first follows a fresh stack's production: the base model)."""


class ServingSwitched(_Event):
    """The `production` alias now resolves to `served_name` on every replica."""

    type: Literal["ServingSwitched"] = "ServingSwitched"
    payload: ServingSwitchedPayload


class ValidationScoredPayload(_Payload):
    policy: str
    version: int | None
    """None = the base model (production before any promotion)."""
    tasks: int
    samples: int
    success_rate: float
    reward_mean: float
    train_reward: float | None
    """Mean reward of the groups trained into the version (None: SFT, base, production)."""
    seconds: float
    """Wall time of the pass (0 when it came from the cache)."""


class ValidationScored(_Event):
    """A published version was scored on the validation tasks (never holdout tasks)."""

    type: Literal["ValidationScored"] = "ValidationScored"
    payload: ValidationScoredPayload


class CandidateProposedPayload(_Payload):
    policy: str
    version: int
    production_version: int | None
    """Production it was compared with on the validation tasks (None = the base model)."""
    tasks: int
    """Validation tasks both sides were scored on (same tasks, indices and seeds)."""
    candidate_success: float
    production_success: float
    gain: float
    p_value: float
    """One-sided paired test over the tasks (`flywheel.validation.select.paired_gain`)."""
    margin: float
    alpha: float
    considered: list[int]
    """The versions since the last proposal it was the best of."""
    reason: str


class CandidateProposed(_Event):
    """The validation pass proposed a snapshot to the gate (its status becomes
    `candidate`): the best version since the last proposal, ahead of production."""

    type: Literal["CandidateProposed"] = "CandidateProposed"
    payload: CandidateProposedPayload


class OverfittingDetectedPayload(_Payload):
    policy: str
    versions: list[int]
    train_reward: list[float]
    validation_success: list[float]
    best_version: int | None
    """The best version by validation (what a proposal would take)."""
    action: Literal["pause_for_tasks"]
    """The policy acted on: sampling pauses until the miner adds tasks."""
    detail: str


class OverfittingDetected(_Event):
    """Training reward rose while validation did not for `validation.overfit_versions`."""

    type: Literal["OverfittingDetected"] = "OverfittingDetected"
    payload: OverfittingDetectedPayload


class ToolsetRegisteredPayload(_Payload):
    name: str
    version: int
    kind: str
    """`mcp_stdio`, `mcp_http` or `python` (`flywheel.toolsets`)."""
    config: dict[str, Any]
    """The registration as given, header and env values masked unless `${NAME}` references."""
    tools: list[dict[str, Any]]
    """The tools read from the backend: name, description, parameters, annotations,
    destructive."""
    digest: str
    """sha256 of the tools' schemas and the configuration: a `check` that reads the same
    registers nothing new."""
    protocol_version: str | None
    """The MCP protocol version the server negotiated (None for a Python toolset)."""
    actor: str


class ToolsetRegistered(_Event):
    """A toolset was registered, or re-registered with changed tools or configuration."""

    type: Literal["ToolsetRegistered"] = "ToolsetRegistered"
    payload: ToolsetRegisteredPayload


class ToolsetRemovedPayload(_Payload):
    name: str
    version: int
    """The version that was current when it was removed."""
    actor: str


class ToolsetRemoved(_Event):
    """A toolset was removed: no new episode runs on it (its versions stay in the log)."""

    type: Literal["ToolsetRemoved"] = "ToolsetRemoved"
    payload: ToolsetRemovedPayload


LIFECYCLE_EVENTS = ("AdapterTrained", "AdapterEvaluated", "AdapterPromoted", "AdapterRejected",
                    "AdapterRolledBack", "ServingSwitched", "CandidateProposed")
"""Event types whose projections (`adapter_versions`, `evaluations`, `production`,
`serving_state`) `flywheel replay` rebuilds."""

Event = Annotated[DeadLettered | RecordParked | TrajectoriesIngested | FeedbackReceived
                  | TaskCreated | EvalSetFrozen | RolloutRequested | GroupScored
                  | AdapterTrained | AdapterEvaluated | AdapterPromoted | AdapterRejected
                  | AdapterRolledBack | ServingSwitched | ValidationScored
                  | CandidateProposed | OverfittingDetected | ToolsetRegistered
                  | ToolsetRemoved,
                  Field(discriminator="type")]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def parse_event(data: bytes | str) -> Event:
    return EVENT_ADAPTER.validate_json(data)
