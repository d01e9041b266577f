"""Fail when the installed environment does not meet pyproject.toml's requirements.

`make install` installs requirements.lock with --no-deps, so a dependency added to
pyproject.toml but not locked would be missing at run time with no word from pip; this says
which requirement is unmet and that `make lock` refreshes the lock. Reads the installed
project's metadata (the `dev` extra included), so it needs no TOML parser.

    python infra/check_lock.py [DIST]   # DIST defaults to flywheel
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, requires, version

from packaging.requirements import Requirement

EXTRAS = {"dev"}


def unmet(dist: str) -> list[str]:
    problems = []
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e})
                                              for e in {"", *EXTRAS}):
            continue  # another extra's (vllm, bench, s3) or another platform's
        try:
            got = version(req.name)
        except PackageNotFoundError:
            problems.append(f"{req.name} is not installed (pyproject.toml asks for {req})")
            continue
        if req.specifier and not req.specifier.contains(got, prereleases=True):
            problems.append(f"{req.name} {got} is installed; pyproject.toml asks for {req}")
    return problems


def main() -> int:
    dist = sys.argv[1] if len(sys.argv) > 1 else "flywheel"
    problems = unmet(dist)
    for p in problems:
        print(f"check-lock: {p}", file=sys.stderr)
    if problems:
        print("check-lock: requirements.lock does not match pyproject.toml: run `make lock` "
              "(then `make test`) and commit the new lock", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
