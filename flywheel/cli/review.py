"""Operator commands: `flywheel promotions …`, `flywheel adapters …`, `flywheel replay`.

Actions are the same lifecycle commands the API runs (one transaction each, audited as
events with the operator's user@host as actor).
"""

from __future__ import annotations

import getpass
import socket
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from flywheel.cli.common import JsonOpt, console, db_call, fail, load_settings, print_result

promotions_app = typer.Typer(no_args_is_help=True,
                             help="Gate decisions: review, approve, reject.")
adapters_app = typer.Typer(no_args_is_help=True,
                           help="Adapter versions: lineage, status, rollback.")
Reason = Annotated[str, typer.Option("--reason", help="Why (kept in the audit log).")]


def _actor() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()} (cli)"


def _lifecycle_call(fn: Any) -> Any:
    from flywheel.adapters.lifecycle import LifecycleError

    try:
        return db_call(fn)
    except LifecycleError as err:
        fail(str(err))


def _evaluation_id(conn: Any, ref: str) -> Any:
    from flywheel.adapters.queries import resolve_evaluation

    async def go() -> Any:
        found = await resolve_evaluation(conn, ref)
        if found is None:
            from flywheel.adapters.lifecycle import NotFound

            raise NotFound(f"no single evaluation matches {ref!r}: see `flywheel promotions ls`")
        return found

    return go()


def validation_line(v: dict[str, Any], splits: dict[str, int]) -> tuple[str, str]:
    """`flywheel status`'s validation row: the split, the state, the newest version's
    validation success against its training reward."""
    if v["state"] == "absent" and not v["tasks"]:
        return "validation", ("no validation split yet (candidates by "
                              "trainer.propose_min_groups)")
    colour = "red" if v["state"] == "overfitting" else "green"
    text = (f"{v['tasks']} tasks (train {splits.get('train', 0)}, holdout "
            f"{splits.get('holdout', 0)}); [{colour}]{v['state']}[/{colour}]")
    n = v.get("newest")
    if n:
        train = "" if n["train_reward"] is None else (
            f", training reward {n['train_reward']:.2f} (gap {n['gap']:+.2f})")
        text += f"; v{n['version']}: validation {n['validation_success']:.2f}{train}"
    if v.get("detail"):
        text += f" — {v['detail']}"
    return "validation", text


def gate_lines(gate: dict[str, Any]) -> list[tuple[str, str]]:
    """`flywheel status` rows of the gate: its activity and what the eval set can see."""
    from flywheel.adapters.lifecycle import version_label

    state = gate["state"]
    if state == "evaluating":
        doing = (f"evaluating v{gate['version']} against "
                 f"{version_label(gate['baseline_version'])}: {gate['samples_done']}/"
                 f"{gate['samples_planned']} samples, round {gate['round']}/"
                 f"{gate['rounds_planned']}, {gate['elapsed_s'] or 0:.0f}s")
    elif state == "baseline":
        doing = (f"measuring the base model: {gate['samples_done']}/"
                 f"{gate['samples_planned']} samples, {gate['elapsed_s'] or 0:.0f}s")
    else:
        doing = state + (f" ({gate['detail']})" if state == "down" else "")
    rows = [("gate", doing)]
    if gate["detail"] and state == "evaluating":
        rows.append(("gate test", gate["detail"]))
    power = gate["power"]
    if power is not None:
        rows.append(("eval set MDE", power_line(power)))
    return rows


