"""`GET /metrics`: the pipeline in the Prometheus text format, read at scrape time.

Nothing is counted in process memory: every value comes from Postgres (the same queries as
`flywheel status`) and consumer lag from Kafka, when Prometheus asks. So any API replica
answers the same, a restarted API loses nothing, and counters are the table counts
(monotonic: those rows are never deleted). `prometheus_client` renders the families (names,
HELP/TYPE, label escaping) from a fresh registry per scrape; there is no global state.

Needs `app.state.db` (opened by `operator_lifespan`). No token: the figures are counts and
states, never payloads; put the port behind your network policy like any exporter. A
dependency that does not answer never fails the scrape: `flywheel_up{dependency="postgres"}`
(or `"kafka"`) is 0 and the figures read from it are left out for that scrape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from flywheel.api.hacking_metrics import COLUMNS, hacking_families
from flywheel.config import Settings
from flywheel.errors import unavailable
from flywheel.observe.status import counts, describe_error, lag_or_error, stack_state
from flywheel.web.app import settings_of

log = logging.getLogger("flywheel.api")
SCRAPE_DB_TIMEOUT_S = 5.0

TRAINER_STATES = ("absent", "starting", "waiting", "training", "starved", "stalled",
                  "overfitting", "stopped", "down")
GATE_STATES = ("absent", "idle", "baseline", "evaluating", "down")
ADAPTER_STATUSES = ("candidate", "snapshot", "evaluated", "promoted", "rejected",
                    "rolled_back")
TRAINER_STEP_METRICS = {
    "loss": ("flywheel_trainer_loss", "GRPO loss of the trainer's last optimizer step."),
    "reward_mean": ("flywheel_trainer_reward_mean",
                    "Mean reward of the rollouts in the trainer's last batch."),
    "tokens_per_s": ("flywheel_trainer_tokens_per_second",
                     "Completion tokens per second of the trainer's last step."),
    "step_s": ("flywheel_trainer_step_seconds", "Wall time of the trainer's last step."),
    "grad_norm": ("flywheel_trainer_grad_norm",
                  "Gradient norm (before clipping) of the trainer's last step."),
    "clip_frac": ("flywheel_trainer_clip_fraction",
                  "Share of tokens whose importance ratio was clipped in the last step."),
    "ranks": ("flywheel_trainer_ranks",
              "Data-parallel ranks of the trainer's last step (torchrun; absent: one)."),
}

_LIFECYCLE = text("""
SELECT (SELECT version FROM production WHERE policy = :p) AS production_version,
       (SELECT json_object_agg(status, n) FROM (SELECT status, count(*) AS n
          FROM adapter_versions WHERE policy = :p GROUP BY status) s) AS adapter_statuses
""")
_LAST_EVALUATION = text("""
SELECT version, baseline_version, state,
       (record->'candidate'->>'success_rate')::float AS candidate,
       (record->'baseline'->>'success_rate')::float AS production,
       (record->'candidate'->>'samples')::int AS samples,
       (record->'power'->>'mde')::float AS mde, record->'group_tests' AS group_tests,
       """ + COLUMNS + """
