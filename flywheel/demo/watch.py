"""What `make demo` watches while the loop turns, and the summary it ends with.

Reads only Postgres projections (baselines, adapter_versions, evaluations, trainer_status),
so the figures are the gate's own: holdout success on the frozen eval set, never training
reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.adapters.lifecycle import version_label
from flywheel.adapters.queries import list_adapters, production
from flywheel.adapters.registry import gate_activity, latest_baseline


@dataclass
class Progress:
    baseline: dict[str, Any] | None = None
    adapters: list[dict[str, Any]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    trainer: dict[str, Any] | None = None
    groups: int = 0
    production: int | None = None
    gate: dict[str, Any] | None = None


async def read_progress(conn: AsyncConnection, policy: str) -> Progress:
    p = Progress(baseline=await latest_baseline(conn, policy),
                 adapters=await list_adapters(conn, policy),
                 production=(await production(conn, policy))["version"])
    p.decisions = [dict(r) for r in (await conn.execute(text("""
        SELECT e.version, e.baseline_version, e.recommendation, e.state, e.created_at,
               e.decided_at, e.record, a.stage
        FROM evaluations e JOIN adapter_versions a USING (policy, version)
        WHERE e.policy = :p ORDER BY e.created_at"""), {"p": policy})).mappings()]
    rejected = [dict(r) for r in (await conn.execute(text("""
        SELECT version, status FROM adapter_versions WHERE policy = :p AND status = 'rejected'
          AND evaluation_id IS NULL"""), {"p": policy})).mappings()]
    for r in rejected:  # superseded before evaluation: a decision without a record
        p.decisions.append({"version": r["version"], "state": "rejected", "record": None,
                            "recommendation": "reject", "superseded": True})
    trainer = (await conn.execute(text("""SELECT state, detail, version, steps, metrics
        FROM trainer_status WHERE policy = :p"""), {"p": policy})).mappings().first()
    p.trainer = dict(trainer) if trainer else None
    p.groups = int((await conn.execute(text("SELECT count(*) FROM rollout_groups"))).scalar_one())
    p.gate = await gate_activity(conn, policy)
    return p


def decided(p: Progress) -> list[dict[str, Any]]:
    return [d for d in p.decisions if d["state"] in ("promoted", "rejected")]


def finished(p: Progress, *, grpo_decisions: int = 1) -> bool:
    """The loop has turned: the warm start (if any) was decided, and a GRPO candidate was
    promoted or `grpo_decisions` of them were decided by the gate. One: the demo shows the
    loop turning once in its 15 minutes on 2 cores (a decision either way, with its
    reasons); `flywheel up` keeps turning it."""
    done = decided(p)
    sft_needed = bool(p.baseline and p.baseline["recommendation"] == "sft")
    sft_done = any(d.get("stage") == "sft" for d in done) or not sft_needed
    grpo = [d for d in done if d.get("stage") == "grpo" and d.get("record")]
    promoted = any(d["state"] == "promoted" for d in grpo)
    return sft_done and (promoted or len(grpo) >= grpo_decisions)


def gate_line(gate: dict[str, Any] | None) -> str:
    """The gate's activity in a few words (the demo's spinner)."""
    if gate is None or gate["state"] in ("idle", "absent"):
        return "gate idle"
    if gate["state"] == "evaluating":
        return (f"gate: v{gate['version']} vs {version_label(gate['baseline_version'])}, "
                f"{gate['samples_done']}/{gate['samples_planned']} samples, "
                f"{gate['elapsed_s'] or 0:.0f}s")
    if gate["state"] == "baseline":
        return (f"gate: baseline {gate['samples_done']}/{gate['samples_planned']} samples, "
                f"{gate['elapsed_s'] or 0:.0f}s")
    return f"gate {gate['state']}: {gate['detail']}"


def decision_line(d: dict[str, Any]) -> str:
    if d.get("record") is None:
        return f"v{d['version']}: rejected without evaluation (superseded by a newer version)"
    r = d["record"]
    c, b = r["candidate"], r["baseline"]
    vs = f"v{r['baseline_version']}" if r["baseline_version"] else "base"
    seq, power = r.get("sequential"), r.get("power")
    seen = (f", {seq['samples_per_task']} of {power['samples_per_task']} samples per task "
            f"({seq['stop']})" if seq and power else "")
    mde = f", MDE {power['mde']:+.3f}" if power else ""
    how = " proposed by validation," if (r.get("selected_by") or "").startswith(
        "validation") else ""
    return (f"v{d['version']} ({d.get('stage', '?')}){how} vs {vs}: holdout success "
            f"{b['success_rate']:.2f} → {c['success_rate']:.2f}, p = {r['p_value']:.3f}"
            f"{seen}{mde} → {d['state']}; {r['reasons'][0]}")


def summary(p: Progress, stages: dict[str, float], wall_s: float) -> dict[str, Any]:
    """The figures of `.flywheel/demo-summary.json` (all measured by the gate on holdout)."""
    base = p.baseline["base"]["success_rate"] if p.baseline else None
    by_version: dict[int, float] = {}
    decisions = []
    for d in p.decisions:
        r = d.get("record")
        if r is not None:
            by_version[d["version"]] = r["candidate"]["success_rate"]
            if base is None and r["baseline_version"] is None:
                base = r["baseline"]["success_rate"]
        decisions.append({
            "version": d["version"], "stage": d.get("stage"), "state": d["state"],
            "recommendation": d["recommendation"],
            "against": None if r is None else r["baseline_version"],
            "candidate_success": None if r is None else r["candidate"]["success_rate"],
            "production_success": None if r is None else r["baseline"]["success_rate"],
            "p_value": None if r is None else r["p_value"],
            "samples": None if r is None else r["candidate"].get("samples"),
            "mde": None if r is None or not r.get("power") else r["power"]["mde"],
            "gain": None if r is None else r["candidate"]["success_rate"]
            - r["baseline"]["success_rate"],
            "stop": None if r is None or not r.get("sequential") else r["sequential"]["stop"],
            "selected_by": None if r is None else r.get("selected_by"),
            "reasons": ["superseded by a newer version before evaluation"] if r is None
            else r["reasons"]})
    production_success = base if p.production is None else by_version.get(p.production)
    return {
        "holdout": {"base_success": base, "production_success": production_success,
                    "production_version": p.production,
                    "candidates": {f"v{v}": s for v, s in sorted(by_version.items())},
                    "eval_set_version": (p.baseline or {}).get("eval_set_version")},
        "baseline": None if p.baseline is None else {
            "recommendation": p.baseline["recommendation"], "reason": p.baseline["reason"],
            "invalid_rate": p.baseline["base"]["invalid_rate"],
            "groups": p.baseline["base"]["groups"]},
        "decisions": decisions,
        "grpo_promoted": any(d["stage"] == "grpo" and d["state"] == "promoted"
                             for d in decisions),
        "eval_set_power": None if p.gate is None else p.gate.get("power"),
        "adapters": [{k: a[k] for k in ("version", "parent_version", "stage", "steps",
                                        "groups", "status")} for a in p.adapters],
        "scored_groups": p.groups,
        "stages": {k: round(v, 1) for k, v in stages.items()},
        "wall_s": round(wall_s, 1),
    }