def hacking_lines(record: dict[str, Any]) -> list[str]:
    """`promotions show` lines of the reward-hacking checks (absent in older records)."""
    lines = []
    found = record.get("canaries")
    if found:
        wrong = ", ".join(f"{w['env']} {w['canary']} ({w['got']})" for w in found["wrong"][:5])
        lines.append(f"[bold]verifier canaries[/bold]: {found['checked']} checked, "
                     f"{len(found['wrong'])} scored wrongly" + (f": {wrong}" if wrong else ""))
    figs = record.get("behaviour") or {}
    if figs:
        c, p = figs["candidate"], figs["production"]
        lines.append(f"[bold]behaviour[/bold] (production → candidate): empty "
                     f"{p['empty_rate']:.3f} → {c['empty_rate']:.3f}, truncated "
                     f"{p['truncated_rate']:.3f} → {c['truncated_rate']:.3f}, reply chars "
                     f"{p['reply_chars']:.0f} → {c['reply_chars']:.0f}, calls/turn "
                     f"{p['calls_per_turn']:.2f} → {c['calls_per_turn']:.2f}")
    gap = record.get("train_gap")
    if gap:
        lines.append(f"[bold]train vs holdout[/bold]: {gap['train_success']:.3f} vs "
                     f"{gap['holdout_success']:.3f} (gap {gap['gap']:+.3f}, warns above "
                     f"{gap['threshold']})")
    ch = record.get("changes")
    if ch:
        lines.append(f"[bold]what changed[/bold]: fixed {ch['fixed_count']}, broke "
                     f"{ch['broken_count']} of {ch['tasks']} tasks (--diff for the tasks)")
    lines += [f"[yellow]warning:[/yellow] {w}" for w in record.get("warnings", [])]
    return lines


def group_lines(record: dict[str, Any]) -> list[str]:
    """`promotions show` lines of each task group's paired comparison (absent in older
    records): wins, losses, gain with its interval, McNemar p (Holm-adjusted)."""
    from flywheel.events import GroupTest
    from flywheel.gate.groups import group_line

    tests = record.get("group_tests") or {}
    if not tests:
        return []
    return ["[bold]per task group[/bold] (paired, descriptive; the decision rests on the "
            "whole holdout's test):",
            *(f"  {group_line(g, GroupTest.model_validate(t))}" for g, t in tests.items())]


def power_line(power: dict[str, Any]) -> str:
    return (f"{power['mde']:+.3f} at {power['tasks']} tasks × k = {power['samples_per_task']} "
            f"(alpha {power['alpha']}, power {power['power']:.0%}, asked to find "
            f"{power['design_gain']:+.3f}; discordance {power['discordance']:.3f} from "
            f"{power['discordance_source']})")


@promotions_app.command("ls")
def promotions_ls(state: Annotated[str | None, typer.Option(
        help="pending, promoted, rejected or superseded")] = None,
        as_json: JsonOpt = False) -> None:
    """Gate decision records, newest first."""
    from flywheel.adapters.queries import list_evaluations

    policy = load_settings().policy
    rows = db_call(lambda conn: list_evaluations(conn, policy, state=state))
    if as_json:
        print_result(rows, True)
        return
    table = Table("id", "version", "vs", "success", "p", "samples", "MDE", "stop",
                  "gate says", "state", "by")
    for r in rows:
        c, b = r["candidate"], r["baseline"]
        table.add_row(r["evaluation_id"][:8], f"v{r['version']}",
                      f"v{r['baseline_version']}" if r["baseline_version"] else "base",
                      f"{b['success_rate']:.2f} → {c['success_rate']:.2f}",
                      f"{r['p_value']:.3f}", str(c["samples"]),
                      "" if r["mde"] is None else f"{r['mde']:+.3f}", r["stop"] or "",
                      r["recommendation"], r["state"], r["decided_by"] or "")
    Console().print(table)


def _get_evaluation(evaluation: str) -> Any:
    from flywheel.adapters.queries import get_evaluation

    async def go(conn: Any) -> Any:
        return await get_evaluation(conn, await _evaluation_id(conn, evaluation))

    return _lifecycle_call(go)