FROM evaluations WHERE policy = :p ORDER BY created_at DESC LIMIT 1
""")


async def snapshot(conn: AsyncConnection, settings: Settings) -> dict[str, Any]:
    """`status.counts` plus the adapter lifecycle figures of the configured policy."""
    policy = settings.policy
    data = await counts(conn, policy)
    row = (await conn.execute(_LIFECYCLE, {"p": policy})).mappings().one()
    last = (await conn.execute(_LAST_EVALUATION, {"p": policy})).mappings().first()
    return {**data, "policy": policy, "production_version": row["production_version"],
            "adapter_statuses": dict(row["adapter_statuses"] or {}),
            "last_evaluation": dict(last) if last is not None else None}


def families(snap: dict[str, Any] | None, lag: dict[str, dict[str, Any]],
             lag_error: str | None, stack: dict[str, Any] | None = None) -> list[Metric]:
    """The metric families of one scrape (pure: `snap` from `snapshot`, None when Postgres
    did not answer; `lag` from `status.lag_or_error`; `stack` from `status.stack_state`)."""
    out: list[Metric] = []
    up = GaugeMetricFamily("flywheel_up", "1 when the dependency answered in this scrape.",
                           labels=["dependency"])
    up.add_metric(["postgres"], 0 if snap is None else 1)
    up.add_metric(["kafka"], 0 if lag_error else 1)
    out.append(up)
    out.extend(_stack_families(stack))
    if snap is None:  # the rest are Postgres figures: absent, not zero, while it is down
        out.extend(_lag_families(lag, lag_error))
        return out

    def counter(name: str, doc: str, value: float) -> None:
        out.append(CounterMetricFamily(name, doc, value=value))

    def gauge(name: str, doc: str, value: float) -> None:
        out.append(GaugeMetricFamily(name, doc, value=value))

    def labelled(kind: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str,
                 doc: str, label: str, values: Iterable[tuple[str, float]]) -> None:
        family = kind(name, doc, labels=[label])
        for key, value in values:
            family.add_metric([key], value)
        out.append(family)

    # Ingest and mining.
    counter("flywheel_trajectories_ingested", "Trajectories stored by ingest.",
            snap["trajectories"])
    counter("flywheel_trajectories_failed", "Ingested trajectories whose outcome (with "
            "feedback applied) is a failure.", snap["failures"])
    gauge("flywheel_trajectories_awaiting_outcome", "Stored trajectories with no outcome yet "
          "(neither success nor failure until feedback says which).", snap["awaiting_outcome"])
    counter("flywheel_feedback_received", "Feedback records stored (outcomes, ratings, "
            "corrections that arrived after their trajectory).", snap["feedback"])
    counter("flywheel_feedback_applied", "Feedback applied to its stored trajectory.",
            snap["feedback_applied"])
    gauge("flywheel_feedback_pending", "Feedback waiting for its trajectory to be stored.",
          snap["feedback_pending"])
    gauge("flywheel_feedback_parked", "Feedback that could not be applied (see status).",
          snap["feedback_parked"])
    labelled(CounterMetricFamily, "flywheel_failures_mined",
             "Failed trajectories classified by the miner, by failure mode.", "failure_mode",
             snap["failure_modes"].items())
    gauge("flywheel_failures_unverifiable",
          "Mined failures with no way to verify them (not tasks, may still be upgraded).",
          snap["unverifiable"])
    splits = {"train": 0, "validation": 0, "holdout": 0, **snap["tasks_by_split"]}
    labelled(GaugeMetricFamily, "flywheel_tasks", "Verifiable tasks by split.", "split",
             splits.items())
    dead = CounterMetricFamily(
        "flywheel_dead_letters", "Messages a consumer could not process, by consumer (ingest:"
        " refused input; miner, rollout, trainer, gate: parked) and reason.",
        labels=["consumer", "reason"])
    for consumer, reasons in snap["dlq_by_consumer"].items():
        for reason, n in reasons.items():
            dead.add_metric([consumer, reason], n)
    out.append(dead)
    gauge("flywheel_outbox_pending", "Events written but not yet published by the relay.",
          snap["outbox_pending"])
    gauge("flywheel_outbox_parked", "Events the broker refused for good (see status).",
          snap["outbox_parked"])

    out.extend(_lag_families(lag, lag_error))

    # Rollouts and the trainer.
    counter("flywheel_rollout_groups_scored", "Scored rollout groups (trainable or not).",
            snap["groups"])
    counter("flywheel_rollout_groups_trainable",
            "Scored groups with reward variance, sent to training.", snap["groups_trainable"])
    counter("flywheel_rollout_groups_stale_dropped",
            "Trainable groups the trainer dropped as too stale.", snap["groups_stale_dropped"])
    gauge("flywheel_rollout_groups_backlog", "Trainable groups not yet consumed by the trainer.",
          snap["groups_backlog"])
    gauge("flywheel_rollout_requests_outstanding", "Rollout requests not yet answered.",
          snap["requests_outstanding"])
    validation = snap["validation"]
    labelled(GaugeMetricFamily, "flywheel_validation_state",
             "1 for the validation pass's state (`overfitting`: training reward rose while "
             "validation did not; sampling paused until the miner adds tasks).", "state",
             [(s, 1.0 if s == validation["state"] else 0.0)
              for s in ("absent", "ok", "overfitting")])
    newest = validation["newest"]
    if newest is not None:
        gauge("flywheel_validation_success",
              "Validation success of the newest scored adapter version.",
              newest["validation_success"])
        if newest["gap"] is not None:
            gauge("flywheel_validation_gap",
                  "Training reward minus validation success of the newest scored version.",
                  newest["gap"])
    trainer = snap["trainer"]
    states = [*TRAINER_STATES, *([trainer["state"]] if trainer["state"] not in
                                 TRAINER_STATES else [])]
    labelled(GaugeMetricFamily, "flywheel_trainer_state",
             "1 for the trainer's current state (`down`: heartbeat older than 30 s).", "state",
             [(s, 1.0 if s == trainer["state"] else 0.0) for s in states])
    gauge("flywheel_trainer_steps", "Optimizer steps taken by the running trainer.",
          trainer["steps"])
    if trainer["heartbeat_age_s"] is not None:
        gauge("flywheel_trainer_heartbeat_age_seconds", "Seconds since the trainer's heartbeat.",
              trainer["heartbeat_age_s"])
    for key, (name, doc) in TRAINER_STEP_METRICS.items():
        value = trainer["metrics"].get(key)
        if isinstance(value, int | float):
            gauge(name, doc, value)

    _gate_families(snap["gate"], out)

    # Adapter lifecycle.
    statuses = {s: 0 for s in ADAPTER_STATUSES} | snap["adapter_statuses"]
    labelled(GaugeMetricFamily, "flywheel_adapter_versions", "Adapter versions by status.",
             "status", statuses.items())
    gauge("flywheel_production_version",
          "Adapter version behind the `production` alias (0 = the base model).",
          snap["production_version"] or 0)
    gauge("flywheel_pending_reviews", "Gate decisions waiting for an operator (manual mode).",
          snap["pending_reviews"])
    last = snap["last_evaluation"]
    if last is not None:
        family = GaugeMetricFamily(
            "flywheel_last_evaluation_success_rate",
            "Holdout success rate of both sides of the newest gate evaluation "
            "(`production`: the version production was when it ran; `base` = base model).",
            labels=["side", "version"])
        family.add_metric(["candidate", str(last["version"])], last["candidate"])
        base = last["baseline_version"]
        family.add_metric(["production", "base" if base is None else str(base)],
                          last["production"])
        out.append(family)
        gauge("flywheel_last_evaluation_samples",
              "Candidate samples the newest gate evaluation used (the sequential test stops "
              "early when the outcome is clear).", last["samples"] or 0)
        if last["mde"] is not None:
            gauge("flywheel_last_evaluation_mde",
                  "Minimum detectable gain of the newest gate evaluation (its budget, the "
                  "discordance it observed).", last["mde"])
        out += _group_families(last.get("group_tests") or {})
        out += hacking_families(last)
    return out


def _group_families(tests: dict[str, Any]) -> list[Metric]:
    """Each task group's paired comparison in the newest decision (absent in older ones)."""
    if not tests:
        return []
    gain = GaugeMetricFamily(
        "flywheel_last_evaluation_group_gain", "Paired success gain of the newest gate "
        "evaluation's candidate per task group ((wins − losses) / pairs; `kind:episode` for "
        "episodes).", labels=["group"])
    p = GaugeMetricFamily(
        "flywheel_last_evaluation_group_p_value", "Exact one-sided McNemar p-value of the "
        "newest evaluation's gain per task group (descriptive: the promotion rests on the "
        "whole holdout's test).", labels=["group"])
    for group, t in sorted(tests.items()):
        gain.add_metric([group], t["gain"])
        p.add_metric([group], t["p_value"])
    return [gain, p]


