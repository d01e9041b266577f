"""A local vLLM server process: start it in its own process group, wait for `/health`, stop
the whole group (API server, engine core and workers) however it ends.

The command line comes from `flywheel.policy.vllm_flags`; this module only runs it. A server
started detached (`flywheel vllm serve --detach`) is recorded in `<home>/vllm.json` so that
`flywheel vllm stop` finds it again, and is only ever stopped when that record still
matches a live vLLM process (a recycled pid is left alone).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODULE = "vllm.entrypoints.openai.api_server"


class VLLMStartError(RuntimeError):
    """The server exited or did not become healthy; the message ends with its log's tail."""


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


@dataclass
class VLLMServer:
    python: Path
    """The interpreter of an environment with vLLM installed (e.g. `.venv-vllm/bin/python`)."""
    args: list[str]
    env: dict[str, str]
    url: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    startup_s: float | None = None
    """Seconds from start to the first healthy `/health`."""

    def start(self) -> None:
        if not Path(self.python).is_file():
            raise VLLMStartError(f"{self.python} does not exist: install vLLM first "
                                 "(`make vllm` on a CPU machine, `pip install '.[vllm]'` on a "
                                 "GPU one) or point at its interpreter")
        if healthy(self.url, timeout=0.5):
            raise VLLMStartError(f"something already answers at {self.url}; stop it "
                                 "(`flywheel vllm stop`) or choose another port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            out.write(f"+ {self.python} {' '.join(self.args)}\n".encode())
            out.flush()
            # Its own session: one signal to the group reaches the engine processes too, and
            # the server outlives a detaching parent.
            self.proc = subprocess.Popen([str(self.python), *self.args],
                                         env={**os.environ, **self.env}, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self._started = time.monotonic()

    def wait_healthy(self, timeout_s: float = 600.0) -> float:
        """Block until `/health` answers 200; returns the startup time in seconds."""
        assert self.proc is not None, "start() first"
        deadline = self._started + timeout_s
        while not healthy(self.url):
            if self.proc.poll() is not None:
                raise VLLMStartError(f"vLLM exited with {self.proc.returncode} during "
                                     f"startup; last lines of {self.log_path}:\n"
                                     f"{log_tail(self.log_path)}")
            if time.monotonic() > deadline:
                self.stop()
                raise VLLMStartError(f"vLLM was not healthy at {self.url} after "
                                     f"{timeout_s:.0f}s; last lines of {self.log_path}:\n"
                                     f"{log_tail(self.log_path)}")
            time.sleep(0.5)
        self.startup_s = time.monotonic() - self._started
        return self.startup_s

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; safe to call twice."""
        if self.proc is None:
            return
        stop_group(self.proc.pid, grace_s, wait=self.proc.wait)

    def record(self, path: Path) -> None:
        """Write what `flywheel vllm stop` needs to find this server again."""
        assert self.proc is not None
        data = {"pid": self.proc.pid, "url": self.url, "log": str(self.log_path),
                "python": str(self.python), "args": self.args, "started_at": time.time(),
                "startup_s": self.startup_s}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, path)


def stop_group(pgid: int, grace_s: float = 30.0, wait: Any = None) -> None:
    """Stop process group `pgid` (its leader's pid): TERM, then KILL after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _group_alive(pgid):
        if wait is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                wait(timeout=0.2)
        else:
            time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    if wait is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            wait(timeout=5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader still counts for killpg; the group is done once nothing else runs.
    return any(_pgid_of(pid) == pgid and not _zombie(pid) for pid in _pids())


def _pids() -> list[int]:
    try:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


def _stat(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "


def _pgid_of(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[2]) if len(fields) > 2 else None


def _zombie(pid: int) -> bool:
    fields = _stat(pid)
    return not fields or fields[0] == "Z"


def recorded(path: Path) -> dict[str, Any] | None:
    """The detached server recorded at `path`, if it is still that vLLM process."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    pid = int(data.get("pid", 0))
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return data if pid > 0 and MODULE.encode() in cmdline else None


def stop_recorded(path: Path, grace_s: float = 30.0) -> dict[str, Any] | None:
    """Stop the detached server recorded at `path`; returns its record, None if none ran."""
    data = recorded(path)
    if data is not None:
        stop_group(int(data["pid"]), grace_s)
    path.unlink(missing_ok=True)
    return data
