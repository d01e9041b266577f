"""`code`: generated Python must pass the task's tests, run in the sandbox (`sandbox.py`).

The output is the model's text; the code is the first Markdown block tagged python/py (or
untagged), else the whole text. Each top-level `assert` of `spec.tests` and each top-level
`def test_*()` is one test case, run one by one against the code's namespace, so a failing
case does not hide the others.

Reward = share of test cases passed (a dense signal for GRPO); success ⇔ all pass. The code
ran and was bad whenever the sandbox started, so these are scored failures, told apart by
`details["kind"]`:

| kind                             | failure_mode     |
|----------------------------------|------------------|
| passed                           | None             |
| syntax_error, missing_entrypoint | invalid_format   |
| timeout (wall clock or CPU)      | timeout          |
| load_error, failed_tests, memory, output_limit, crashed | other |

`bad_arguments` and `tool_error` are about tool calls, so code failures use `other` with the
kind as the finer reason. An answer without code scores 0 (`empty`). Only a sandbox that
could not start is `RolloutNotRun("sandbox")`.
"""

from __future__ import annotations

import re
import signal
from typing import Any

from flywheel.environments.base import (
    AnySpec,
    Environment,
    ToolSchemas,
    abstained,
    expect_spec,
    result,
)
from flywheel.environments.sandbox import Network, SandboxRun, case_ids, run_python
from flywheel.tasks import CodeSpec, FailureMode, VerifierResult

_BLOCK = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[ \t]*\n(.*?)^[ \t]*```", re.S | re.M)
_PYTHON_TAGS = ("", "python", "python3", "py")
_MODES: dict[str, FailureMode | None] = {
    "passed": None, "syntax_error": "invalid_format", "missing_entrypoint": "invalid_format",
    "timeout": "timeout"}
_COMPONENTS = {"tests_passed": 0.0, "loaded": 0.0}


def extract_code(text: str) -> str:
    """The code in a model's answer: its first python (or untagged) fenced block, or all."""
    # finditer consumes blocks in order, so a closing fence is never taken for an opening one.
    for block in _BLOCK.finditer(text):
        if block.group(1).lower() in _PYTHON_TAGS:
            return block.group(2).strip("\n")
    stripped = text.strip()
    if stripped.startswith("```"):  # an unclosed fence: drop the opening line
        stripped = stripped.split("\n", 1)[1] if "\n" in stripped else ""
    return stripped


def outcome_kind(run: SandboxRun, cases: list[str]) -> str:
    """Why the run ended the way it did (see the module table)."""
    outcomes = {r.get("id"): r for r in run.records if r.get("event") == "case"}
    for early in ("syntax_error", "missing_entrypoint"):
        if run.event(early):
            return early
    load = run.event("load_error")
    if load:
        return "memory" if load.get("type") == "MemoryError" else "load_error"
    if run.timed_out or run.returncode == -signal.SIGXCPU:
        return "timeout"
    if run.returncode == -signal.SIGXFSZ:
        return "output_limit"
    if run.event("done") is None:
        return "crashed"
    if any(r.get("type") == "MemoryError" for r in outcomes.values()):
        return "memory"
    return "passed" if all(outcomes.get(c, {}).get("ok") for c in cases) else "failed_tests"


def verify_code(spec: CodeSpec, output: str, *, network: Network = "auto") -> VerifierResult:
    """Run the code in `output` against `spec.tests` and score the share of cases passed."""
    code = extract_code(output)
    if not code.strip():
        return abstained(_COMPONENTS, "the attempt contains no code")
    cases = case_ids(spec.tests)
    run = run_python(code, spec.tests, entrypoint=spec.entrypoint, timeout_s=spec.timeout_s,
                     memory_mb=spec.memory_mb, network=network)
    outcomes = {r.get("id"): r for r in run.records if r.get("event") == "case"}
    failed = [{"case": c, "error": outcomes[c].get("error", "") if c in outcomes else "not run"}
              for c in cases if not outcomes.get(c, {}).get("ok")]
    kind = outcome_kind(run, cases)
    share = (len(cases) - len(failed)) / len(cases)
    comps = {"tests_passed": share, "loaded": float(run.event("loaded") is not None)}
    details: dict[str, Any] = {"kind": kind, "passed": len(cases) - len(failed),
                               "total": len(cases), "network": run.network,
                               "workdir": run.workdir, "wall_s": run.wall_s}
    if kind == "passed":
        return result(1.0, comps, None, **details)
    problem = (run.event("syntax_error") or run.event("missing_entrypoint")
               or run.event("load_error") or {})
    return result(share, comps, _MODES.get(kind, "other"), **details, failed=failed[:5],
                  error=problem.get("error"), returncode=run.returncode,
                  stderr_tail=run.stderr_tail[-500:])


class CodeEnvironment(Environment):
    """Single-step: the output is the model's answer containing the code."""

    name = "code"

    def __init__(self, network: Network = "auto") -> None:
        self.network: Network = network

    def verify(self, spec: AnySpec, output: object, *,
               tools: ToolSchemas | None = None) -> VerifierResult:
        if output is None:
            return abstained(_COMPONENTS, "the attempt produced no output")
        if not isinstance(output, str):
            raise TypeError(f"code scores the model's answer text, got {type(output).__name__}")
        return verify_code(expect_spec(spec, CodeSpec, self.name), output, network=self.network)