def _lag_families(lag: dict[str, dict[str, Any]], lag_error: str | None) -> list[Metric]:
    kafka_up = GaugeMetricFamily("flywheel_kafka_up", "1 when consumer lag could be read from "
                                 "Kafka in this scrape.", value=0 if lag_error else 1)
    family = GaugeMetricFamily("flywheel_consumer_lag",
                               "Messages not yet committed by the consumer group.",
                               labels=["group", "topic"])
    for group, info in lag.items():
        family.add_metric([group, info["topic"]], info["total"])
    return [kafka_up, family]


def _stack_families(stack: dict[str, Any] | None) -> list[Metric]:
    """What the local supervisor (`flywheel up`) reports: per component, up and restarts."""
    components: dict[str, Any] = (stack or {}).get("components") or {}
    if not components:
        return []
    up = GaugeMetricFamily("flywheel_stack_component_up",
                           "1 when the local stack's component runs (`flywheel up`).",
                           labels=["component"])
    restarts = CounterMetricFamily("flywheel_stack_restarts",
                                   "Times the local supervisor restarted the component.",
                                   labels=["component"])
    for name, info in sorted(components.items()):
        up.add_metric([name], 1 if info.get("state") == "up" else 0)
        restarts.add_metric([name], int(info.get("restarts") or 0))
    return [up, restarts]