@promotions_app.command("show")
def promotions_show(evaluation: str, as_json: JsonOpt = False,
                    diff: Annotated[bool, typer.Option(
                        "--diff", help="Print what changed: the holdout tasks the candidate "
                        "fixed and broke, both sides' replies side by side.")] = False) -> None:
    """One decision record: both sides' metrics, thresholds, test, reasons."""
    found = _get_evaluation(evaluation)
    if diff:
        from flywheel.gate.report import changes_markdown

        if as_json:
            print_result(found["record"].get("changes"), True)
        else:
            print(changes_markdown(found["record"]), end="")
        return
    if not as_json:
        record = found["record"]
        if record.get("power"):
            console.print(f"[bold]what this evaluation could see[/bold]: MDE "
                          f"{power_line(record['power'])}")
            if record["power"].get("warning"):
                console.print(f"[yellow]warning:[/yellow] {record['power']['warning']}")
        if record.get("sequential"):
            s = record["sequential"]
            console.print(f"[bold]sequential test[/bold]: {len(s['rounds'])} of "
                          f"{s['rounds_planned']} rounds, {s['samples_per_task']} samples per "
                          f"task and side, {s['pairs']} pairs; stopped ({s['stop']}): "
                          f"{s['reason']}")
        console.print(f"[bold]latency guard[/bold]: measured by {record.get('latency')}")
        for line in group_lines(record):
            console.print(line)
        for line in hacking_lines(record):
            console.print(line)
    print_result(found, as_json)


@promotions_app.command("report")
def promotions_report(evaluation: str) -> None:
    """The decision as Markdown for a reviewer: reasons, checks, canaries, behaviour, the
    train gap and what changed (`flywheel promotions report ID > report.md`)."""
    from flywheel.gate.report import report_markdown

    print(report_markdown(_get_evaluation(evaluation)), end="")


@promotions_app.command("approve")
def promotions_approve(evaluation: str, reason: Reason,
                       force: Annotated[bool, typer.Option(
                           help="Promote against the gate's reject recommendation.")] = False,
                       as_json: JsonOpt = False) -> None:
    """Promote the evaluated candidate (manual mode, or overriding with --force)."""
    from flywheel.adapters.lifecycle import approve, version_label

    topics = load_settings().topics

    async def go(conn: Any) -> Any:
        event = await approve(conn, await _evaluation_id(conn, evaluation), actor=_actor(),
                              reason=reason, topics=topics, force=force)
        return event.model_dump(mode="json")

    event = _lifecycle_call(go)
    if as_json:
        print_result(event, True)
    else:
        console.print(f"promoted v{event['payload']['version']} (was "
                      f"{version_label(event['payload']['previous_version'])})")


@promotions_app.command("reject")
def promotions_reject(evaluation: str, reason: Reason, as_json: JsonOpt = False) -> None:
    """Reject the evaluated candidate."""
    from flywheel.adapters.lifecycle import reject

    topics = load_settings().topics

    async def go(conn: Any) -> Any:
        event = await reject(conn, await _evaluation_id(conn, evaluation), actor=_actor(),
                             reason=reason, topics=topics)
        return event.model_dump(mode="json")

    event = _lifecycle_call(go)
    if as_json:
        print_result(event, True)
    else:
        console.print(f"rejected v{event['payload']['version']}")


@adapters_app.command("ls")
def adapters_ls(as_json: JsonOpt = False) -> None:
    """Every version: lineage, stage, status, training reward, validation success and the
    gap between them, holdout success; production marked."""
    from flywheel.adapters.lifecycle import version_label
    from flywheel.adapters.queries import list_adapters, production
    from flywheel.validation.store import curve_rows

    policy = load_settings().policy

    async def go(conn: Any) -> Any:
        curve = {r["version"]: r for r in await curve_rows(conn, policy)}
        none = dict.fromkeys(("train_reward", "validation_success", "gap"))
        return {"production": await production(conn, policy),
                "adapters": [{**a, **{k: curve.get(a["version"], none)[k] for k in none}}
                             for a in await list_adapters(conn, policy)]}

    data = db_call(go)
    if as_json:
        print_result(data, True)
        return
    table = Table("", "version", "parent", "stage", "steps", "status", "train reward",
                  "validation", "gap", "holdout success")

    def num(x: float | None, fmt: str = ".2f") -> str:
        return "" if x is None else format(x, fmt)

    for a in data["adapters"]:
        table.add_row("★" if a["production"] else "", f"v{a['version']}",
                      version_label(a["parent_version"]), a["stage"], str(a["steps"]), a["status"],
                      num(a["train_reward"]), num(a["validation_success"]), num(a["gap"], "+.2f"),
                      num(a["holdout_success"]))
    Console().print(table)
    p = data["production"]
    console.print(f"production: {version_label(p['version'])}; serving: "
                  f"{p['served_name'] or 'not switched yet'}")


