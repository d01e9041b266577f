"""The decoding boundary for feedback (pure, no I/O): payloads → `Feedback`, or why not.

The same boundary as trajectories (`flywheel.ingest.wire`): the gateway, `FeedbackClient`,
`flywheel publish --feedback` and the miner's feedback subscriber all decide with it, and it
never raises on input. Storability (NUL, lone surrogates, NaN/Infinity, nesting) is checked
on the decoded value; any other exception while validating is the record's rejection,
logged as a bug in validation. The miner parks what it refuses as its own dead letter
(consumer `feedback`, `RecordParked` → `<prefix>.parked`).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from flywheel.feedback import Feedback, parse_feedback
from flywheel.ingest.storable import unstorable
from flywheel.ingest.wire import Rejection, load_json, parse_guarded, sniff

log = logging.getLogger("flywheel.ingest")


def validate_feedback(record: Any, *, plain: bool = False,
                      trajectory_id: uuid.UUID | None = None,
                      request_id: str | None = None) -> Feedback | Rejection:
    """One decoded JSON value → a `Feedback`, or (reason, error). Never raises.

    `plain`: decoded from a payload `sniff` found plain (nothing to find by the storability
    walk). `trajectory_id`/`request_id`: the target a URL names (`parse_feedback`)."""
    return parse_guarded(lambda: parse_feedback(record, trajectory_id=trajectory_id,
                                                request_id=request_id), record, plain, "feedback")


def check_feedback(fb: Feedback) -> str | None:
    """Why a `Feedback` built in Python (not decoded) cannot be stored, or None."""
    return unstorable(fb.model_dump())


def decode_feedback(value: bytes, *, max_bytes: int) -> Feedback | Rejection:
    """One payload → a `Feedback`, or (reason, error)."""
    if len(value) > max_bytes:
        return "too_large", f"payload is {len(value)} bytes; the limit is {max_bytes}"
    plain, doc = sniff(value)
    if not plain:
        doc = load_json(value)
        if isinstance(doc, tuple):
            return doc
    return validate_feedback(doc, plain=plain)
