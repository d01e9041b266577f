"""Feedback from an agent's process: `FeedbackClient` publishes to `<prefix>.feedback`.

Validates each record as `flywheel.feedback.Feedback` (key = the trajectory or request id it
names) and sends it through a `FlywheelClient` on the feedback topic, so feedback gets the
same batching, retries and disk spool as trajectories, and the same rule for when a record
is delivered: on a bundled broker once the miner's feedback group stored it.

    async with FeedbackClient.from_settings(settings) as feedback:
        await feedback.log({"request_id": "chatcmpl-123", "rating": "down",
                            "correction": [{"role": "assistant", "tool_calls": [...]}]})
"""

from __future__ import annotations

import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

from flywheel.config import MinerSettings, Settings
from flywheel.feedback import Feedback
from flywheel.ingest.feedback_wire import check_feedback, validate_feedback
from flywheel.runtime.endpoints import resolve_bootstrap
from producers.sdk import FlywheelClient, checked_json


def serialize_feedback(feedback: Feedback | dict[str, Any]) -> tuple[Feedback, bytes]:
    """The feedback and the exact bytes to publish, or `ValueError` saying why the miner
    would refuse it, whatever the input (a dict of any shape, or a `Feedback` holding an
    unstorable value)."""
    if isinstance(feedback, Feedback):
        fb, problem = feedback, check_feedback(feedback)
    else:
        result = validate_feedback(feedback)
        if isinstance(result, tuple):
            raise ValueError(f"invalid feedback: {result[1]}")
        fb, problem = result, None
    return fb, checked_json(fb, problem, "feedback")


class FeedbackClient:
    def __init__(self, bootstrap: str, topic: str, *, spool_dir: Path, **kw: Any) -> None:
        """`kw`: as `FlywheelClient`'s; `confirm_group` defaults to the group that stores
        feedback (the miner's feedback group)."""
        kw.setdefault("confirm_group", MinerSettings().feedback_group_id)
        self._client = FlywheelClient(bootstrap, topic, spool_dir=spool_dir, **kw)

    @classmethod
    def from_settings(cls, settings: Settings, **kw: Any) -> FeedbackClient:
        kw.setdefault("confirm", settings.kafka.confirm_stored)
        kw.setdefault("confirm_group", settings.miner.feedback_group_id)
        return cls(resolve_bootstrap(settings), settings.topics.feedback,
                   spool_dir=settings.home / "spool", **kw)

    @property
    def stats(self) -> dict[str, Any]:
        return self._client.stats

    async def __aenter__(self) -> FeedbackClient:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def start(self) -> None:
        await self._client.start()

    async def log(self, feedback: Feedback | dict[str, Any]) -> uuid.UUID:
        """Validate and enqueue one feedback; returns its id. Raises ValueError for anything
        the miner would park (the same decision: `flywheel.ingest.feedback_wire`)."""
        fb, value = serialize_feedback(feedback)
        await self._client.log_raw(value, key=fb.target.encode())
        return fb.feedback_id

    async def log_raw(self, value: bytes, key: bytes | None = None) -> None:
        """Enqueue pre-serialized JSON as is (replays); the miner validates it."""
        await self._client.log_raw(value, key)

    async def flush(self, timeout: float | None = None) -> None:
        await self._client.flush(timeout)

    async def close(self, timeout: float | None = 30.0) -> None:
        await self._client.close(timeout)
