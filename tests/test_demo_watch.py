"""The demo's summary is assembled from the gate's own records (pure; no services)."""

from __future__ import annotations

from typing import Any

from flywheel.demo.watch import Progress, finished, summary


def _record(version: int, against: int | None, cand: float, base: float) -> dict[str, Any]:
    return {"baseline_version": against, "p_value": 0.01, "reasons": ["why"],
            "candidate": {"success_rate": cand}, "baseline": {"success_rate": base}}


def test_summary_reports_holdout_success_of_base_candidates_and_production() -> None:
    p = Progress(
        baseline={"recommendation": "sft", "reason": "invalid", "eval_set_version": 1,
                  "base": {"success_rate": 0.0, "invalid_rate": 0.7, "groups": {}}},
        adapters=[{"version": v, "parent_version": v - 1 or None, "stage": s, "steps": 1,
                   "groups": 0, "status": st}
                  for v, s, st in [(1, "sft", "promoted"), (2, "grpo", "rejected"),
                                   (3, "grpo", "rejected")]],
        decisions=[
            {"version": 1, "stage": "sft", "state": "promoted", "recommendation": "promote",
             "record": _record(1, None, 0.4, 0.0)},
            {"version": 2, "stage": "grpo", "state": "rejected", "recommendation": "reject",
             "record": _record(2, 1, 0.38, 0.4)},
            {"version": 3, "state": "rejected", "recommendation": "reject", "record": None,
             "superseded": True}],
        production=1)
    s = summary(p, {"stack_up": 4.0}, 300.0)
    assert s["holdout"]["base_success"] == 0.0
    assert s["holdout"]["production_success"] == 0.4
    assert s["holdout"]["candidates"] == {"v1": 0.4, "v2": 0.38}
    assert [d["state"] for d in s["decisions"]] == ["promoted", "rejected", "rejected"]
    assert s["decisions"][2]["reasons"] == ["superseded by a newer version before evaluation"]
    assert s["stages"] == {"stack_up": 4.0}
    # One GRPO candidate decided (rejected, with its reasons) ends the demo; asked for two,
    # it waits for the next.
    assert finished(p) and not s["grpo_promoted"]
    assert not finished(p, grpo_decisions=2)
    p.decisions.append({"version": 4, "stage": "grpo", "state": "rejected",
                        "recommendation": "reject", "record": _record(4, 1, 0.4, 0.4)})
    assert finished(p, grpo_decisions=2)
    # The warm start the baseline asked for must be decided first.
    early = Progress(baseline=p.baseline, adapters=p.adapters,
                     decisions=[d for d in p.decisions if d.get("stage") == "grpo"],
                     production=1)
    assert not finished(early)
    # A GRPO version promoted over the SFT version ends the demo at once.
    p.decisions[3:] = [{"version": 4, "stage": "grpo", "state": "promoted",
                        "recommendation": "promote", "record": {
                            **_record(4, 1, 0.55, 0.4), "power": {"mde": 0.09},
                            "sequential": {"stop": "win"}}}]
    assert finished(p)
    s = summary(p, {}, 1.0)
    assert s["grpo_promoted"] and s["decisions"][3]["mde"] == 0.09
    assert s["decisions"][3]["stop"] == "win"
    assert abs(s["decisions"][3]["gain"] - 0.15) < 1e-9
