"""Served responses kept for `previous_response_id` (table `served_responses`), bounded.

Each stored answer holds the conversation through it (the chat messages a chained call
continues) and its `response` object. Storing one deletes all but the newest
`api.responses_kept` in the same transaction: the table never grows past the bound (an
index range delete on the primary key, so it stays cheap).
"""

from __future__ import annotations

import json
import re
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

ISSUED_ID = re.compile(r"resp_[0-9a-f]{32}")
"""The ids `POST /v1/responses` hands out; no other string is looked up (a NUL byte or a
megabyte of text would otherwise reach Postgres)."""


async def load(engine: AsyncEngine, response_id: str
               ) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """(conversation, response object) of a stored answer, None when it is not kept (an id
    not of the shape this server hands out, `resp_` + 32 hex digits, never was)."""
    if ISSUED_ID.fullmatch(response_id) is None:
        return None
    async with engine.connect() as conn:
        row = (await conn.execute(text(
            "SELECT conversation, body FROM served_responses WHERE response_id = :id"),
            {"id": response_id})).first()
    return None if row is None else (list(row.conversation), dict(row.body))


async def save(engine: AsyncEngine, response_id: str, conversation: list[dict[str, Any]],
               body: dict[str, Any], keep: int) -> None:
    async with engine.begin() as conn:
        seq = (await conn.execute(text(
            """INSERT INTO served_responses (response_id, conversation, body)
               VALUES (:id, CAST(:conversation AS jsonb), CAST(:body AS jsonb))
               RETURNING seq"""),
            {"id": response_id, "conversation": json.dumps(conversation),
             "body": json.dumps(body)})).scalar_one()
        await conn.execute(text("DELETE FROM served_responses WHERE seq <= :oldest"),
                           {"oldest": seq - keep})
