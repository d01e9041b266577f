"""Where the broker, database and API are: settings first, else the local stack's run.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flywheel.config import Settings


class StackNotRunning(RuntimeError):
    pass


def run_file(settings: Settings) -> Path:
    return settings.home / "run.json"


def read_run(settings: Settings) -> dict[str, Any] | None:
    path = run_file(settings)
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _from_run(settings: Settings, key: str, env: str) -> str:
    run = read_run(settings)
    if run and run.get(key):
        return str(run[key])
    raise StackNotRunning(
        f"no {key.replace('_', ' ')} configured and no local stack found at {run_file(settings)}:"
        f" start one with `flywheel up --detach`, or set {env}"
    )


def resolve_bootstrap(settings: Settings) -> str:
    return settings.kafka.bootstrap or _from_run(
        settings, "kafka_bootstrap", "FLYWHEEL_KAFKA__BOOTSTRAP")


def resolve_db_url(settings: Settings) -> str:
    return settings.db.url or _from_run(settings, "database_url", "FLYWHEEL_DB__URL")


def resolve_api_url(settings: Settings) -> str:
    return _from_run(settings, "api_url", "FLYWHEEL_API__PORT")
