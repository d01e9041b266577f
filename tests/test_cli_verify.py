"""`flywheel verify check|profile` and `flywheel tasks ls|show` as an operator runs them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.config import Topics
from flywheel.db.engine import make_engine
from flywheel.demo.simulate import simulate
from flywheel.mining.mine_batch import mine_batch
from flywheel.trajectory import parse_trajectory

pytestmark = [pytest.mark.postgres]
runner = CliRunner()


async def _mined(db_url: str) -> None:
    engine = make_engine(db_url)
    async with engine.begin() as conn:
        records = simulate(1200, agents=3, failure_rate=0.5, seed=4)
        await mine_batch(conn, [parse_trajectory(r) for r in records], holdout_fraction=0.2,
                         topics=Topics.for_prefix("t"))
    await engine.dispose()


def test_tasks_and_verify_commands(db_url: str, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(_mined(db_url))  # the CLI runs its own event loop: this test is sync
    monkeypatch.setenv("FLYWHEEL_DB__URL", db_url)
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))

    ls = runner.invoke(app, ["tasks", "ls", "--env", "tool_call", "--json", "--limit", "5"])
    assert ls.exit_code == 0, ls.output
    rows = json.loads(ls.stdout)
    assert len(rows) == 5 and all(r["env"] == "tool_call" for r in rows)

    show = runner.invoke(app, ["tasks", "show", rows[0]["task_id"], "--json"])
    assert show.exit_code == 0, show.output
    task = json.loads(show.stdout)
    assert task["sources"] and task["split"] in {"train", "holdout"}
    assert task["verifier"]["kind"] == "tool_call"

    spec = {k: task[k] for k in ("task_id", "env", "messages", "tools", "verifier",
                                 "failure_mode", "fingerprint", "split")}
    (tmp_path / "task.json").write_text(json.dumps(spec))
    (expected,) = task["verifier"]["expected"]  # the simulated support agent: one call
    right_text = json.dumps({"tool": expected["name"], "arguments": expected["arguments"]})
    right_message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {
            "name": expected["name"], "arguments": json.dumps(expected["arguments"])}}]}
    outputs = [right_text, right_message, [expected], "not json at all",
               json.dumps({"tool": "nope", "arguments": {}}),
               {"role": "assistant", "content": "Done!", "tool_calls": []}]
    (tmp_path / "out.jsonl").write_text("\n".join(json.dumps(o) for o in outputs))
    check = runner.invoke(app, ["verify", "check", "--task", str(tmp_path / "task.json"),
                                "--outputs", str(tmp_path / "out.jsonl"), "--json"])
    assert check.exit_code == 0, check.output
    results = [json.loads(line) for line in check.stdout.splitlines()]
    assert [r["reward"] == 1.0 for r in results] == [True, True, True, False, False, False]
    assert results[3]["failure_mode"] == "invalid_format"
    assert results[4]["failure_mode"] == "hallucinated_tool"
    assert results[5]["failure_mode"] == "invalid_format"

    # The model's raw replies, parsed with the policy's chat format as rollouts parse them.
    call = json.dumps({"name": expected["name"], "arguments": expected["arguments"]})
    replies = [f"<tool_call>\n{call}\n</tool_call>", "Sure, done.",
               '<tool_call>\n{"name": "get_w']
    (tmp_path / "raw.jsonl").write_text("\n".join(json.dumps(o) for o in replies))
    check = runner.invoke(app, ["verify", "check", "--task", str(tmp_path / "task.json"),
                                "--outputs", str(tmp_path / "raw.jsonl"), "--raw", "--json"])
    assert check.exit_code == 0, check.output
    results = [json.loads(line) for line in check.stdout.splitlines()]
    assert [(r["reward"], r["failure_mode"]) for r in results] == [
        (1.0, None), (0.0, "invalid_format"), (0.0, "invalid_format")]

    # A task file in the new shape: two parallel calls, one argument with alternatives.
    two = {**spec, "verifier": {"kind": "tool_call", "unsafe_tools": [], "expected": [
        {"name": "get_weather", "arguments": {"city": "Oslo"},
         "alternatives": {"city": ["Oslo, Norway"]}},
        {"name": "get_weather", "arguments": {"city": "Lima"}}]}, "tools": [
        {"type": "function", "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}]}
    (tmp_path / "two.json").write_text(json.dumps(two))
    calls = [{"name": "get_weather", "arguments": {"city": "lima"}},
             {"name": "get_weather", "arguments": {"city": "oslo, norway"}}]
    (tmp_path / "two.jsonl").write_text("\n".join(json.dumps(o) for o in (calls, calls[:1])))
    check = runner.invoke(app, ["verify", "check", "--task", str(tmp_path / "two.json"),
                                "--outputs", str(tmp_path / "two.jsonl"), "--json"])
    assert check.exit_code == 0, check.output
    both, one = (json.loads(line) for line in check.stdout.splitlines())
    assert both["reward"] == 1.0
    assert (one["reward"], one["failure_mode"]) == (0.55, "incomplete")

    for env in ("tool_call", "workplace", "code"):
        prof = runner.invoke(app, ["verify", "profile", "--env", env, "--sample", "40",
                                   "--json"])
        assert prof.exit_code == 0, prof.output
        data = json.loads(prof.stdout)
        attempts = data["production_attempts"]
        assert attempts["count"] > 0
        # These failed in production, but not all at the call: a tool error, a timeout or a
        # user's complaint after a right call leaves the call itself correct.
        assert attempts["exact_success"] < 0.75, (env, attempts)
        if data["reference"] is not None:
            assert data["reference"]["exact_success"] == 1.0, (env, data["reference"])

    bad = runner.invoke(app, ["tasks", "show", "not-a-uuid"])
    assert bad.exit_code == 2 and "not a task id" in bad.output


def test_evalset_freeze_reports_what_the_gate_can_see(db_url: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(_mined(db_url))
    monkeypatch.setenv("FLYWHEEL_DB__URL", db_url)
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    monkeypatch.setenv("FLYWHEEL_ROLLOUT__ENVS", '["tool_call"]')
    monkeypatch.setenv("FLYWHEEL_GATE__SAMPLES_PER_TASK", "4")
    frozen = runner.invoke(app, ["evalset", "freeze", "--json"])
    assert frozen.exit_code == 0, frozen.output
    out = json.loads(frozen.stdout)
    power = out["power"]
    assert out["version"] == 1 and 0 < power["tasks"] < out["tasks"]  # tool_call only
    assert power["samples_per_task"] == 4 and power["pairs"] == 4 * power["tasks"]
    assert power["discordance"] == 0.5 and "assumed" in power["discordance_source"]
    assert "cannot see the gains it is asked to find" in power["warning"]
    status = runner.invoke(app, ["evalset", "freeze"])  # the words, for people
    assert status.exit_code == 0 and "MDE +" in status.output and "warning" in status.output
