"""What a verifier canary is (`flywheel.gate.canaries` builds and scores them): a task, an
output whose right score is known, and that expected score; and how a wrong value is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from flywheel.tasks import TaskSpec

Expect = Literal["success", "failure", "unsafe"]


@dataclass(frozen=True)
class Canary:
    task: TaskSpec
    kind: str
    expect: Expect
    output: object


def wrong_value(value: Any, taken: list[Any]) -> Any:
    """A value of the same JSON type as `value` that is none of `taken`."""
    for n in range(1, 100):
        if isinstance(value, bool):
            out: Any = not value
        elif isinstance(value, int | float):
            out = value + 7 * n
        elif isinstance(value, str):
            out = f"{value} WRONG{n}" if value else f"WRONG{n}"
        elif isinstance(value, list):
            out = [*value, *value] if value else [f"WRONG{n}"]
        elif isinstance(value, dict):
            out = {**value, f"wrong{n}": n}
        else:
            out = f"WRONG{n}"
        if out not in taken:
            return out
    raise ValueError(f"no wrong value found for {value!r}")