def _gate_families(gate: dict[str, Any], out: list[Metric]) -> None:
    """The gate's activity and what the newest eval set can see."""
    states = [*GATE_STATES, *([gate["state"]] if gate["state"] not in GATE_STATES else [])]
    family = GaugeMetricFamily("flywheel_gate_state",
                               "1 for the gate's current activity (`down`: a busy gate whose "
                               "heartbeat is older than 60 s).", labels=["state"])
    for s in states:
        family.add_metric([s], 1.0 if s == gate["state"] else 0.0)
    out.append(family)
    busy = gate["state"] in ("baseline", "evaluating")
    for name, doc, value in (
            ("flywheel_gate_samples_done", "Samples taken so far by the gate's current "
             "evaluation or baseline.", gate["samples_done"] if busy else 0),
            ("flywheel_gate_samples_planned", "Samples at the budget of the gate's current "
             "evaluation or baseline.", gate["samples_planned"] if busy else 0),
            ("flywheel_gate_elapsed_seconds", "Seconds the gate's current evaluation or "
             "baseline has run.", (gate["elapsed_s"] or 0) if busy else 0)):
        out.append(GaugeMetricFamily(name, doc, value=value))
    power = gate["power"]
    if power is None:
        return
    for name, doc, value in (
            ("flywheel_gate_mde", "Minimum detectable gain of the newest eval set at the "
             "gate's budget (promoted with the configured power).", power["mde"]),
            ("flywheel_gate_design_gain", "The gain the gate is asked to find (its design "
             "gain, 2 × min_gain by default).", power["design_gain"]),
            ("flywheel_gate_min_gain", "The least gain the gate promotes.", power["min_gain"]),
            ("flywheel_gate_mde_warning", "1 when the eval set cannot see the gains it is "
             "asked to find (MDE above the design gain).", 1.0 if power["warning"] else 0.0)):
        out.append(GaugeMetricFamily(name, doc, value=value))


class _Families(Collector):
    def __init__(self, found: list[Metric]) -> None:
        self.found = found

    def collect(self) -> Iterator[Metric]:
        return iter(self.found)


def exposition(found: list[Metric], accept: str = "") -> tuple[bytes, str]:
    """(body, content type): the text format 0.0.4, or OpenMetrics when `accept` asks."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(found))
    encode, content_type = choose_encoder(accept)
    return encode(registry), content_type


def metrics_router() -> APIRouter:
    router = APIRouter(tags=["ops"])

    @router.get("/metrics", response_class=Response)
    async def metrics(request: Request) -> Response:
        """Prometheus exposition (text format 0.0.4, or OpenMetrics when the scraper asks for
        it). Needs no token."""
        settings = settings_of(request)
        engine: AsyncEngine = request.app.state.db
        snap: dict[str, Any] | None = None
        try:
            async with asyncio.timeout(SCRAPE_DB_TIMEOUT_S), engine.connect() as conn:
                snap = await snapshot(conn, settings)
        except Exception as err:
            if unavailable(err) is None:
                raise
            log.warning("/metrics: Postgres is unavailable (%s); reporting flywheel_up 0",
                        describe_error(err))
        lag, lag_error = await lag_or_error(settings)
        body, content_type = exposition(
            families(snap, lag, lag_error, stack_state(settings)),
            request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

    return router
