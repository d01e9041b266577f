"""A decision record as Markdown for a reviewer (`flywheel promotions show ID --diff`,
`flywheel promotions report ID`). Pure; reads the stored record (a JSON dict), so records
from before a section existed render without it.
"""

from __future__ import annotations

from typing import Any


def _cell(text: Any, limit: int = 400) -> str:
    s = str(text if text is not None else "")
    s = s if len(s) <= limit else s[:limit] + "…"
    return "`" + s.replace("|", "\\|").replace("\n", "⏎").replace("`", "'") + "`" \
        if s else "*(empty)*"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _counts(title: str, counts: dict[str, Any]) -> list[str]:
    if not counts:
        return []
    rows = [[k, str(v["fixed"]), str(v["broken"])] for k, v in counts.items()]
    return ["", f"### {title}", "", *_table([title.removeprefix("Per ").lower(), "fixed",
                                              "broken"], rows)]


def _turn(turn: dict[str, Any] | None) -> str:
    """One episode turn in a cell: each call with its result, or the answer; then the
    scripted user's next message."""
    if turn is None:
        return "*(no turn)*"
    parts = [_cell(str(c["name"]) + "(" + str(c["arguments"]) + ")", 160) + " → "
             + _cell(c["result"], 160) + (f" ({c['source']})" if c.get("source") else "")
             for c in turn["calls"]]
    if turn["text"] or not parts:
        parts.append(("answer " if not parts else "") + _cell(turn["text"], 200))
    if turn.get("user"):
        parts.append(f"user: {_cell(turn['user'], 160)}")
    return "<br>".join(parts)


def _episode(item: dict[str, Any]) -> list[str]:
    """Both sides' episodes turn by turn, the turn where they diverged marked."""
    p, c = item["production"].get("episode"), item["candidate"].get("episode")
    if p is None or c is None:  # a single step, or a side cached before episodes were kept
        return []
    at = item.get("diverged_at")
    rows = [[f"**{k + 1} ← diverged**" if at == k + 1 else str(k + 1),
             _turn(p[k] if k < len(p) else None), _turn(c[k] if k < len(c) else None)]
            for k in range(max(len(p), len(c)))]
    where = (f"the sides' calls first differ at turn {at}" if at is not None
             else "the sides made the same calls")
    return ["", f"{len(p)} production and {len(c)} candidate turns; {where}.", "",
            *_table(["turn", "production", "candidate"], rows)]


def _task(item: dict[str, Any]) -> list[str]:
    c, p = item["candidate"], item["production"]
    episode = _episode(item)
    reply = [] if episode else [["reply", _cell(p["reply"]), _cell(c["reply"])]]
    return ["", f"#### task {item['task_id'][:8]} — {', '.join(item['groups'])}", "",
            *_table(["", "production", "candidate"], [
                ["success", f"{p['success']:.2f}", f"{c['success']:.2f}"],
                ["verifier", p["reason"].replace("|", "\\|"), c["reason"].replace("|", "\\|")],
                *reply]), *episode]


def changes_markdown(record: dict[str, Any]) -> str:
    """The "what changed" section: counts per failure mode and tool, then each listed task
    fixed and broken with both sides' replies side by side."""
    ch = record.get("changes")
    if not ch:
        return "## What changed\n\nnot recorded (a decision from before the gate kept it)\n"
    lines = ["## What changed", "",
             f"{ch['tasks']} holdout tasks compared on paired attempts: the candidate fixed "
             f"**{ch['fixed_count']}** and broke **{ch['broken_count']}**.",
             *_counts("Per failure mode", ch["per_mode"]), *_counts("Per tool", ch["per_tool"])]
    for title, items, count in (("Fixed", ch["fixed"], ch["fixed_count"]),
                                ("Broken", ch["broken"], ch["broken_count"])):
        lines += ["", f"### {title} ({len(items)} of {count} shown)"]
        for item in items:
            lines += _task(item)
    return "\n".join(lines) + "\n"


def _label(version: Any) -> str:
    return "base" if version is None else f"v{version}"


