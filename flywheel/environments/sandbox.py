"""Run untrusted Python against asserts in a throw-away subprocess with hard limits.

Each run gets: a fresh temporary working directory (deleted afterwards, whatever happened),
`python -I` (no user site, no PYTHON* variables, cwd not on sys.path), an empty environment,
its own process group (killed as a whole at the wall-clock timeout), and in the child, before
the code runs: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE (file and output size),
RLIMIT_NOFILE, RLIMIT_NPROC = 0 (no forks or threads; not enforced for root) and sockets
replaced by functions that raise.

Network: when `unshare -n` (or `unshare -rn`, via a user namespace) works for the current
user, the child also runs in an empty network namespace, which closes the in-process block's
gaps (ctypes, raw syscalls). Otherwise only the in-process block applies; `details` names
which one ran. The filesystem is not isolated: the code can read and write wherever the
worker's user can. This is a guard against accidents and ordinary misbehaviour, not against a
determined attacker (who could also find the result-channel nonce by frame inspection):
run workers in a container for that.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from flywheel.tasks import RolloutNotRun

Network = Literal["auto", "netns", "in_process"]
_CHILD = Path(__file__).with_name("_sandbox_child.py").read_text()
_OUTPUT_BYTES = 4_000_000


def case_ids(tests: str) -> list[str]:
    """Ids of the test cases in `tests`, in run order (see `_sandbox_child`)."""
    try:
        body = ast.parse(tests, "tests.py").body
    except SyntaxError as exc:
        raise ValueError(f"the task's tests are not valid Python ({exc}); fix the task") from None
    cases = [f"line {n.lineno}" for n in body if isinstance(n, ast.Assert)]
    cases += [n.name for n in body
              if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    if not cases:
        raise ValueError("the task's tests contain no top-level `assert` and no `def test_*()`; "
                         "add at least one so an attempt can pass")
    return cases


@functools.cache
def netns_prefix() -> tuple[str, ...]:
    """The `unshare` command that gives the child no network, or () where none works."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for flags in ("-n", "-rn"):
        try:
            probe = subprocess.run([unshare, flags, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return (unshare, flags)
    return ()


@dataclass
class SandboxRun:
    """What came back from one run: the child's records and how the process ended."""

    records: list[dict[str, Any]] = field(default_factory=list)
    returncode: int | None = None
    timed_out: bool = False
    stderr_tail: str = ""
    network: str = "in_process"
    workdir: str = ""
    wall_s: float = 0.0

    def event(self, name: str) -> dict[str, Any] | None:
        return next((r for r in self.records if r.get("event") == name), None)


def _records(stdout: bytes, nonce: str) -> list[dict[str, Any]]:
    found = []
    for line in stdout.decode(errors="replace").splitlines():
        if line.startswith(nonce):
            try:
                found.append(json.loads(line[len(nonce):]))
            except json.JSONDecodeError:
                continue
    return found


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def run_python(code: str, tests: str, *, entrypoint: str | None = None,
               timeout_s: float = 5.0, memory_mb: int = 256,
               network: Network = "auto") -> SandboxRun:
    """Run `code`, then `tests` against it, in the sandbox; RolloutNotRun if it cannot start."""
    prefix: tuple[str, ...] = ()
    if network != "in_process":
        prefix = netns_prefix()
        if not prefix and network == "netns":
            raise RolloutNotRun("sandbox", "network namespaces are unavailable (`unshare -n` "
                                           "fails); use network='auto' or 'in_process'")
    nonce = secrets.token_hex(16)
    job = json.dumps({"nonce": nonce, "code": code, "tests": tests, "entrypoint": entrypoint,
                      "limits": {"cpu_s": math.ceil(timeout_s) + 1,
                                 "memory_bytes": memory_mb * 1024 * 1024,
                                 "file_bytes": _OUTPUT_BYTES, "open_files": 64,
                                 "processes": 0}}).encode()
    run = SandboxRun(network="netns" if prefix else "in_process")
    with tempfile.TemporaryDirectory(prefix="flywheel-sandbox-") as root:
        work = Path(root) / "work"
        work.mkdir()
        run.workdir = str(work)
        out_path, err_path = Path(root) / "stdout", Path(root) / "stderr"
        started = time.monotonic()
        with out_path.open("wb") as out, err_path.open("wb") as err:
            try:
                proc = subprocess.Popen(
                    [*prefix, sys.executable, "-I", "-c", _CHILD], cwd=work, env={},
                    stdin=subprocess.PIPE, stdout=out, stderr=err, start_new_session=True)
            except OSError as exc:
                raise RolloutNotRun("sandbox", f"could not start python: {exc}") from exc
            try:
                proc.communicate(job, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                run.timed_out = True
            finally:
                # Also reaps anything the code forked that outlived the main process.
                _kill_group(proc.pid)
                proc.wait()
        run.wall_s = round(time.monotonic() - started, 3)
        run.returncode = proc.returncode
        with out_path.open("rb") as f:
            run.records = _records(f.read(_OUTPUT_BYTES), nonce)
        with err_path.open("rb") as f:
            f.seek(max(0, err_path.stat().st_size - 2000))
            run.stderr_tail = f.read().decode(errors="replace")
    if run.event("ready") is None:
        why = "did not start before the timeout" if run.timed_out else \
            f"exited {run.returncode} before running the code: {run.stderr_tail[-500:]}"
        raise RolloutNotRun("sandbox", f"sandbox {why}")
    return run
