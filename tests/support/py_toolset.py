"""A Python toolset for the tests: the MCP test server's notes world as a plain class.

Its tools come from signatures and docstrings; `RECEIVED` records every call that reached a
method (the tests read it to see what ran), `wipe_notes` is marked destructive.
"""

from __future__ import annotations

import asyncio
from typing import Any

from flywheel.tools import destructive

RECEIVED: list[tuple[int, str, dict[str, Any]]] = []


class Notes:
    """Notes and a counter; one instance per episode."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.counter = 0

    def reset(self, initial_state: dict[str, Any] | None) -> None:
        state = initial_state or {}
        self.notes = list(state.get("notes", []))
        self.counter = int(state.get("counter", 0))

    def state(self) -> dict[str, Any]:
        return {"notes": self.notes, "counter": self.counter}

    def add_note(self, text: str) -> str:
        """Add a note.

        The note is kept until the episode ends."""
        RECEIVED.append((id(self), "add_note", {"text": text}))
        self.notes.append(text)
        return f"added note {len(self.notes)}"

    def list_notes(self) -> list[str]:
        """List the notes."""
        RECEIVED.append((id(self), "list_notes", {}))
        return self.notes

    def bump(self, by: int) -> str:
        """Add `by` to the counter and say its new value."""
        RECEIVED.append((id(self), "bump", {"by": by}))
        self.counter += by
        return f"counter is {self.counter}"

    @destructive
    def wipe_notes(self) -> str:
        """Delete every note. Irreversible."""
        RECEIVED.append((id(self), "wipe_notes", {}))
        count, self.notes = len(self.notes), []
        return f"deleted {count} notes"

    async def sleep(self, seconds: float) -> str:
        """Wait, then answer (a tool that hangs)."""
        RECEIVED.append((id(self), "sleep", {"seconds": seconds}))
        await asyncio.sleep(seconds)
        return "awake"


class Desk:
    """A help desk with the two tools `tests/test_api_served_equals_gated.py` trains a version
    to call (same names, descriptions and parameters): the weather is read, tickets are kept."""

    def __init__(self) -> None:
        self.tickets: list[dict[str, Any]] = []

    def reset(self, initial_state: dict[str, Any] | None) -> None:
        self.tickets = [dict(t) for t in (initial_state or {}).get("tickets", [])]

    def state(self) -> dict[str, Any]:
        return {"tickets": self.tickets}

    def get_weather(self, city: str) -> str:
        """Current weather for a city"""
        return f"{city}: {12 + len(city) % 9} C, clear"

    def create_ticket(self, title: str, priority: int) -> str:
        """Open a support ticket"""
        self.tickets.append({"title": title, "priority": priority})
        return f"opened ticket {len(self.tickets)}"
