"""The other side of the supervisor: `flywheel up --detach` and `flywheel down` as commands.

* `detach`: no stack running → start a supervisor in its own session (it adopts whatever a
  dead one left running) and return once it is ready. A stack running → check every
  component; a dead one is repaired (the supervisor is asked to restart it now) or
  `StackDegraded` says exactly what is dead and why.
* `down`: ask the supervisor to drain and stop (SIGTERM; `<home>/stop-request.json` says
  how), show its progress, and return what it did. A supervisor that died is replaced by
  this command for the stop: what it left running is drained and stopped the same way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flywheel.config import Settings
from flywheel.runtime.endpoints import read_run
from flywheel.runtime.logs import mask_text
from flywheel.stack.launch import LAST_STOP, STOP_REQUEST, write_json_private
from flywheel.stack.postgres import LocalPostgres
from flywheel.stack.processes import pid_alive, stop_pid

REPAIR_WAIT_S = 60.0


class StackDegraded(RuntimeError):
    """A running stack with a part that is down and could not be repaired."""


def problems(run: dict[str, Any], *, readyz: bool = True) -> dict[str, str]:
    """Component → why it is not working, from run.json and a look at each process."""
    found: dict[str, str] = {}
    for name, info in (run.get("components") or {}).items():
        if info.get("state") == "stopped":
            continue  # held on purpose (draining, the broker being replaced)
        pid = info.get("pid")
        if pid_alive(pid) and info.get("state") == "up":
            continue
        why = info.get("last_error") or (
            f"exited with code {info['last_exit']}" if info.get("last_exit") is not None
            else f"not running (pid {pid})" if pid else "not started")
        found[name] = mask_text(str(why))[-500:] + (
            f"; see {info['log']}" if info.get("log") else "")
    if readyz and not found and run.get("api_url"):
        try:
            with urllib.request.urlopen(run["api_url"] + "/readyz", timeout=5) as r:
                r.read()
        except urllib.error.HTTPError as err:
            try:
                found["api"] = "not ready: " + json.loads(err.read()).get("detail", "")
            except ValueError:
                found["api"] = f"not ready (HTTP {err.code})"
        except OSError as err:
            found["api"] = f"does not answer at {run['api_url']} ({err})"
    return found


def detach(settings: Settings, timeout: float = 180,
           repair_wait_s: float = REPAIR_WAIT_S) -> dict[str, Any]:
    """Start the supervisor in its own session, or check and repair the running one;
    returns run.json (plus `repaired`: what had to be restarted)."""
    current = read_run(settings)
    if current and pid_alive(int(current.get("supervisor_pid") or 0)):
        if current.get("status") in ("draining", "stopping"):
            raise RuntimeError("the stack is stopping (`flywheel down` is draining it: "
                               f"{current.get('drain') or 'stopping services'}); run "
                               "`flywheel up` again once it has stopped")
        return repair(settings, current, repair_wait_s)
    settings.home.mkdir(parents=True, exist_ok=True)
    (settings.home / "logs").mkdir(exist_ok=True)
    (settings.home / STOP_REQUEST).unlink(missing_ok=True)
    out = open(settings.home / "logs" / "supervisor.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "flywheel.cli.main", "up"],
                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True,
                            env={**os.environ, "FLYWHEEL_HOME": str(settings.home.resolve())})
    out.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = read_run(settings)
        if run and run.get("supervisor_pid") == proc.pid and run.get("status") == "ready":
            return {**run, "repaired": []}
        if proc.poll() is not None:
            tail = (settings.home / "logs" / "supervisor.log").read_text()[-3000:]
            raise RuntimeError(f"flywheel up failed (exit {proc.returncode}):\n"
                               f"{mask_text(tail)}")
        time.sleep(0.2)
    raise RuntimeError(f"flywheel up did not become ready in {timeout:.0f}s; "
                       f"see {settings.home / 'logs'}")


def repair(settings: Settings, run: dict[str, Any], wait_s: float = REPAIR_WAIT_S
           ) -> dict[str, Any]:
    """Everything of a running stack up; else ask its supervisor to restart what is dead
    now and wait for it. Raises `StackDegraded` naming what is still dead, and why."""
    found = problems(run)
    if not found:
        return {**run, "repaired": []}
    os.kill(int(run["supervisor_pid"]), signal.SIGUSR1)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
        run = read_run(settings) or run
        if not problems(run):
            return {**run, "repaired": sorted(found)}
    still = problems(run)
    raise StackDegraded("the stack is running but not healthy after "
                        f"{wait_s:.0f}s of repair: "
                        + "; ".join(f"{name} is down: {why}" for name, why in still.items()))


def down(settings: Settings, *, drain: bool = True, drain_timeout_s: float | None = None,
         progress: Callable[[str], None] = lambda _: None) -> str | None:
    """Drain and stop the stack; returns what was done, in words (None: none was running)."""
    run = read_run(settings)
    if not run:
        return None
    cfg = settings.stack
    timeout = cfg.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
    write_json_private(settings.home / STOP_REQUEST, {"drain": drain, "timeout_s": timeout})
    (settings.home / LAST_STOP).unlink(missing_ok=True)
    pid = int(run.get("supervisor_pid") or 0)
    if pid_alive(pid):
        os.kill(pid, signal.SIGTERM)
        # The drain's bounds, then up to 45 s per service stop and the broker/Postgres.
        deadline = time.monotonic() + (timeout + cfg.drain_recoverable_s + 120 if drain
                                       else 120)
        shown = None
        while pid_alive(pid) and time.monotonic() < deadline:
            line = (read_run(settings) or {}).get("drain")
            if line and line != shown:
                progress(line)
                shown = line
            time.sleep(0.5)
        if pid_alive(pid):
            stop_pid(pid, 0)
            _stop_orphans(run)
            return ("the supervisor did not stop in time and was killed; what it started "
                    "was stopped without draining")
        return _last_stop(settings) or "stopped"
    _stop_orphans(run)
    return "the supervisor was not running; stopped what it had left running (no drain)"


def _last_stop(settings: Settings) -> str | None:
    try:
        summary: str = json.loads((settings.home / LAST_STOP).read_text())["summary"]
    except (OSError, ValueError, KeyError):
        return None
    return summary


def _stop_orphans(run: dict[str, Any]) -> None:
    for child in (run.get("pids") or {}).values():
        if child:
            stop_pid(int(child), 15)
    if run.get("broker_pid"):
        stop_pid(int(run["broker_pid"]), 10, signal.SIGINT)
    if run.get("vllm_pid"):
        from flywheel.stack.vllm_server import stop_group

        stop_group(int(run["vllm_pid"]), grace_s=5)  # its own process group
    if run.get("postgres_data"):
        LocalPostgres(Path(run["postgres_data"]), 0).stop()
    home = run.get("home")
    if home:
        (Path(home) / "run.json").unlink(missing_ok=True)
        (Path(home) / STOP_REQUEST).unlink(missing_ok=True)