@adapters_app.command("show")
def adapters_show(version: int, as_json: JsonOpt = False) -> None:
    """One version: manifest facts, its events (audit trail) and its evaluations."""
    from flywheel.adapters.queries import get_adapter

    policy = load_settings().policy
    found = db_call(lambda conn: get_adapter(conn, policy, version))
    if found is None:
        fail(f"no adapter version {version} (see `flywheel adapters ls`)")
    print_result(found, as_json)


@adapters_app.command("rollback")
def adapters_rollback(reason: Reason,
                      to: Annotated[str | None, typer.Option(
                          "--to", help="Version (e.g. 3 or v3), or `base`; default: the "
                          "previous production version.")] = None,
                      as_json: JsonOpt = False) -> None:
    """Re-point production to an earlier promoted version; serving follows."""
    from flywheel.adapters.lifecycle import BASE, rollback, version_label

    target: int | None = None
    if to is not None:
        if to == "base":
            target = BASE
        elif to.lstrip("v").isdigit():
            target = int(to.lstrip("v"))
        else:
            fail(f"--to takes a version like 3 or v3, or `base` (got {to!r})")
    settings = load_settings()

    async def go(conn: Any) -> Any:
        event = await rollback(conn, settings.policy, to=target, actor=_actor(),
                               reason=reason, topics=settings.topics)
        return event.model_dump(mode="json")

    event = _lifecycle_call(go)
    if as_json:
        print_result(event, True)
    else:
        p = event["payload"]
        console.print(f"rolled back {version_label(p['from_version'])} → "
                      f"{version_label(p['to_version'])}; serving switches once every "
                      "replica has it")


@adapters_app.command("evaluate")
def adapters_evaluate(version: int, as_json: JsonOpt = False) -> None:
    """Run the gate on VERSION now (e.g. a rolled-back version, before it may be promoted
    again). Loads the policy engine in this process."""
    import asyncio

    from flywheel.adapters.lifecycle import LifecycleError
    from flywheel.db.engine import make_engine
    from flywheel.gate.candidate import GateService
    from flywheel.policy.factory import make_policy
    from flywheel.runtime.endpoints import resolve_db_url
    from flywheel.tools.registry import registry_catalog
    from flywheel.tools.runtime import use_catalog

    settings = load_settings()

    async def go() -> Any:
        engine = make_engine(resolve_db_url(settings), pool_size=2)
        policy = make_policy(settings)
        toolsets = registry_catalog(engine, settings.tools.registry_refresh_s)
        use_catalog(toolsets)
        try:
            events = await GateService(settings, engine, policy).evaluate_version(version)
            return [e.model_dump(mode="json") for e in events]
        finally:
            await policy.close()
            await toolsets.aclose()
            await engine.dispose()

    try:
        events = asyncio.run(go())
    except LifecycleError as err:
        fail(str(err))
    if as_json:
        print_result(events, True)
    else:
        for e in events:
            console.print(f"{e['type']}: " + "; ".join(e["payload"].get("reasons", [])
                                                        or [e["payload"].get("reason", "")]))


def replay(as_json: JsonOpt = False) -> None:
    """Drop the adapter-lifecycle projections and rebuild them from the event log."""
    from flywheel.adapters.lifecycle import replay as rebuild
    from flywheel.adapters.lifecycle import snapshot

    async def go(conn: Any) -> Any:
        before = await snapshot(conn)
        events = await rebuild(conn)
        after = await snapshot(conn)
        differ = sorted(t for t in before if before[t] != after[t])
        return {"events": events, "identical": not differ, "tables_differing": differ,
                "rows": {t: len(rows) for t, rows in after.items()}}

    result = db_call(go)
    if as_json:
        print_result(result, True)
    else:
        console.print(f"replayed {result['events']} events; rows {result['rows']}; "
                      + ("state identical" if result["identical"]
                         else f"DIFFERS in {result['tables_differing']}"))
