"""The toolset registry: read a toolset's tools from its backend, and its versions in Postgres.

`read_toolset` connects to the backend and reads what it offers; it raises `ToolsetError`
naming what failed (the server is down, exited, speaks another protocol version, lists no
tools, or the configuration names tools it does not list), and nothing is written. Only a
toolset that was read in full is registered: `register` writes the version row and its
`ToolsetRegistered` event in the caller's transaction, or registers nothing new when the
tools and the configuration are what the current version already has (a `check` that finds
nothing changed). `remove` marks the newest version removed (`ToolsetRemoved`).

The table is a projection of the events, except that it keeps header and env values
literally where the event masks them (`${NAME}` references are the way to keep a secret out
of both).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from flywheel.config import Topics
from flywheel.db.outbox import append_events
from flywheel.events import (
    ToolsetRegistered,
    ToolsetRegisteredPayload,
    ToolsetRemoved,
    ToolsetRemovedPayload,
)
from flywheel.tools.backend import ToolsetError
from flywheel.tools.descriptors import (
    Registration,
    ToolDescriptor,
    digest,
    public_config,
    split_protocol,
)
from flywheel.tools.runtime import Catalog, make_backend
from flywheel.tools.safety import allowed_live, is_destructive
from flywheel.toolsets import NAME_PATTERN, ToolsetConfig


class NotRegistered(ToolsetError, LookupError):
    """No such toolset (or it was removed)."""


async def read_toolset(name: str, config: ToolsetConfig) -> Registration:
    """What the backend offers now, as an unnumbered registration (version 0)."""
    if not re.fullmatch(NAME_PATTERN, name):
        raise ToolsetError(f"toolset name {name!r}: use lower-case letters, digits, '_', "
                           f"'.', '-' (at most 63, starting with a letter or digit)")
    described = await make_backend(name, config).describe(config.open_timeout_s)
    offered, protocol = split_protocol(described.tools)
    if not offered:
        raise ToolsetError(f"toolset {name!r}: the backend lists no tools")
    names = {t.name for t in offered}
    for field in ("deny", "allow_destructive"):
        unknown = sorted(set(getattr(config, field)) - names - {"*"})
        if unknown:
            raise ToolsetError(f"toolset {name!r}: {field} names {unknown}, which the backend "
                               f"does not list (it lists {sorted(names)})")
    unknown = sorted(set(config.stubs) - names)
    if unknown:
        raise ToolsetError(f"toolset {name!r}: stubs for unknown tools {unknown}")
    return Registration(name=name, version=0, config=config, tools=offered,
                        protocol_version=described.protocol_version, protocol_tools=protocol)


@dataclass(frozen=True)
class Registered:
    registration: Registration
    new: bool
    """False when the current version already had these tools and this configuration."""


_CONFIG: TypeAdapter[ToolsetConfig] = TypeAdapter(ToolsetConfig)


def _row_registration(row: Any) -> Registration:
    config = _CONFIG.validate_python(row.config)
    return Registration(name=row.name, version=row.version, config=config,
                        tools=[ToolDescriptor.model_validate(t) for t in row.tools],
                        protocol_version=row.protocol_version,
                        protocol_tools=list(row.protocol_tools))


async def current(conn: AsyncConnection, name: str) -> Registration | None:
    """The newest version of `name`, None when there is none or it was removed."""
    row = (await conn.execute(text("""
        SELECT * FROM toolsets WHERE name = :n ORDER BY version DESC LIMIT 1"""),
        {"n": name})).first()
    if row is None or row.removed_at is not None:
        return None
    return _row_registration(row)


async def register(conn: AsyncConnection, read: Registration, *, actor: str,
                   topics: Topics | None) -> Registered:
    """Register what `read_toolset` read as the next version (unless nothing changed)."""
    await conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('toolset:' || :n))"),
                       {"n": read.name})
    row = (await conn.execute(text("""
        SELECT version, digest, removed_at FROM toolsets WHERE name = :n
        ORDER BY version DESC LIMIT 1"""), {"n": read.name})).first()
    found = digest(read.config, read.tools, read.protocol_tools)
    if row is not None and row.digest == found and row.removed_at is None:
        existing = await current(conn, read.name)
        assert existing is not None
        return Registered(existing, new=False)
    version = (row.version if row is not None else 0) + 1
    reg = read.model_copy(update={"version": version})
    tools = [t.model_dump(mode="json") for t in reg.tools]
    await conn.execute(text("""
        INSERT INTO toolsets (name, version, kind, config, tools, protocol_version,
                              protocol_tools, digest, registered_by)
        VALUES (:n, :v, :k, CAST(:c AS jsonb), CAST(:t AS jsonb), :p, CAST(:pt AS jsonb),
                :d, :a)"""),
        {"n": reg.name, "v": version, "k": reg.config.kind,
         "c": reg.config.model_dump_json(), "t": json.dumps(tools),
         "p": reg.protocol_version, "pt": json.dumps(reg.protocol_tools), "d": found,
         "a": actor})
    shown = [{**t, "destructive": is_destructive(d, reg.config)}
             for t, d in zip(tools, reg.tools, strict=True)]
    await append_events(conn, [ToolsetRegistered(
        aggregate_id=f"toolset:{reg.name}",
        payload=ToolsetRegisteredPayload(
            name=reg.name, version=version, kind=reg.config.kind,
            config=public_config(reg.config), tools=shown, digest=found,
            protocol_version=reg.protocol_version, actor=actor))], topics)
    return Registered(reg, new=True)


async def remove(conn: AsyncConnection, name: str, *, actor: str,
                 topics: Topics | None) -> ToolsetRemoved:
    row = (await conn.execute(text("""
        UPDATE toolsets SET removed_at = now()
        WHERE name = :n AND removed_at IS NULL
          AND version = (SELECT max(version) FROM toolsets WHERE name = :n)
        RETURNING version"""), {"n": name})).first()
    if row is None:
        raise NotRegistered(f"no toolset {name!r} is registered (flywheel tools ls)")
    event = ToolsetRemoved(aggregate_id=f"toolset:{name}", payload=ToolsetRemovedPayload(
        name=name, version=row.version, actor=actor))
    await append_events(conn, [event], topics)
    return event


async def registrations(conn: AsyncConnection) -> list[Registration]:
    """The newest version of every toolset not removed (what episodes are mined against)."""
    rows = (await conn.execute(text("""
        SELECT DISTINCT ON (name) * FROM toolsets ORDER BY name, version DESC"""))).all()
    return [_row_registration(r) for r in rows if r.removed_at is None]


async def list_toolsets(conn: AsyncConnection) -> list[dict[str, Any]]:
    """The newest version of every toolset not removed, with what `ls` shows."""
    rows = (await conn.execute(text("""
        SELECT DISTINCT ON (name) * FROM toolsets ORDER BY name, version DESC"""))).all()
    return [summary(_row_registration(r), r) for r in rows if r.removed_at is None]


def summary(reg: Registration, row: Any = None) -> dict[str, Any]:
    destructive = sorted(t.name for t in reg.tools if is_destructive(t, reg.config))
    out: dict[str, Any] = {
        "name": reg.name, "version": reg.version, "kind": reg.config.kind,
        "tools": len(reg.tools), "destructive": destructive,
        "allowed_live": [n for n in destructive if allowed_live(n, reg.config)],
        "on_divergence": reg.config.on_divergence, "dry_run": reg.config.dry_run,
        "state": reg.has_state, "protocol_version": reg.protocol_version}
    if row is not None:
        out["registered_at"] = row.registered_at
        out["registered_by"] = row.registered_by
    return out


async def show(conn: AsyncConnection, name: str) -> dict[str, Any] | None:
    row = (await conn.execute(text("""
        SELECT * FROM toolsets WHERE name = :n ORDER BY version DESC LIMIT 1"""),
        {"n": name})).first()
    if row is None or row.removed_at is not None:
        return None
    reg = _row_registration(row)
    versions = (await conn.execute(text("""
        SELECT version, digest, registered_at, registered_by FROM toolsets WHERE name = :n
        ORDER BY version"""), {"n": name})).all()
    return {**summary(reg, row), "config": public_config(reg.config),
            "protocol_tools": reg.protocol_tools,
            "tool_schemas": [{**t.model_dump(mode="json"),
                              "destructive": is_destructive(t, reg.config)}
                             for t in reg.tools],
            "versions": [dict(v._mapping) for v in versions]}


def registry_catalog(engine: AsyncEngine, refresh_s: float) -> Catalog:
    """A catalog that reads registrations from Postgres (services install it at start)."""
    async def resolve(name: str) -> Registration | None:
        async with engine.connect() as conn:
            return await current(conn, name)

    return Catalog(resolve, refresh_s)