def report_markdown(evaluation: dict[str, Any]) -> str:
    """The whole decision (an `evaluations` row with its `record`) for a reviewer."""
    r = evaluation["record"]
    c, b = r["candidate"], r["baseline"]
    lines = [f"# Gate decision {evaluation['evaluation_id']}",
             "", f"{_label(r['version'])} against production {_label(r['baseline_version'])} "
             f"on eval set v{r['eval_set_version']}: the gate says **{r['recommendation']}**"
             f" (state {evaluation.get('state')}"
             + (f", decided by {evaluation['decided_by']}" if evaluation.get("decided_by")
                else "") + ").", "", "## Reasons", "", *(f"- {x}" for x in r["reasons"])]
    if r.get("warnings"):
        lines += ["", "## Warnings", "", *(f"- {w}" for w in r["warnings"])]
    lines += ["", "## Metrics", "", *_table(["metric", "production", "candidate"], [
        [k, f"{b[k]:.3f}", f"{c[k]:.3f}"] for k in (
            "success_rate", "mean_reward", "invalid_rate", "unsafe_rate") if k in c]
        + [["samples", str(b["samples"]), str(c["samples"])]])]
    lines += ["", "## Checks", "", *_table(["check", "passed", "detail"], [
        [x["name"], "yes" if x["passed"] else "**NO**", x["detail"].replace("|", "\\|")]
        for x in r["checks"]])]
    lines += _groups(r.get("group_tests") or {})
    lines += _canaries(r.get("canaries")) + _behaviour(r.get("behaviour") or {})
    gap = r.get("train_gap")
    if gap:
        lines += ["", "## Train vs holdout", "",
                  f"success {gap['train_success']:.3f} on {gap['tasks']} of its training tasks "
                  f"({gap['samples']} samples) vs {gap['holdout_success']:.3f} on holdout: gap "
                  f"{gap['gap']:+.3f} (warns above {gap['threshold']})"]
    return "\n".join(lines) + "\n\n" + changes_markdown(r)


def _groups(tests: dict[str, Any]) -> list[str]:
    if not tests:
        return []

    def ci(t: dict[str, Any]) -> str:
        return ("—" if t["ci_low"] is None
                else f"[{t['ci_low']:+.3f}, {t['ci_high']:+.3f}]")

    return ["", "## Per task group", "",
            "Paired over the pairs the test looked at; descriptive — the decision rests on the "
            "whole holdout's test. Interval: bootstrap over the group's tasks; p: exact "
            "one-sided McNemar, and Holm-adjusted over the groups.", "",
            *_table(["group", "tasks", "pairs", "won", "lost", "gain", "95% CI", "p", "p (Holm)"],
                    [[g, str(t["tasks"]), str(t["pairs"]), str(t["wins"]), str(t["losses"]),
                      f"{t['gain']:+.3f}", ci(t), f"{t['p_value']:.2g}", f"{t['p_holm']:.2g}"]
                     for g, t in tests.items()])]


def _canaries(found: dict[str, Any] | None) -> list[str]:
    if not found:
        return []
    per = ", ".join(f"{k} {v}" for k, v in found["per_env"].items())
    lines = ["", "## Verifier canaries", "",
             f"{found['checked']} canaries ({per}); {len(found['wrong'])} scored wrongly."]
    if found["wrong"]:
        lines += ["", *_table(["env", "task", "canary", "should be", "verifier said"], [
            [w["env"], w["task_id"][:8], w["canary"], w["expect"], w["got"].replace("|", "/")]
            for w in found["wrong"]])]
    lines += [f"- {env}: {why}" for env, why in found.get("skipped", {}).items()]
    return lines


def _behaviour(figs: dict[str, Any]) -> list[str]:
    if not figs:
        return []
    c, p = figs["candidate"], figs["production"]
    return ["", "## Behaviour", "", *_table(["figure", "production", "candidate"], [
        [k, f"{p[k]:.3f}", f"{c[k]:.3f}"] for k in (
            "empty_rate", "truncated_rate", "reply_chars", "calls_per_turn")]
        + [["attempts", str(p["attempts"]), str(c["attempts"])]])]
