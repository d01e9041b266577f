"""Runs *inside* the sandbox process; never imported by flywheel.

`sandbox.py` passes this file's source to `python -I -c` and the job as JSON on stdin:
`{"nonce", "code", "tests", "entrypoint", "limits": {...}}`. Before any untrusted code runs
it sets resource limits, disables sockets in-process, and moves its result channel off
fd 1: results are JSON lines prefixed with the nonce on a private copy of stdout, while the
code's own prints go to stderr. Only the standard library is used.

Test cases: each top-level `assert` statement, in order, then each top-level `def test_*()`
function. Other top-level statements (imports, helpers) run as setup where they stand.
"""

import ast
import json
import os
import resource
import socket
import sys
import types


def _limit(which: int, value: int) -> None:
    _soft, hard = resource.getrlimit(which)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))


def _disable_network() -> None:
    import _socket

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise OSError(101, "network access is disabled in the sandbox")

    class BlockedSocket(socket.socket):  # a class, so `class X(socket.socket)` still imports
        def __init__(self, *_args: object, **_kwargs: object) -> None:
            refuse()

    for module in (socket, _socket):
        for attr in ("create_connection", "getaddrinfo", "socketpair", "fromfd",
                     "create_server", "gethostbyname", "gethostbyname_ex"):
            if hasattr(module, attr):
                setattr(module, attr, refuse)
        setattr(module, "socket", BlockedSocket)  # noqa: B010 - replaces a class on two modules


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def main() -> None:
    job = json.loads(sys.stdin.read())
    limits = job["limits"]
    _limit(resource.RLIMIT_CPU, limits["cpu_s"])
    _limit(resource.RLIMIT_FSIZE, limits["file_bytes"])
    _limit(resource.RLIMIT_NOFILE, limits["open_files"])
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NPROC, limits["processes"])
    _disable_network()
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    nonce = job["nonce"]

    def report(**record: object) -> None:
        channel.write(nonce + json.dumps(record) + "\n")
        channel.flush()

    tests = ast.parse(job["tests"], "tests.py")
    # Last: from here on a large allocation fails inside the code, not in our own set-up.
    _limit(resource.RLIMIT_AS, limits["memory_bytes"])
    report(event="ready")
    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    try:
        compiled = compile(job["code"], "solution.py", "exec")
    except (SyntaxError, ValueError) as exc:
        report(event="syntax_error", error=_error(exc))
        return
    try:
        exec(compiled, module.__dict__)
    except BaseException as exc:
        report(event="load_error", error=_error(exc), type=type(exc).__name__)
        return
    entry = job.get("entrypoint")
    if entry and not callable(module.__dict__.get(entry)):
        report(event="missing_entrypoint", error=f"the code defines no function {entry!r}")
        return
    report(event="loaded")
    functions = []
    for node in tests.body:
        unit = compile(ast.Module(body=[node], type_ignores=[]), "tests.py", "exec")
        is_test = isinstance(node, ast.Assert)
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            functions.append(node.name)
        try:
            exec(unit, module.__dict__)
        except BaseException as exc:
            if is_test:
                report(event="case", id=f"line {node.lineno}", ok=False, error=_error(exc),
                       type=type(exc).__name__)
            else:
                report(event="setup_error", line=node.lineno, error=_error(exc))
            continue
        if is_test:
            report(event="case", id=f"line {node.lineno}", ok=True)
    for name in functions:
        try:
            module.__dict__[name]()
        except BaseException as exc:
            report(event="case", id=name, ok=False, error=_error(exc), type=type(exc).__name__)
        else:
            report(event="case", id=name, ok=True)
    report(event="done")


if __name__ == "__main__":  # `python -c` runs us as __main__; an import must not block
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip atexit hooks and threads the code may have left behind
