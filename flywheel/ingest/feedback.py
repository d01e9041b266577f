"""Feedback records off the feedback topic → `Feedback`, or why one cannot be accepted (pure).

The same reasons as trajectories (`not_json`, `schema`, `too_large`), so a bad feedback is
dead-lettered like a bad trajectory, with the source topic in its dead letter.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from flywheel.feedback import Feedback, parse_feedback
from flywheel.ingest.decode import Reason, describe_validation_error


def decode_feedback(value: bytes, *, max_bytes: int) -> Feedback | tuple[Reason, str]:
    """One payload → a `Feedback`, or (reason, error)."""
    if len(value) > max_bytes:
        return "too_large", f"payload is {len(value)} bytes; the limit is {max_bytes}"
    if b"\x00" in value or b"\\u0000" in value:
        return "schema", "contains a NUL character (\\u0000), which Postgres cannot store"
    try:
        record = json.loads(value)
    except (ValueError, RecursionError) as err:
        return "not_json", f"not valid JSON: {err}"
    try:
        return parse_feedback(record)
    except ValidationError as err:
        return "schema", describe_validation_error(err)
    except (ValueError, TypeError, RecursionError) as err:
        return "schema", str(err) or type(err).__name__
