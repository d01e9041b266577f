"""The decision with its reward-hacking checks: what the gate records for every candidate.

`review` runs the decision rule (`flywheel.gate.decision.decide`) with three more kinds of
evidence, all in the record:

* verifier canaries (`flywheel.gate.canaries`, scored by the gate before deciding): any
  canary scored wrongly is a failed `canaries` check — no promotion;
* behaviour shifts against production (`flywheel.gate.behaviour`): `shift:*` checks, each
  with its tolerance;
* the train-vs-holdout gap: the candidate's success on a sample of its own training tasks
  against holdout; above `train_gap_threshold` it warns (a reviewer looks; it does not block);

and "what changed" (`flywheel.gate.changes`) on the rounds the test used. Pure.
"""

from __future__ import annotations

from flywheel.config import GateSettings
from flywheel.events import GateCanaries, GateDecision, LatencyProbe, TrainGap
from flywheel.gate import behaviour, canaries
from flywheel.gate.changes import changes
from flywheel.gate.decision import EvalRun, decide, looked_at


def train_gap(train: EvalRun | None, holdout_success: float, rule: GateSettings
              ) -> TrainGap | None:
    """The gap between the candidate's success on its training tasks and on holdout."""
    if train is None or not train.attempts:
        return None
    success = sum(a.success for a in train.attempts) / len(train.attempts)
    gap = success - holdout_success
    warning = (f"success on {len(train.task_groups)} of its own training tasks is "
               f"{success:.3f} against {holdout_success:.3f} on holdout (gap {gap:+.3f} > "
               f"{rule.train_gap_threshold}): the candidate may have memorised its training "
               f"tasks rather than learnt the skill" if gap > rule.train_gap_threshold
               else None)
    return TrainGap(tasks=len(train.task_groups), samples=len(train.attempts),
                    train_success=success, holdout_success=holdout_success, gap=gap,
                    threshold=rule.train_gap_threshold, warning=warning)


def review(cand: EvalRun, base: EvalRun, rule: GateSettings, probe: LatencyProbe | None = None,
           found: GateCanaries | None = None, train: EvalRun | None = None, *,
           candidate_number: int = 1) -> GateDecision:
    """`decide` (for the `candidate_number`-th candidate against this production) with the
    canaries, the behaviour shifts, the train gap and what changed, the last three on the
    rounds the test looked at."""
    seen_c, seen_b = looked_at(cand, base, rule, candidate_number)
    fc, fb, extra = behaviour.checks(seen_c, seen_b, rule)
    if found is not None:
        extra.insert(0, canaries.check(found))
    decision = decide(cand, base, rule, probe, extra, candidate_number=candidate_number)
    gap = train_gap(train, decision.candidate.success_rate, rule)
    return decision.model_copy(update={
        "canaries": found, "behaviour": {"candidate": fc, "production": fb},
        "train_gap": gap, "changes": changes(seen_c, seen_b, rule.changes_listed),
        "warnings": [gap.warning] if gap is not None and gap.warning else []})
