"""Registering toolsets as an operator does (`flywheel tools …`, the operator API), versioned in
the event log; `check` against a server that is down or speaks another protocol version
fails naming what failed, exits non-zero, and registers nothing — not half of anything."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from flywheel.api.operator import operator_lifespan
from flywheel.api.toolsets_routes import toolsets_router
from flywheel.cli.main import app
from flywheel.config import Settings
from flywheel.db.engine import make_engine
from flywheel.tools.registry import registry_catalog
from flywheel.tools.session import EpisodePlan, ToolSession
from flywheel.web.app import create_app
from tests.support.toolsets import NOTES, SERVER, http_server

pytestmark = [pytest.mark.postgres]
runner = CliRunner()
OLD = str(Path(SERVER).with_name("mcp_oldserver.py"))


async def _rows(db_url: str, sql: str) -> list[Any]:
    engine = make_engine(db_url)
    try:
        async with engine.connect() as conn:
            return list((await conn.execute(text(sql))).all())
    finally:
        await engine.dispose()


def rows(db_url: str, sql: str) -> list[Any]:
    return asyncio.run(_rows(db_url, sql))


def events(db_url: str) -> list[tuple[str, dict[str, Any]]]:
    return [(r.type, r.payload) for r in rows(
        db_url, "SELECT type, payload FROM events WHERE type LIKE 'Toolset%' ORDER BY seq")]


@pytest.fixture
def cli_env(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("FLYWHEEL_DB__URL", db_url)
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    monkeypatch.setenv("NOTES_TOKEN", "s3cret")
    return db_url


def test_add_show_check_and_remove_from_the_cli(cli_env: str, tmp_path: Path) -> None:
    db_url = cli_env
    with http_server(tmp_path / "calls.jsonl") as (config, server):
        added = runner.invoke(app, ["tools", "add", "notes", "--mcp-http", config.url,
                                    "--header", "Authorization=Bearer ${NOTES_TOKEN}",
                                    "--header", "X-Team=literal-secret", "--json"])
        assert added.exit_code == 0, added.output
        out = json.loads(added.stdout)
        assert (out["version"], out["kind"], out["new_version"]) == (1, "mcp_http", True)
        assert out["destructive"] == ["clear_counter", "wipe_notes"] and out["allowed_live"] == []
        assert out["state"] is True and out["protocol_version"] == "2026-07-28"

        again = runner.invoke(app, ["tools", "check", "notes", "--json"])
        assert again.exit_code == 0, again.output
        assert json.loads(again.stdout)["new_version"] is False  # nothing changed
        server.terminate()
        server.wait(10)
        down = runner.invoke(app, ["tools", "check", "notes"])
    assert down.exit_code == 2
    assert f"MCP server at {config.url} is unreachable" in down.output
    assert "nothing was registered" in down.output
    assert [r.version for r in rows(db_url, "SELECT version FROM toolsets")] == [1]
    ((kind, payload),) = events(db_url)
    assert kind == "ToolsetRegistered" and payload["version"] == 1
    # A `${NAME}` reference stays readable, a literal secret never reaches the event log.
    assert payload["config"]["headers"] == {"Authorization": "Bearer ${NOTES_TOKEN}",
                                            "X-Team": "***"}
    assert {t["name"]: t["destructive"] for t in payload["tools"]}["wipe_notes"] is True

    shown = runner.invoke(app, ["tools", "show", "notes", "--json"])
    assert shown.exit_code == 0, shown.output
    detail = json.loads(shown.stdout)
    assert detail["config"]["headers"]["X-Team"] == "***"
    assert {t["name"] for t in detail["tool_schemas"]} >= {"add_note", "bump", "wipe_notes"}
    assert "flywheel_reset" not in {t["name"] for t in detail["tool_schemas"]}

    removed = runner.invoke(app, ["tools", "rm", "notes"])
    assert removed.exit_code == 0, removed.output
    assert json.loads(runner.invoke(app, ["tools", "ls", "--json"]).stdout) == []
    assert [k for k, _ in events(db_url)] == ["ToolsetRegistered", "ToolsetRemoved"]
    assert runner.invoke(app, ["tools", "rm", "notes"]).exit_code == 2


@pytest.mark.parametrize("argv, said", [
    ([f"{sys.executable} {OLD}"], "speaks an MCP protocol version this client does not: "
                                  "Unsupported protocol version from the server: 2023-06-01"),
    (["/nonexistent/mcp-server --stdio"], "could not be started"),
    ([f"{sys.executable} -c \"import sys; print('no config', file=sys.stderr); sys.exit(3)\""],
     "closed the connection before the MCP handshake finished (its stderr: no config)"),
])
def test_a_server_that_cannot_be_read_registers_nothing(cli_env: str, argv: list[str],
                                                        said: str) -> None:
    result = runner.invoke(app, ["tools", "add", "old", "--mcp-stdio", *argv])
    assert result.exit_code == 2
    assert said in " ".join(result.output.split()), result.output
    assert rows(cli_env, "SELECT * FROM toolsets") == []
    assert events(cli_env) == []


def test_versions_follow_the_configuration_and_config_declared_toolsets_sync(
        cli_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    first = runner.invoke(app, ["tools", "add", "py", "--python", NOTES, "--json"])
    assert json.loads(first.stdout)["version"] == 1, first.output
    denied = runner.invoke(app, ["tools", "add", "py", "--python", NOTES, "--deny", "bump",
                                 "--json"])
    assert json.loads(denied.stdout)["destructive"] == ["bump", "wipe_notes"]
    assert json.loads(denied.stdout)["version"] == 2
    same = runner.invoke(app, ["tools", "add", "py", "--python", NOTES, "--deny", "bump",
                               "--json"])
    assert (json.loads(same.stdout)["version"], json.loads(same.stdout)["new_version"]) == (
        2, False)
    typo = runner.invoke(app, ["tools", "add", "py", "--python", NOTES, "--deny", "bmup"])
    assert typo.exit_code == 2 and "deny names ['bmup']" in typo.output

    monkeypatch.setenv("FLYWHEEL_TOOLS__TOOLSETS", json.dumps(
        {"declared": {"kind": "python", "target": NOTES, "on_divergence": "live"}}))
    synced = runner.invoke(app, ["tools", "sync", "--json"])
    assert json.loads(synced.stdout) == [{"name": "declared", "version": 1,
                                          "new_version": True}], synced.output
    listed = {r["name"]: r for r in json.loads(runner.invoke(app, ["tools", "ls", "--json"]
                                                              ).stdout)}
    assert listed["declared"]["on_divergence"] == "live" and listed["py"]["version"] == 2


async def test_services_find_registered_toolsets_through_the_registry(
        cli_env: str, engine: Any) -> None:
    result = await asyncio.to_thread(runner.invoke, app, ["tools", "add", "py", "--python",
                                                          NOTES])
    assert result.exit_code == 0, result.output
    catalog = registry_catalog(engine, refresh_s=0.0)
    runtime = await catalog.runtime("py")
    (session,) = await runtime.open_sessions([EpisodePlan(key="k")])
    assert isinstance(session, ToolSession)
    assert (await session.call("bump", {"by": 3})).observation == "counter is 3"
    # A new version applies to episodes started after it; this one finishes on v1.
    await asyncio.to_thread(runner.invoke, app, ["tools", "add", "py", "--python", NOTES,
                                                 "--deny", "bump"])
    newer = await catalog.runtime("py")
    assert (runtime.registration.version, newer.registration.version) == (1, 2)
    assert newer.unsafe == {"bump", "wipe_notes"}
    assert (await session.call("bump", {"by": 1})).observation == "counter is 4"
    await runtime.close_session(session)
    await asyncio.to_thread(runner.invoke, app, ["tools", "rm", "py"])
    with pytest.raises(Exception, match="no such toolset is registered"):
        await catalog.runtime("py")
    await catalog.aclose()


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    s = settings.model_copy(update={"api": settings.api.model_copy(update={
        "tokens": {"pub": ["publish"], "ops": ["operate"]}, "serve": False})})
    application = create_app(s, routers=[toolsets_router()], lifespan_hooks=[operator_lifespan])
    async with application.router.lifespan_context(application), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=application), base_url="http://api") as client:
        yield client


async def test_the_operator_api_registers_checks_and_removes(
        api: httpx.AsyncClient, settings: Settings) -> None:
    body = {"name": "py", "config": {"kind": "python", "target": NOTES}}
    assert (await api.post("/v1/toolsets", json=body)).status_code == 401
    pub = {"Authorization": "Bearer pub"}
    ops = {"Authorization": "Bearer ops", "X-Flywheel-Actor": "alice"}
    assert (await api.post("/v1/toolsets", json=body, headers=pub)).status_code == 403
    made = await api.post("/v1/toolsets", json=body, headers=ops)
    assert made.status_code == 201, made.text
    assert made.json()["version"] == 1
    assert [t["name"] for t in (await api.get("/v1/toolsets", headers=pub)).json()] == ["py"]
    shown = (await api.get("/v1/toolsets/py", headers=pub)).json()
    assert shown["versions"][0]["registered_by"].startswith("alice (token ")
    checked = await api.post("/v1/toolsets/py/check", headers=ops)
    assert checked.status_code == 200 and checked.json()["new_version"] is False
    bad = {"name": "old", "config": {"kind": "mcp_stdio", "command": sys.executable,
                                     "args": [OLD]}}
    refused = await api.post("/v1/toolsets", json=bad, headers=ops)
    assert refused.status_code == 502 and "2023-06-01" in refused.json()["detail"]
    assert (await api.get("/v1/toolsets/old", headers=pub)).status_code == 404
    assert (await api.delete("/v1/toolsets/py", headers=ops)).status_code == 200
    assert (await api.delete("/v1/toolsets/py", headers=ops)).status_code == 404
    assert (await api.get("/v1/toolsets", headers=pub)).json() == []
