"""The dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright)
against the real API over HTTP and real Postgres: token prompt, curves, the decision table,
approve and rollback, with the effect checked in Postgres."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
import uvicorn
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.api.server import build_app
from flywheel.config import Settings
from flywheel.events import GateMetrics
from flywheel.gate.baseline import store_baseline
from flywheel.stack.broker import free_port
from tests.test_adapters_lifecycle import evaluate, train, with_mode
from tests.test_api_metrics import evaluation_id, seed_lifecycle, seed_pipeline

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
playwright_api = pytest.importorskip(
    "playwright.async_api", reason="the playwright package is missing: pip install -e '.[dev]'")


def chromium() -> str:
    """Debian's chromium; installed here when missing and we may (root with apt-get), as
    `make test` does. Playwright never downloads a browser."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run("apt-get update -qq && apt-get install -y -qq chromium", shell=True,
                       env=env, capture_output=True, timeout=900, check=False)
        found = shutil.which("chromium")
    if found is None:
        pytest.skip("chromium is not installed and cannot be installed here (needs root and "
                    "apt-get): run `apt-get install chromium`")
    return found


class Server:
    """uvicorn serving `app` on a free port, in its own thread and event loop."""

    def __init__(self, settings: Settings) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(settings), host="127.0.0.1", port=self.port,
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the API did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@dataclass
class Seeded:
    pending: uuid.UUID


@pytest.fixture
async def seeded(engine: AsyncEngine, settings: Settings, pg_dsn: str) -> Seeded:
    """v1 in production, v2 evaluated and awaiting review (the gate says promote), v3 a
    candidate; failures, tasks, a trainer heartbeat and a baseline record."""
    await seed_pipeline(pg_dsn)
    pending = await seed_lifecycle(engine, settings)
    base = GateMetrics(version=None, tasks=30, samples=120, not_run=0, success_rate=0.25,
                       mean_reward=0.3, invalid_rate=0.05, unsafe_rate=0.0,
                       latency_mean_ms=40.0, latency_p95_ms=80.0, tokens_per_task=12.0,
                       groups={}, group_samples={})
    async with engine.begin() as conn:
        await store_baseline(conn, "policy", 1, base, None, settings.gate)
        recommendation = (await conn.execute(text(
            "SELECT recommendation FROM evaluations WHERE evaluation_id = :id"),
            {"id": pending})).scalar()
    assert recommendation == "promote"
    return Seeded(pending)


@pytest.fixture
def server(settings: Settings) -> Iterator[Server]:
    s = settings.model_copy(update={"api": settings.api.model_copy(update={
        "tokens": {"reader": [], "ops-token": ["operate"]}, "serve": False})})
    with Server(s) as srv:
        yield srv


async def fetch(dsn: str, sql: str, *args: object) -> asyncpg.Record:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(sql, *args)
        assert row is not None
        return row
    finally:
        await conn.close()


