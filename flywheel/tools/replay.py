"""Replay of an agent's logged tool results, and where the policy leaves the logged path.

The cursor walks the logged calls in order. While the policy makes the next logged call —
the same tool, arguments equal under the verifier's argument matching (`match`, the tool's
JSON schema deciding) — it is answered with the logged result. The first call that is not
the next logged one (another tool, other arguments, or a call past the end of the log) is
the divergence: from there the toolset's rule decides (`flywheel.tools.session`), and the
cursor answers nothing more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flywheel.tasks import LoggedCall

Matcher = Callable[[str, dict[str, Any], dict[str, Any]], bool]
"""(tool, logged arguments, arguments of the call made) → whether they are the same call."""


def exact(_name: str, logged: dict[str, Any], made: dict[str, Any]) -> bool:
    return logged == made


class ReplayCursor:
    def __init__(self, log: Sequence[LoggedCall], match: Matcher = exact) -> None:
        self.log, self.match = list(log), match
        self.position = 0
        self.diverged = False

    def answer(self, name: str, arguments: dict[str, Any]) -> LoggedCall | None:
        """The logged call this call replays (the cursor moves on), or None: it diverged."""
        if not self.diverged and self.position < len(self.log):
            logged = self.log[self.position]
            if logged.name == name and self.match(name, logged.arguments, arguments):
                self.position += 1
                return logged
        self.diverged = True
        return None

    def replayed(self) -> list[LoggedCall]:
        """The logged calls answered so far: the path a live backend must retrace."""
        return self.log[:self.position]
