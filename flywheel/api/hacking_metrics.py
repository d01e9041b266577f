"""Prometheus families of the newest decision's reward-hacking checks (`/metrics`): its
verifier canaries, both sides' behaviour figures, the train-vs-holdout gap and how many
holdout tasks it fixed and broke. Absent for decisions recorded before the checks ran."""

from __future__ import annotations

from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

COLUMNS = """record->'canaries' AS canaries, record->'behaviour' AS behaviour,
       (record->'train_gap'->>'gap')::float AS train_gap,
       (record->'changes'->>'fixed_count')::int AS fixed,
       (record->'changes'->>'broken_count')::int AS broken"""
"""Columns the newest-evaluation query selects for these families."""

FIGURES = ("empty_rate", "truncated_rate", "reply_chars", "calls_per_turn")


def hacking_families(last: dict[str, Any]) -> list[Metric]:
    out: list[Metric] = []
    found = last.get("canaries")
    if found:
        canaries = GaugeMetricFamily(
            "flywheel_last_evaluation_canaries", "Verifier canaries of the newest gate "
            "evaluation: `checked`, and `wrong` (scored wrongly: promotion is blocked).",
            labels=["result"])
        canaries.add_metric(["checked"], found["checked"])
        canaries.add_metric(["wrong"], len(found["wrong"]))
        out.append(canaries)
    figures = last.get("behaviour") or {}
    if figures:
        family = GaugeMetricFamily(
            "flywheel_last_evaluation_behaviour", "Behaviour of both sides of the newest gate "
            "evaluation on holdout (empty and truncated reply rates, mean reply chars, tool "
            "calls per turn).", labels=["side", "figure"])
        for side in ("candidate", "production"):
            for figure in FIGURES:
                family.add_metric([side, figure], figures[side][figure])
        out.append(family)
    if last.get("train_gap") is not None:
        out.append(GaugeMetricFamily(
            "flywheel_last_evaluation_train_gap", "Candidate success on its own training "
            "tasks minus on holdout, in the newest gate evaluation.", value=last["train_gap"]))
    if last.get("fixed") is not None:
        changed = GaugeMetricFamily(
            "flywheel_last_evaluation_changed_tasks", "Holdout tasks the newest gate "
            "evaluation's candidate fixed and broke (paired attempts).", labels=["change"])
        changed.add_metric(["fixed"], last["fixed"])
        changed.add_metric(["broken"], last["broken"])
        out.append(changed)
    return out
