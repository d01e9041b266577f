"""What the supervisor watches: a component (a service, the broker, Postgres), whether it is
alive, and when a dead one may be restarted.

`Backoff` is the restart policy, pure and clock-free so it is tested with plain numbers:
the first death is restarted after 1 s, each further death in a row doubles the wait up to
`stack.restart_backoff_max_s`; a component that ran for `STABLE_S` before dying starts over
at 1 s (it was healthy; this is a new incident, not a crash loop).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("flywheel.up")

STABLE_S = 60.0
"""A component that ran this long before it died is restarted as if for the first time."""


@dataclass
class Backoff:
    max_s: float = 30.0
    restarts: int = 0
    """Restarts so far (shown in `flywheel status` and `/metrics`)."""
    streak: int = 0
    """Deaths in a row, each within `STABLE_S` of its start."""
    started_at: float | None = None
    died_at: float | None = None

    def started(self, now: float) -> None:
        self.started_at, self.died_at = now, None

    def died(self, now: float) -> None:
        """Record a death (once per death: later calls before a restart change nothing)."""
        if self.died_at is not None:
            return
        ran = now - self.started_at if self.started_at is not None else 0.0
        self.streak = 1 if ran >= STABLE_S else self.streak + 1
        self.died_at = now

    def delay(self) -> float:
        """Seconds to wait after the latest death before restarting."""
        return 0.0 if self.streak == 0 else min(self.max_s, 2.0 ** (self.streak - 1))

    def due(self, now: float) -> bool:
        return self.died_at is not None and now - self.died_at >= self.delay()

    def restarting(self, now: float) -> None:
        self.restarts += 1
        self.started(now)

    def reset(self) -> None:
        """Forget the streak (an operator asked for a repair: try at once)."""
        self.streak = 0
        if self.died_at is not None:
            self.died_at = 0.0


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion from synchronous code, also when called from inside a
    running event loop (the supervisor heals from within the drain's loop): then it runs
    on a loop of its own in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=target, name="run-sync")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    result: T = box["value"]
    return result


def pid_alive(pid: int | None) -> bool:
    """True for a running process (a zombie — killed, not yet reaped — counts as dead)."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): kill(0) is all we know
    return state not in ("Z", "X")


def become_subreaper() -> bool:
    """Make orphaned descendants (a killed postmaster, its backends) children of this
    process, so that it can reap them (Linux `PR_SET_CHILD_SUBREAPER`). Without it a
    killed Postgres stays a zombie until init gets to it, and its own lock-file check
    takes the zombie for a live server and refuses to start."""
    try:
        import ctypes

        return bool(ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def reap_orphans(tracked: set[int]) -> list[int]:
    """Reap zombie children that no `Popen` tracks (see `become_subreaper`)."""
    me, reaped = os.getpid(), []
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        pid = int(entry)
        if pid in tracked:
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[1]) == me:
            try:
                os.waitpid(pid, os.WNOHANG)
                reaped.append(pid)
            except ChildProcessError:
                pass
    return reaped


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of `pid` in MiB (Linux), None when unknown."""
    if not pid:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; empty elsewhere)."""
    try:
        children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                    for c in (t / "children").read_text().split()]
    except OSError:
        return []
    return [p for c in children for p in (c, *descendants(c))]


def stop_pid(pid: int, grace: float, sig: int = signal.SIGTERM) -> bool:
    """Signal `pid`, wait up to `grace` s, then SIGKILL it and whatever it started.
    True when it stopped by itself (or was not running)."""
    if not pid_alive(pid):
        return True
    below = descendants(pid)
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + grace
    while pid_alive(pid) and time.monotonic() < deadline:
        _reap(pid)
        time.sleep(0.1)
    clean = not pid_alive(pid)
    if not clean:
        below = below or descendants(pid)
        for p in (pid, *below):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _reap(pid)
    return clean


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not ours (adopted): init reaps it


@dataclass
class Service:
    """A service the stack runs as `python -m <module>`, its log appended to `log`."""

    name: str
    argv: list[str]
    log: Path
    backoff: Backoff = field(default_factory=Backoff)
    proc: subprocess.Popen[bytes] | None = None
    adopted_pid: int | None = None
    """A pid from an earlier supervisor that died: stopped and replaced at start."""
    held: bool = False
    """Stopped on purpose (the broker is being restarted, or the stack drains): not a death."""
    last_exit: int | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else self.adopted_pid

    def alive(self) -> bool:
        if self.proc is not None:
            code = self.proc.poll()
            if code is not None:
                self.last_exit = code
            return code is None
        return pid_alive(self.adopted_pid)

    def start(self, env: dict[str, str], now: float) -> None:
        # O_APPEND: copy-truncate rotation (flywheel.runtime.logs) needs no reopen.
        with open(self.log, "ab") as out:
            # Its own process group: a Ctrl-C at the terminal reaches the supervisor only,
            # which drains before it stops anything.
            self.proc = subprocess.Popen(self.argv, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         process_group=0)
        self.adopted_pid = None
        self.held = False
        self.backoff.started(now)

    def stop(self, grace: float) -> None:
        pid = self.pid
        if pid is not None and not stop_pid(pid, grace):
            log.warning("%s (pid %d) did not stop within %.0fs of SIGTERM: killed", self.name,
                        pid, grace)
        if self.proc is not None:
            self.proc.poll()

    def report(self) -> dict[str, Any]:
        state = "up" if self.alive() else ("stopped" if self.held else "down")
        return {"state": state, "pid": self.pid, "restarts": self.backoff.restarts,
                "last_exit": self.last_exit, "log": str(self.log)}
