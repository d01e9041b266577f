"""Baseline first: the base model (and production) on the frozen holdout, and the next stage.

The seeds' rule, applied to the base model's holdout run: if its outputs are mostly invalid
(it does not follow the required format), teach the format with SFT on demonstrations first;
if it succeeds sometimes but not reliably, GRPO has signal; if it almost never succeeds even
when its output is valid, RL has nothing to reinforce — it needs more or easier tasks.
The record lands in `baselines` (shown by `flywheel status`, the dashboard and the demo) and
the trainer reads it before the first training of a policy. The gate service measures it
at startup, as soon as an eval set is frozen (`measure_when_ready`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.config import GateSettings
from flywheel.errors import describe
from flywheel.events import GateMetrics
from flywheel.runtime.consume import RetryPolicy, transiently

log = logging.getLogger("flywheel.gate")

Stage = Literal["sft", "grpo", "more_tasks", "none"]


FORMAT_FAILURES = ("invalid_format", "empty", "truncated")
"""What not following the required format looks like: an unparseable reply, no reply at all,
or one cut by max_tokens before it closed. Since every attempt counts, an empty reply is a
scored failure rather than left out, so the rule counts it here, as it counted once as missing."""


def format_failure_rate(m: GateMetrics) -> float:
    """Share of the attempts that did not follow the format (`FORMAT_FAILURES`); records
    without failure-mode counts fall back to their invalid rate."""
    if not m.failure_modes or m.samples == 0:
        return m.invalid_rate
    return sum(m.failure_modes.get(f, 0) for f in FORMAT_FAILURES) / m.samples


def recommend(base: GateMetrics, g: GateSettings) -> tuple[Stage, str]:
    """The next stage for a policy whose base model scored `base` on the holdout."""
    if base.samples == 0:
        return "more_tasks", ("no holdout attempt could be scored: add verifiable tasks "
                              "(check `flywheel tasks ls --split holdout`)")
    off_format = format_failure_rate(base)
    if off_format > g.baseline_invalid_threshold:
        return "sft", (f"{off_format:.0%} of the base model's attempts do not follow the "
                       "format (unparseable, empty or cut by max_tokens; above "
                       f"{g.baseline_invalid_threshold:.0%}): teach the format with SFT "
                       "on successful trajectories before GRPO")
    valid = 1.0 - off_format
    success_on_valid = base.success_rate / valid if valid > 0 else 0.0
    if success_on_valid <= g.baseline_success_low:
        return "more_tasks", (f"the base model almost never succeeds even when its output is "
                              f"valid ({success_on_valid:.1%} of valid outputs): GRPO would "
                              "have no signal — mine more, or easier, tasks")
    if base.success_rate >= g.baseline_success_high:
        return "none", (f"the base model already succeeds on {base.success_rate:.0%} of the "
                        "holdout: little for training to gain — collect harder failures")
    return "grpo", (f"the base model succeeds on {base.success_rate:.0%} of the holdout, "
                    "sometimes but not reliably: GRPO has signal")


async def store_baseline(conn: AsyncConnection, policy: str, eval_set_version: int,
                         base: GateMetrics, production: GateMetrics | None,
                         g: GateSettings) -> dict[str, Any]:
    stage, reason = recommend(base, g)
    record = {"policy": policy, "eval_set_version": eval_set_version,
              "base": base.model_dump(mode="json"),
              "production": production.model_dump(mode="json") if production else None,
              "recommendation": stage, "reason": reason,
              "thresholds": {"invalid": g.baseline_invalid_threshold,
                             "success_low": g.baseline_success_low,
                             "success_high": g.baseline_success_high}}
    baseline_id = uuid.uuid4()
    await conn.execute(text("""INSERT INTO baselines (baseline_id, policy, eval_set_version,
        record, recommendation) VALUES (:id, :p, :e, CAST(:r AS jsonb), :s)"""),
        {"id": baseline_id, "p": policy, "e": eval_set_version, "r": json.dumps(record),
         "s": stage})
    return {"baseline_id": str(baseline_id), **record}


async def measure_when_ready(measure: Callable[[], Awaitable[object]], retry: RetryPolicy, *,
                             logger: logging.Logger = log) -> None:
    """The gate's baseline trigger, run once at startup: `measure` (the gate's `baseline`)
    until it has run. Waiting for an eval set and outages are transient, retried with
    backoff; there is no message to park here, so a bug is logged with its traceback and
    retried slowly."""
    while True:
        try:
            await transiently(measure, retry, what="baseline", logger=logger)
            return
        except Exception as err:
            logger.error("baseline failed (%s); retrying in %.0fs", describe(err),
                         retry.max_s, exc_info=err)
            await asyncio.sleep(retry.max_s)
