"""code environment and its sandbox: limits hold, the test process is never harmed."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flywheel.environments.code import CodeEnvironment, extract_code, verify_code
from flywheel.environments.sandbox import case_ids, netns_prefix, run_python
from flywheel.tasks import CodeSpec, RolloutNotRun

SQUARE = CodeSpec(tests="assert solve(2) == 4\nassert solve(3) == 9\n"
                        "def test_zero():\n    assert solve(0) == 0\n",
                  entrypoint="solve", timeout_s=2.0)


def fast(tests: str = "assert True", timeout_s: float = 10.0, memory_mb: int = 128) -> CodeSpec:
    """A spec whose wall clock never decides a test that is not about the wall clock: CI runs
    this beside torch-heavy tests on two cores, where a 0.5 s budget ran out before a 128 MB
    bomb reached its memory limit (scored `timeout`, not `memory`)."""
    return CodeSpec(tests=tests, timeout_s=timeout_s, memory_mb=memory_mb)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    yield server
    server.close()


def test_good_code_passes() -> None:
    r = verify_code(SQUARE, "```python\ndef solve(x):\n    return x * x\n```\nDone.")
    assert (r.reward, r.failure_mode, r.details["kind"]) == (1.0, None, "passed")
    assert r.reward_components == {"tests_passed": 1.0, "loaded": 1.0}
    assert (r.details["passed"], r.details["total"]) == (3, 3)


def test_wrong_code_fails_case_by_case() -> None:
    r = verify_code(SQUARE, "def solve(x):\n    return x + 2\n")
    assert (r.failure_mode, r.details["kind"]) == ("other", "failed_tests")
    assert r.reward == pytest.approx(1 / 3)  # solve(2) == 4 holds, the other two do not
    assert [f["case"] for f in r.details["failed"]] == ["line 2", "test_zero"]


def test_unusable_code_is_invalid_format() -> None:
    syntax = verify_code(SQUARE, "def solve(x:\n")
    assert (syntax.reward, syntax.failure_mode, syntax.details["kind"]) == \
        (0.0, "invalid_format", "syntax_error")
    missing = verify_code(SQUARE, "def square(x):\n    return x * x\n")
    assert (missing.failure_mode, missing.details["kind"]) == \
        ("invalid_format", "missing_entrypoint")
    crash = verify_code(SQUARE, "raise SystemExit(3)")
    assert (crash.failure_mode, crash.details["kind"]) == ("other", "load_error")


def test_infinite_loop_is_killed_quickly() -> None:
    started = time.monotonic()
    spin = "def spin():\n    while True:\n        pass\n"
    r = verify_code(fast("assert spin()", timeout_s=0.5), spin)
    assert time.monotonic() - started < 3.0
    assert (r.reward, r.failure_mode, r.details["kind"]) == (0.0, "timeout", "timeout")


def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = ("import subprocess, time\n"
            "try:\n"
            "    p = subprocess.Popen(['/bin/sleep', '30'])\n"
            f"    open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "except OSError:\n"
            "    pass  # forks blocked by RLIMIT_NPROC: nothing can outlive the run\n"
            "time.sleep(30)\n")
    r = verify_code(fast(timeout_s=0.5), code)
    assert r.details["kind"] == "timeout"
    if pid_file.exists():
        pid = int(pid_file.read_text())
        time.sleep(0.1)
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "State:\tZ" in status.read_text()


@pytest.mark.parametrize("bomb", ["x = bytearray(2_000_000_000)",
                                  "chunks = []\nwhile True:\n    chunks.append(b'x' * 10**7)"])
def test_memory_bomb_fails_without_harming_the_test(bomb: str) -> None:
    r = verify_code(fast(memory_mb=128), bomb)
    assert (r.reward, r.failure_mode, r.details["kind"]) == (0.0, "other", "memory")
    assert bytearray(10_000_000)  # this process still allocates freely


@pytest.mark.parametrize("network", ["in_process", "auto"])
def test_network_is_blocked(listener: socket.socket, network: str) -> None:
    port = listener.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
    r = CodeEnvironment(network=network).verify(fast(), code)  # type: ignore[arg-type]
    assert r.details["kind"] == "load_error"
    assert "OSError" in r.details["error"]
    with pytest.raises(TimeoutError):
        listener.accept()


@pytest.mark.skipif(not netns_prefix(), reason="unshare -n is unavailable here")
def test_network_namespace_stops_what_the_in_process_block_misses(
        listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    # A fresh _socket module escapes the in-process patch; only the namespace stops it.
    code = ("import sys\nfor m in ('socket', '_socket'):\n    sys.modules.pop(m, None)\n"
            f"import _socket\n_socket.socket().connect(('127.0.0.1', {port}))\n")
    r = verify_code(fast(), code, network="netns")
    assert r.details["network"] == "netns"
    assert "Network is unreachable" in r.details["error"]
    with pytest.raises(TimeoutError):
        listener.accept()


def test_workdir_is_private_and_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLYWHEEL_SECRET", "hunter2")
    code = "import os\nopen('out.txt', 'w').write('hi')\nSEEN = dict(os.environ)\n"
    tests = "assert open('out.txt').read() == 'hi'\nassert 'FLYWHEEL_SECRET' not in SEEN\n"
    r = verify_code(fast(tests), code)
    assert r.reward == 1.0
    assert not Path(r.details["workdir"]).exists()
    assert not (tmp_path / "out.txt").exists()


def test_printed_fake_results_do_not_count() -> None:
    code = ('print(\'{"event": "case", "id": "line 1", "ok": true}\')\n'
            'print(\'{"event": "done"}\')\nimport os\nos._exit(0)\n')
    r = verify_code(fast("assert False"), code)
    assert (r.reward, r.details["kind"]) == (0.0, "crashed")


def test_sandbox_that_cannot_start_did_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    with pytest.raises(RolloutNotRun) as info:
        verify_code(fast(), "x = 1")
    assert info.value.kind == "sandbox"


@pytest.mark.parametrize("output", ["", "```python\n```", None])
def test_no_code_is_an_abstention_scored_zero(output: str | None) -> None:
    got = CodeEnvironment().verify(SQUARE, output)
    assert got.reward == 0.0 and got.failure_mode == "empty"


def test_tests_without_cases_are_a_task_bug() -> None:
    with pytest.raises(ValueError, match="no top-level `assert`"):
        case_ids("x = 1\n")
    with pytest.raises(ValueError, match="not valid Python"):
        case_ids("assert (\n")


def test_extract_code_takes_the_first_python_block() -> None:
    text = "Plan:\n```bash\nls\n```\n```py\ndef f():\n    return 1\n```\n```python\nf()\n```"
    assert extract_code(text) == "def f():\n    return 1"
    assert extract_code("  def f(): pass  ") == "def f(): pass"


def test_importing_the_child_script_does_not_run_it() -> None:
    import flywheel.environments._sandbox_child as child

    assert callable(child.main)


def test_run_python_reports_the_isolation_used() -> None:
    run = run_python("x = 1", "assert x == 1", network="in_process")
    assert run.network == "in_process"
    assert [r["event"] for r in run.records] == ["ready", "loaded", "case", "done"]
    assert run.returncode == 0