async def test_operator_approves_and_rolls_back_from_the_dashboard(
        server: Server, seeded: Seeded, pg_dsn: str, engine: AsyncEngine,
        settings: Settings) -> None:
    expect = playwright_api.expect
    expect.set_options(timeout=10_000)  # two shared CPU cores in CI: be patient, not flaky
    async with playwright_api.async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium(), headless=True,
                                          args=["--no-sandbox", "--disable-gpu"])
        page = await browser.new_page()
        problems: list[str] = []
        page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
        # A CSP violation or a failed script shows up here.
        page.on("console", lambda msg: problems.append(msg.text) if msg.type == "error"
                and "401" not in msg.text else None)
        try:
            await page.goto(server.url + "/")
            assert page.url == server.url + "/dashboard"

            # The token comes first; a wrong one is refused with a readable message.
            await expect(page.get_by_test_id("token-form")).to_be_visible()
            await expect(page.locator("#app")).to_be_hidden()
            await page.fill("#token-input", "not-a-token")
            await page.click("#token-submit")
            await expect(page.get_by_test_id("token-error")).to_contain_text("401")

            # A read-only token sees everything, and no action.
            await page.fill("#token-input", "reader")
            await page.click("#token-submit")
            decisions = page.get_by_test_id("decisions-table")
            row = decisions.locator(f'tr[data-evaluation-id="{seeded.pending}"]')
            await expect(row).to_have_attribute("data-state", "pending")
            await expect(row.get_by_test_id("approve")).to_have_count(0)
            await expect(row).to_contain_text("needs an operate token")
            await expect(page.get_by_test_id("rollback")).to_be_hidden()
            await page.click("#signout-button")

            await page.fill("#token-input", "ops-token")
            await page.fill("#actor-input", "alice")
            await page.click("#token-submit")
            await expect(page.get_by_test_id("whoami")).to_contain_text("operator")

            # Pipeline health, curves, lineage, failures: the seeded data, drawn.
            def card(testid: str) -> Any:
                return page.get_by_test_id(testid).locator(".value")

            await expect(card("metric-trajectories")).to_have_text("6")  # 5 judged, 1 awaiting
            await expect(page.get_by_test_id("metric-trainer")).to_contain_text("training")
            await expect(card("metric-dlq")).to_have_text("4")
            await expect(page.get_by_test_id("metric-dlq")).to_contain_text("miner 1 (bug 1)")
            await expect(card("metric-staleness")).to_have_text("1")
            await expect(page.get_by_test_id("metric-stack")).to_contain_text(
                "not supervised by flywheel up")  # this API runs without a local stack
            # The gate: an evaluation in progress, and an eval set that cannot see the
            # gains it is asked to find (10 tasks × k = 4).
            gate = page.get_by_test_id("metric-gate")
            await expect(gate).to_contain_text("evaluating")
            await expect(gate).to_contain_text("v3 vs v1")
            await expect(page.get_by_test_id("gate-samples")).to_have_text("40 / 160")
            await expect(page.get_by_test_id("gate-mde")).to_contain_text("+0.947")
            await expect(page.get_by_test_id("gate-warning")).to_contain_text(
                "cannot see the gains it is asked to find")
            reward = page.locator('#reward-chart circle[data-testid="point"]')
            await expect(reward).to_have_count(3)
            assert await reward.first.get_attribute("data-value") == "0.3"
            holdout = page.locator('#holdout-chart g[data-series="candidate"] circle')
            await expect(holdout).to_have_count(2)
            assert [await c.get_attribute("data-value") for c in await holdout.all()] == [
                "0.75", "1"]
            await expect(page.locator("#holdout-chart polyline")).to_have_count(2)
            await expect(page.get_by_test_id("baseline-note")).to_contain_text("grpo")
            lineage = page.get_by_test_id("lineage-table")
            await expect(lineage.locator('tr[data-production="true"]')).to_have_attribute(
                "data-version", "1")
            await expect(page.get_by_test_id("failure-table").locator(
                'tr[data-mode="wrong_tool"]')).to_contain_text("2")

            # Both sides of the pending decision, side by side, and the gate's reasons.
            success = row.locator('tr[data-metric="success_rate"]')
            await expect(success.locator('td[data-side="candidate"]')).to_have_text("100.0%")
            await expect(success.locator('td[data-side="production"]')).to_have_text("75.0%")
            await expect(row.get_by_test_id("reasons").locator("li")).not_to_have_count(0)
            await expect(row.get_by_test_id("decision-power")).to_contain_text("MDE +")
            # Each task group's paired comparison: 30 tasks × 4, 30 pairs won (75% → 100%).
            groups = row.get_by_test_id("group-tests")
            await expect(groups).to_contain_text("per task group: 1 group")
            await groups.locator("summary").click()
            one = groups.locator('tr[data-group="env:tool_call"]')
            await expect(one).to_contain_text("+25.0 pt")
            await expect(one.locator("td").nth(1)).to_have_text("30")

            # Approve: a reason is required, then production moves.
            await row.get_by_test_id("approve").click()
            dialog = page.get_by_test_id("action-dialog")
            await expect(dialog).to_be_visible()
            await page.get_by_test_id("dialog-confirm").click()
            await expect(page.get_by_test_id("dialog-error")).to_contain_text("reason")
            await page.get_by_test_id("action-reason").fill("better on the holdout")
            await page.get_by_test_id("dialog-confirm").click()
            await expect(dialog).to_be_hidden()
            await expect(page.get_by_test_id("toast")).to_contain_text("Promoted policy@v2")
            await expect(row).to_have_attribute("data-state", "promoted")
            await expect(row.get_by_test_id("decision")).to_contain_text("alice")
            await expect(page.get_by_test_id("production-version")).to_have_text("policy@v2")
            await expect(lineage.locator('tr[data-production="true"]')).to_have_attribute(
                "data-version", "2")

            pointer = await fetch(pg_dsn, "SELECT version, revision FROM production")
            assert (pointer["version"], pointer["revision"]) == (2, 2)
            decided = await fetch(pg_dsn, """SELECT state, decided_by, decision_reason
                FROM evaluations WHERE evaluation_id = $1""", seeded.pending)
            assert decided["state"] == "promoted"
            assert decided["decided_by"].startswith("alice (token ")
            assert decided["decision_reason"] == "better on the holdout"

            # Roll back to the previous production version.
            await page.get_by_test_id("rollback").click()
            await expect(page.get_by_test_id("rollback-target")).to_have_value("")
            await page.get_by_test_id("action-reason").fill("regression in prod")
            await page.get_by_test_id("dialog-confirm").click()
            await expect(page.get_by_test_id("production-version")).to_have_text("policy@v1")
            await expect(lineage.locator('tr[data-version="2"]')).to_have_attribute(
                "data-status", "rolled_back")
            pointer = await fetch(pg_dsn, "SELECT version FROM production")
            assert pointer["version"] == 1

            # A decision made elsewhere (another operator, the CLI) shows up on its own.
            s = with_mode(settings, "manual")
            await train(engine, s, 4)
            (fresh,) = await evaluate(engine, s, 4, rate=1.0, base_rate=0.75)
            await expect(decisions.locator(f'tr[data-evaluation-id="{evaluation_id(fresh)}"]')
                         ).to_have_attribute("data-state", "pending", timeout=15_000)
        finally:
            await browser.close()
    assert problems == []
