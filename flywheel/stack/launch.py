"""The services the local stack runs and the small things it needs to run them."""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flywheel.config import Scope, Settings, TokenGrant

# Every service that exists, as `python -m <module>`.
SERVICES: dict[str, str] = {
    "ingest": "consumers.ingest",
    "miner": "consumers.miner",
    "scheduler": "consumers.scheduler",
    "rollout": "consumers.rollout",
    "trainer": "consumers.trainer",
    "gate": "consumers.gate",
    "relay": "producers.relay",
    "api": "flywheel.api.server",
}
KAFKA_CONSUMERS = ("ingest", "miner", "rollout", "trainer", "gate")
"""Services in a consumer group: restarted afresh whenever the broker is replaced."""
STOP_REQUEST = "stop-request.json"
LAST_STOP = "last-stop.json"
TORCH_SERVICES = 3
"""Services that run torch at the same time on one machine: rollout, trainer, gate."""


def torch_threads(environ: Mapping[str, str], cpus: int | None = None) -> dict[str, str]:
    """Intra-op threads per torch service when they share this machine.

    Three torch processes each starting one thread per core oversubscribe the CPU, and
    OpenMP's spin-waiting then makes every one of them several times slower (measured on 2
    cores: a group of 8 attempts took 80 s instead of 12 s). An explicit OMP_NUM_THREADS
    from the user wins."""
    if "OMP_NUM_THREADS" in environ:
        return {}
    per = max(1, (cpus or os.cpu_count() or 1) // TORCH_SERVICES)
    return {"OMP_NUM_THREADS": str(per), "MKL_NUM_THREADS": str(per)}


def service_argv(settings: Settings, name: str) -> list[str]:
    """The command of a service; the trainer under torchrun when `trainer.ranks` > 1."""
    argv = [sys.executable, "-m", SERVICES[name]]
    if name == "trainer" and settings.trainer.ranks > 1:
        argv[2:2] = ["torch.distributed.run", "--standalone",
                     f"--nproc_per_node={settings.trainer.ranks}", "-m"]
    return argv


def load_or_make_tokens(settings: Settings) -> dict[str, list[Scope] | TokenGrant]:
    """Configured tokens, else a `publish` and an `operate` token kept in <home>/tokens.json."""
    if settings.api.tokens:
        return settings.api.tokens
    path = settings.home / "tokens.json"
    if path.exists():
        data: dict[str, list[Scope] | TokenGrant] = json.loads(path.read_text())
        return data
    tokens: dict[str, list[Scope] | TokenGrant] = {
        f"fw_pub_{secrets.token_urlsafe(24)}": ["publish"],
        f"fw_op_{secrets.token_urlsafe(24)}": ["publish", "operate"],
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(tokens, f)
    return tokens


def operate_token(settings: Settings) -> str | None:
    return next((t for t, s in settings.api.tokens.items() if "operate" in s), None)


def write_json_private(path: Path, data: dict[str, Any]) -> None:
    """Atomically, mode 0600 (run.json holds tokens and the database password)."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
