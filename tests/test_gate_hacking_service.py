"""The reward-hacking checks through the gate service on real Postgres (sampling replaced by
known success rates, no model) and as a reviewer reads them: a planted verifier bug blocks a
promotion the numbers alone would make; `promotions show --diff` and `promotions report`
print what changed."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from flywheel.adapters import lifecycle
from flywheel.cli.main import app
from flywheel.config import DbSettings, GateSettings, Settings
from flywheel.db.engine import make_engine
from flywheel.db.outbox import append_events
from flywheel.demo.samples import TOOLS
from flywheel.environments import load_environment
from flywheel.environments.base import AnySpec, Environment, ToolSchemas
from flywheel.environments.calls import output_calls
from flywheel.environments.tool_call import ToolCallEnvironment
from flywheel.events import AdapterTrained, AdapterTrainedPayload, Event
from flywheel.gate import candidate as gate_service
from flywheel.gate.decision import Attempt, EvalRun
from flywheel.gate.evaluate import Holdout, task_groups
from flywheel.mining.store import freeze_eval_set, store_task
from flywheel.policy.base import AdapterRef
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec, VerifierResult

pytestmark = [pytest.mark.postgres]
runner = CliRunner()
RATES = {None: 0.2, 1: 0.8}


class FakeFormat:
    version = "fake-format.v1"


class FakePolicy:
    chat_format = FakeFormat()

    async def ensure_adapter(self, adapter: AdapterRef) -> None:
        pass


def _call(city: str) -> str:
    return f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}</tool_call>'


async def _sample(policy: Any, holdout: Holdout, adapter: AdapterRef | None,
                  settings: Settings, round_: int = 0, on_task: Any = None) -> EvalRun:
    """Each attempt succeeds with its version's rate, drawn from (version, task fingerprint,
    index): not the random task id, so every run draws alike; the reply says what it did."""
    version = adapter.version if adapter else None
    s = settings.gate.round_samples
    attempts = []
    for task in holdout.tasks:
        city = task.verifier.expected[0].arguments["city"]  # type: ignore[union-attr]
        for j in range(round_ * s, round_ * s + s):
            ok = random.Random(f"{version}/{task.fingerprint}/{j}").random() < RATES[version]
            reply = _call(city if ok else "Atlantis")
            attempts.append(Attempt(
                str(task.task_id), j, ok, 1.0 if ok else 0.4, False, False, 50.0, 10,
                failure_mode=None if ok else "bad_arguments", reply=reply,
                reply_chars=len(reply), finish_reason="stop", turns=1, calls=["get_weather"],
                calling_turns=1,
                components={"valid_json": 1.0, "right_tool": 1.0, "arguments": float(ok)}))
    return EvalRun(version, {str(t.task_id): task_groups(t) for t in holdout.tasks}, attempts)


async def _probe(*args: Any) -> tuple[list[float], list[float]]:
    return [50.0], [48.0]


class AnyCallToTheRightTool(ToolCallEnvironment):
    """The planted bug: a call to an expected tool is a success, whatever its arguments."""

    def verify(self, spec: AnySpec, output: object, *,
               tools: ToolSchemas | None = None) -> VerifierResult:
        assert isinstance(spec, ToolCallSpec) and isinstance(output, dict)
        if {c.name for c in output_calls(output)} & {e.name for e in spec.expected}:
            return VerifierResult(reward=1.0, reward_components={}, failure_mode=None)
        return super().verify(spec, output, tools=tools)


def _buggy(name: str) -> Environment:
    return AnyCallToTheRightTool() if name == "tool_call" else load_environment(name)


async def _gate(settings: Settings, monkeypatch: pytest.MonkeyPatch, sample: Any = _sample,
                probe: Any = _probe) -> list[Event]:
    """Holdout tasks, v1 trained, the gate on v1 (sampling by `sample`, probes by `probe`)."""
    engine = make_engine(str(settings.db.url))
    try:
        async with engine.begin() as conn:
            for i in range(12):
                task = TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                                messages=[{"role": "user", "content": f"Weather in c{i}?"}],
                                verifier=ToolCallSpec(expected=ExpectedCall(
                                    name="get_weather", arguments={"city": f"c{i}"})),
                                failure_mode="bad_arguments", fingerprint=f"h{i}",
                                split="holdout")
                await store_task(conn, task, uuid.uuid4(), "human_correction", settings.topics)
            await freeze_eval_set(conn, settings.topics)
            for i in range(3):  # training tasks: two trained on (in v1), one only sampled
                task = TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                                messages=[{"role": "user", "content": f"Weather in t{i}?"}],
                                verifier=ToolCallSpec(expected=ExpectedCall(
                                    name="get_weather", arguments={"city": f"t{i}"})),
                                failure_mode="bad_arguments", fingerprint=f"train{i}",
                                split="train")
                await store_task(conn, task, uuid.uuid4(), "human_correction", settings.topics)
                await conn.execute(text("""INSERT INTO rollout_groups (group_id, task_id,
                    adapter_version, env, scored, not_run, trainable, rollouts, worker,
                    duration_ms, consumed_as, trained_version) VALUES (:g, :t, NULL,
                    'tool_call', 4, 0, true, '[]', 'w', 1.0, :c, :v)"""),
                    {"g": uuid.uuid4(), "t": task.task_id, "c": "trained" if i < 2 else None,
                     "v": 1 if i < 2 else None})
            event = AdapterTrained(aggregate_id="policy@v1", payload=AdapterTrainedPayload(
                policy="policy", version=1, parent_version=None, path="/adapters/v1",
                stage="grpo", steps=1, groups=8, stale_dropped=0, metrics={}))
            await lifecycle.project(conn, event)
            await append_events(conn, [event], settings.topics)
        monkeypatch.setattr(gate_service, "evaluate", sample)
        monkeypatch.setattr(gate_service, "probe_latency", probe)
        gate = gate_service.GateService(settings, engine, FakePolicy())  # type: ignore[arg-type]

        async def ref(self: Any, v: int | None) -> AdapterRef | None:
            return None if v is None else AdapterRef("policy", v, Path("/x"))

        monkeypatch.setattr(type(gate.adapters), "__call__", ref)
        return await gate.evaluate_version(1)
    finally:
        await engine.dispose()


def _settings(db_url: str, tmp_path: Path, train_check_tasks: int = 0) -> Settings:
    return Settings(home=tmp_path / "home", db=DbSettings(url=db_url),
                    gate=GateSettings(samples_per_task=8, round_samples=4,
                                      group_min_samples=10_000,
                                      train_check_tasks=train_check_tasks))


def test_a_planted_verifier_bug_blocks_the_promotion(db_url: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gate_service, "load_environment", _buggy)
    events = asyncio.run(_gate(_settings(db_url, tmp_path), monkeypatch))
    assert [e.type for e in events] == ["AdapterEvaluated", "AdapterRejected"]
    record = events[0].payload
    failed = [c for c in record.checks if not c.passed]  # type: ignore[union-attr]
    assert [c.name for c in failed] == ["canaries"], failed  # it beat production otherwise
    assert "wrong_values" in failed[0].detail
    assert {w.canary for w in record.canaries.wrong} >= {  # type: ignore[union-attr]
        "wrong_values", "extra_call"}


def test_promotions_show_diff_and_report(db_url: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    events = asyncio.run(_gate(_settings(db_url, tmp_path, train_check_tasks=5), monkeypatch))
    assert [e.type for e in events] == ["AdapterEvaluated", "AdapterPromoted"]
    record = events[0].payload
    # Its own training tasks (the two trained on, not the one only sampled), one round each.
    gap = record.train_gap  # type: ignore[union-attr]
    assert gap is not None and (gap.tasks, gap.samples) == (2, 8)
    assert record.canaries is not None and record.canaries.wrong == []  # type: ignore[union-attr]
    ch = record.changes  # type: ignore[union-attr]
    assert ch is not None and ch.fixed_count > ch.broken_count
    monkeypatch.setenv("FLYWHEEL_DB__URL", db_url)
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    eid = str(record.evaluation_id)[:8]  # type: ignore[union-attr]

    diff = runner.invoke(app, ["promotions", "show", eid, "--diff"])
    assert diff.exit_code == 0, diff.output
    assert f"the candidate fixed **{ch.fixed_count}** and broke **{ch.broken_count}**" \
        in diff.stdout
    fixed = ch.fixed[0]
    assert f"#### task {fixed.task_id[:8]}" in diff.stdout
    # Both sides' replies side by side, each with the verifier's verdict.
    city = '"Atlantis"'
    row = next(line for line in diff.stdout.splitlines() if line.startswith("| reply"))
    assert city in row.split("|")[2] and city not in row.split("|")[3]
    assert "| verifier | bad_arguments: reward 0.40" in diff.stdout
    as_json = runner.invoke(app, ["promotions", "show", eid, "--diff", "--json"])
    assert json.loads(as_json.stdout)["fixed_count"] == ch.fixed_count

    report = runner.invoke(app, ["promotions", "report", eid])
    assert report.exit_code == 0, report.output
    md = report.stdout
    assert md.startswith(f"# Gate decision {record.evaluation_id}")  # type: ignore[union-attr]
    for section in ("## Reasons", "## Checks", "## Verifier canaries", "## Behaviour",
                    "## Train vs holdout", "## What changed", "### Per failure mode", "### Fixed"):
        assert section in md, section
    assert "| canaries | yes |" in md

    show = runner.invoke(app, ["promotions", "show", eid])
    assert "verifier canaries" in show.output and "what changed" in show.output


def test_the_first_latency_probe_waits_for_the_train_check(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The train-vs-holdout check samples beside round 1, but the round's latency probe is
    decoded only once it is done: a probe sharing the engine with one side's other attempts
    would charge that side for them (and with one probe, its p95 is that probe)."""
    in_flight: list[bool] = []
    probed_during_check: list[bool] = []

    async def sample(policy: Any, holdout: Holdout, adapter: AdapterRef | None,
                     settings: Settings, round_: int = 0, on_task: Any = None) -> EvalRun:
        train = all(t.fingerprint.startswith("train") for t in holdout.tasks)
        if train:
            in_flight.append(True)
            await asyncio.sleep(0.5)  # longer than round 1's two sides
            in_flight.pop()
        return await _sample(policy, holdout, adapter, settings, round_, on_task)

    async def probe(*args: Any) -> tuple[list[float], list[float]]:
        probed_during_check.append(bool(in_flight))
        return [50.0], [48.0]

    events = asyncio.run(_gate(_settings(db_url, tmp_path, train_check_tasks=5), monkeypatch,
                               sample, probe))
    assert [e.type for e in events] == ["AdapterEvaluated", "AdapterPromoted"]
    assert probed_during_check and not any(probed_during_check), probed_during_check
    gap = events[0].payload.train_gap  # type: ignore[union-attr]
    assert gap is not None and gap.samples == 8
