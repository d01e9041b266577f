"""Test session services: one real broker and one real Postgres, started by the session (and,
for the `vllm`-marked tests, one real vLLM server).

Each test gets its own database (a copy of a migrated template) and its own topic prefix,
so tests never see each other's data.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from flywheel.config import Settings
    from flywheel.policy.base import Policy
    from flywheel.stack.broker import LocalBroker
    from flywheel.stack.postgres import LocalPostgres
    from tests.support.vllm_server import RealVLLM

# The broker, Postgres and their clients are imported by the fixtures that start them, never
# at collection: the GPU tests run on a bare machine that has none of them
# (infra/gpu-check.sh installs only what the GPU code paths import).

TEMPLATE_DB = "flywheel_template"

# -- running in parallel (`make test`: pytest-xdist, `-n 3 --dist loadfile`) ----------------------
#
# Each worker is a process of its own with its own broker, Postgres and model (the session
# fixtures below), so workers share nothing but the machine; a file's tests stay on one worker
# (module fixtures such as a whole `flywheel up` stack are started once). One OpenMP thread a
# worker: two workers each spinning two threads on 2 cores run several times slower than one
# thread each (docs/BENCHMARKS.md, "cores follow the work"). Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

HEAVY_FIRST = (
    "test_policy_grammar.py", "test_trainer.py", "test_trainer_sft_warm_start.py",
    "test_policy_shared.py", "test_runtime_acked.py", "test_runtime_drain.py",
    "test_runtime_heal.py", "test_otel_e2e.py", "test_bench_trainer.py", "test_rollout_local.py",
    "test_api_served_equals_gated.py", "test_gate_concurrent.py", "test_rollout_workers.py",
    "test_trainer_prefix.py", "test_policy_local.py", "test_runtime_stack.py",
    "test_producers_confirm.py", "test_gate_e2e.py", "test_tools_sessions.py",
    "test_environments_toolset.py", "test_trainer_warm_start.py",
)
"""Files in order of their measured time (`pytest --durations`, 2 cores), longest first: the
workers take files in collection order, so the longest start first and the short ones fill
in at the end instead of one long file running alone at the tail. Order only: a file missing
here runs after these, in its usual order."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: same order within


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> None:
    """Every test starts the global random generators (Python's, numpy's, torch's when it is
    loaded) from its own id: a draw a test forgot to seed is the same on every run, so no test
    passes or fails by chance — and runs the same alone, in the full suite or on any worker."""
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    if (np := sys.modules.get("numpy")) is not None:
        np.random.seed(seed)
    if (torch := sys.modules.get("torch")) is not None:
        torch.manual_seed(seed)


@pytest.fixture(scope="session")
def services_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="flywheel-test-"))
    base.chmod(0o755)  # our own fresh directory: the unprivileged Postgres user must reach it
    yield base


@pytest.fixture(scope="session")
def broker(services_dir: Path) -> Iterator[LocalBroker]:
    from flywheel.stack.broker import LocalBroker, free_port

    if os.environ.get("FLYWHEEL_TEST_KAFKA"):
        pytest.skip("external broker configured")  # pragma: no cover
    b = LocalBroker(free_port(), services_dir / "broker.log")
    b.start()
    yield b
    b.stop()


@pytest.fixture(scope="session")
def postgres(services_dir: Path) -> Iterator[LocalPostgres]:
    from flywheel.stack.broker import free_port
    from flywheel.stack.postgres import LocalPostgres

    pg = LocalPostgres(services_dir / "pg", free_port())
    pg.start()
    yield pg
    pg.stop()


def _pg_dsn(url: str, db: str) -> str:
    base = url.replace("postgresql+asyncpg://", "postgresql://").rsplit("/", 1)[0]
    return f"{base}/{db}"


@pytest.fixture(scope="session")
def template_db(postgres: LocalPostgres) -> str:
    import asyncio

    import asyncpg

    from flywheel.db import migrate

    async def make() -> None:
        conn = await asyncpg.connect(_pg_dsn(postgres.url, "postgres"))
        try:
            await conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE_DB}")
            await conn.execute(f"CREATE DATABASE {TEMPLATE_DB}")
        finally:
            await conn.close()

    asyncio.run(make())
    url = postgres.url.rsplit("/", 1)[0] + f"/{TEMPLATE_DB}"
    migrate.upgrade(url)
    return url


@pytest.fixture
async def db_url(postgres: LocalPostgres, template_db: str) -> AsyncIterator[str]:
    """A fresh, migrated database for this test."""
    import asyncpg

    name = f"t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(_pg_dsn(postgres.url, "postgres"))
    try:
        await conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    finally:
        await conn.close()
    yield postgres.url.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture
def pg_dsn(db_url: str) -> str:
    """The same database as `db_url`, as a plain asyncpg DSN (for assertions)."""
    return _pg_dsn(db_url, db_url.rsplit("/", 1)[1])


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    """An async SQLAlchemy engine on this test's database."""
    from flywheel.db.engine import make_engine

    e = make_engine(db_url)
    yield e
    await e.dispose()


@pytest.fixture
def settings(broker: LocalBroker, db_url: str, tmp_path: Path) -> Settings:
    from flywheel.config import DbSettings, KafkaSettings, Settings

    return Settings(
        home=tmp_path / "home",
        kafka=KafkaSettings(bootstrap=broker.bootstrap,
                            topic_prefix=f"t{uuid.uuid4().hex[:10]}",
                            session_timeout_ms=2000, heartbeat_interval_ms=500),
        db=DbSettings(url=db_url),
    )


# -- the real vLLM server of the `vllm`-marked tests (tests/support/vllm_server.py) ----------------


@pytest.fixture(scope="session")
def vllm_server(services_dir: Path) -> Iterator[RealVLLM]:
    """One real vLLM server for the session, started as `flywheel vllm serve` starts it."""
    from tests.support.vllm_server import REPORT, start_server, vllm_python

    python = vllm_python()
    if python is None:
        pytest.skip("no vLLM environment: `make vllm` creates .venv-vllm (or set "
                    "FLYWHEEL_TEST_VLLM_PYTHON to an interpreter with vLLM)")
    real = start_server(python, services_dir / "vllm")
    REPORT["engine start (s, until /health)"] = round(real.startup_s, 1)
    try:
        yield real
    finally:
        real.server.stop()


@pytest.fixture(scope="session")
def vllm_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.support.vllm_server import write_adapters

    return write_adapters(tmp_path_factory.mktemp("vllm-adapters"))


@pytest.fixture(scope="session")
async def local_engine() -> AsyncIterator[Policy]:
    """The in-process engine on the same model, to compare vLLM against."""
    from flywheel.config import Settings
    from flywheel.policy.factory import make_policy

    policy = make_policy(Settings())
    yield policy
    await policy.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    # Only a session that ran vLLM tests imported the module (and filled its REPORT).
    server = sys.modules.get("tests.support.vllm_server")
    if server is None or not server.REPORT:
        return
    REPORT, report_lines = server.REPORT, server.report_lines
    terminalreporter.section("vLLM measurements (this machine, this run)")
    for line in report_lines():
        terminalreporter.write_line(line)
    if path := os.environ.get("FLYWHEEL_TEST_VLLM_REPORT"):
        Path(path).write_text(json.dumps(REPORT, indent=2))
