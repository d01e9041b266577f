"""`flywheel up` / `flywheel down`: the whole local stack on one machine.

The supervisor starts what is not configured externally (the bundled broker, a local
Postgres with data under `<home>/pg`), runs migrations, creates topics, then runs every
service as a child process (ingest, outbox relay, API), restarting any that dies. With the
`vllm` engine and no replica configured, it first starts a local vLLM server (given by the
caller, built by `flywheel.policy.vllm_flags`) and points the services at it. When all are
ready it writes `<home>/run.json`; on SIGTERM/SIGINT it stops everything it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.config import Scope, Settings, settings_env
from flywheel.runtime.broker import LocalBroker
from flywheel.runtime.endpoints import read_run, run_file
from flywheel.runtime.postgres import LocalPostgres
from flywheel.runtime.vllm import VLLMServer, stop_group

log = logging.getLogger("flywheel.up")

# Every service that exists, as `python -m <module>`. Later stages add theirs here.
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


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; empty elsewhere)."""
    try:
        children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                    for c in (t / "children").read_text().split()]
    except OSError:
        return []
    return [p for c in children for p in (c, *_descendants(c))]


def load_or_make_tokens(settings: Settings) -> dict[str, list[Scope]]:
    """Configured tokens, else a `publish` and an `operate` token kept in <home>/tokens.json."""
    if settings.api.tokens:
        return settings.api.tokens
    path = settings.home / "tokens.json"
    if path.exists():
        data: dict[str, list[Scope]] = json.loads(path.read_text())
        return data
    tokens: dict[str, list[Scope]] = {
        f"fw_pub_{secrets.token_urlsafe(24)}": ["publish"],
        f"fw_op_{secrets.token_urlsafe(24)}": ["publish", "operate"],
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(tokens, f)
    return tokens


def _write_run(settings: Settings, data: dict[str, Any]) -> None:
    path = run_file(settings)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


@dataclass
class Child:
    name: str
    module: str
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    last_start: float = field(default=0.0)


class Stack:
    def __init__(self, settings: Settings, vllm: VLLMServer | None = None) -> None:
        self.settings = settings
        self.vllm = vllm
        self.home = settings.home.resolve()
        self.logs = self.home / "logs"
        self.broker: LocalBroker | None = None
        self.postgres: LocalPostgres | None = None
        self.children = [Child(n, m) for n, m in SERVICES.items()]
        self.env: dict[str, str] = {}

    def start_infra(self) -> Settings:
        """Broker + Postgres + migrations + topics; returns settings pointing at them."""
        from flywheel.db import migrate
        from flywheel.runtime.kafka import ensure_topics

        self.logs.mkdir(parents=True, exist_ok=True)
        s = self.settings
        kafka, db = s.kafka, s.db
        if not kafka.bootstrap:
            self.broker = LocalBroker(kafka.local_port, self.logs / "broker.log")
            self.broker.start()
            kafka = kafka.model_copy(update={"bootstrap": self.broker.bootstrap})
        if not db.url:
            self.postgres = LocalPostgres(self.home / "pg", db.local_port)
            self.postgres.start()
            db = db.model_copy(update={"url": self.postgres.url})
        assert kafka.bootstrap and db.url
        rollout = s.rollout
        if self.vllm is not None:
            self.vllm.start()
            log.info("vLLM healthy at %s after %.0fs", self.vllm.url, self.vllm.wait_healthy())
            rollout = rollout.model_copy(update={"vllm_urls": [self.vllm.url]})
        migrate.upgrade(db.url)
        asyncio.run(ensure_topics(kafka.bootstrap, s.topics.all(), partitions=kafka.partitions,
                                  replication_factor=kafka.replication_factor))
        api = s.api.model_copy(update={"tokens": load_or_make_tokens(s)})
        self.settings = s.model_copy(update={"kafka": kafka, "db": db, "api": api,
                                             "rollout": rollout, "home": self.home})
        self.env = {**os.environ, **settings_env(self.settings), **torch_threads(os.environ)}
        return self.settings

    def _spawn(self, child: Child) -> None:
        with open(self.logs / f"{child.name}.log", "ab") as out:
            child.proc = subprocess.Popen(service_argv(self.settings, child.name), env=self.env,
                                          stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        child.last_start = time.monotonic()

    def api_url(self) -> str:
        return f"http://{self.settings.api.host}:{self.settings.api.port}"

    def _wait_api(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.api_url() + "/healthz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the API did not answer at {self.api_url()}; see {self.logs}/api.log")

    def run(self) -> None:
        """Foreground supervisor: start all, write run.json, restart dead children; stop on
        SIGTERM/SIGINT."""
        stop = {"now": False}

        def on_signal(signum: int, _frame: object) -> None:
            stop["now"] = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            s = self.start_infra()
            for child in self.children:
                self._spawn(child)
            self._wait_api()
            _write_run(s, {
                "status": "ready", "supervisor_pid": os.getpid(),
                "kafka_bootstrap": s.kafka.bootstrap, "database_url": s.db.url,
                "api_url": self.api_url(), "dashboard_url": self.api_url() + "/dashboard",
                "topics": s.topics.model_dump(), "tokens": s.api.tokens,
                "pids": {c.name: c.proc.pid for c in self.children if c.proc},
                "broker_pid": self.broker.proc.pid if self.broker and self.broker.proc else None,
                "vllm_url": self.vllm.url if self.vllm else None,
                "vllm_pid": self.vllm.proc.pid if self.vllm and self.vllm.proc else None,
                "postgres_data": str(self.postgres.data_dir) if self.postgres else None,
                "logs": str(self.logs), "started_at": time.time(),
            })
            log.info("flywheel is up: api %s, dashboard %s/dashboard (token in %s)",
                     self.api_url(), self.api_url(), run_file(s))
            while not stop["now"]:
                for child in self.children:
                    if child.proc is not None and child.proc.poll() is not None:
                        # Back off a crash loop; Kafka holds the backlog meanwhile.
                        if time.monotonic() - child.last_start > min(30, 2 ** child.restarts):
                            log.warning("%s exited with %s; restarting", child.name,
                                        child.proc.returncode)
                            child.restarts += 1
                            self._spawn(child)
                time.sleep(0.5)
        finally:
            self.stop()

    def stop(self) -> None:
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.terminate()
        for child in self.children:
            if child.proc is not None:
                # torchrun gives its ranks 30 s after a SIGTERM before it kills them.
                torchrun = child.name == "trainer" and self.settings.trainer.ranks > 1
                grace = 45 if torchrun else 15
                try:
                    child.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    stragglers = _descendants(child.proc.pid)  # torchrun's ranks
                    child.proc.kill()
                    child.proc.wait()
                    for pid in stragglers:
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGKILL)
        if self.vllm:
            self.vllm.stop()
        if self.broker:
            self.broker.stop()
        if self.postgres:
            self.postgres.stop()
        run_file(self.settings).unlink(missing_ok=True)


def detach(settings: Settings, timeout: float = 180) -> dict[str, Any]:
    """Start the supervisor in its own session; return run.json once everything is ready."""
    current = read_run(settings)
    if current and _alive(int(current.get("supervisor_pid", 0))):
        return current
    run_file(settings).unlink(missing_ok=True)
    settings.home.mkdir(parents=True, exist_ok=True)
    (settings.home / "logs").mkdir(exist_ok=True)
    out = open(settings.home / "logs" / "supervisor.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "flywheel.cli.main", "up"],
                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True,
                            env={**os.environ, "FLYWHEEL_HOME": str(settings.home.resolve())})
    out.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = read_run(settings)
        if run and run.get("status") == "ready":
            return run
        if proc.poll() is not None:
            tail = (settings.home / "logs" / "supervisor.log").read_text()[-3000:]
            raise RuntimeError(f"flywheel up failed (exit {proc.returncode}):\n{tail}")
        time.sleep(0.2)
    raise RuntimeError(f"flywheel up did not become ready in {timeout:.0f}s; "
                       f"see {settings.home / 'logs'}")


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False  # our own child, exited and now reaped
    except ChildProcessError:
        pass  # not our child
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def down(settings: Settings, timeout: float = 60) -> bool:
    """Stop a detached stack. Returns False when none was running."""
    run = read_run(settings)
    if not run:
        return False
    pid = int(run.get("supervisor_pid", 0))
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    if _alive(pid):  # the supervisor is wedged: stop what it started ourselves
        os.kill(pid, signal.SIGKILL)
    for child_pid in [*run.get("pids", {}).values(), run.get("broker_pid")]:
        if child_pid and _alive(int(child_pid)):
            os.kill(int(child_pid), signal.SIGKILL)
    if run.get("vllm_pid") and _alive(int(run["vllm_pid"])):
        stop_group(int(run["vllm_pid"]), grace_s=5)  # its own process group
    if run.get("postgres_data"):
        LocalPostgres(Path(run["postgres_data"]), 0).stop()
    run_file(settings).unlink(missing_ok=True)
    return True
