"""Operator routes for toolsets (the agent's own tools): list, show, register, check, remove.

Reads need any valid token; registering, checking and removing need `operate` and are
audited (the event's `actor` is the token fingerprint, plus `X-Flywheel-Actor`). Registering
and checking connect to the backend from the API process and read its tools first: a
backend that cannot be read is a 502 naming what failed, and nothing is registered. The
configuration is `flywheel.toolsets.ToolsetConfig` (`kind` + its fields), as
`FLYWHEEL_TOOLS__TOOLSETS` takes it.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Header, HTTPException, Request, status
from pydantic import BaseModel, Field

from flywheel.api.operator import actor_name
from flywheel.tools.backend import ToolsetError
from flywheel.tools.registry import (
    NotRegistered,
    current,
    list_toolsets,
    read_toolset,
    register,
    remove,
    show,
    summary,
)
from flywheel.toolsets import NAME_PATTERN, ToolsetConfig
from flywheel.web.app import settings_of
from flywheel.web.auth import Principal, require_scope


class NewToolset(BaseModel):
    name: str = Field(pattern=NAME_PATTERN)
    config: ToolsetConfig


def _named(name: str) -> str:
    """`name` if a toolset could be called that, else 404 (nothing else can exist)."""
    if not re.fullmatch(NAME_PATTERN, name):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no toolset {name[:100]!r} (names "
                            f"match {NAME_PATTERN})")
    return name


def _unreadable(err: ToolsetError) -> HTTPException:
    return HTTPException(status.HTTP_502_BAD_GATEWAY, f"{err} — nothing was registered")


def toolsets_router() -> APIRouter:
    router = APIRouter(prefix="/v1/toolsets", tags=["toolsets"])
    reader = require_scope(None)
    operator = require_scope("operate")

    @router.get("")
    async def toolsets(request: Request, _: Principal = reader) -> list[dict[str, Any]]:
        """Registered toolsets, the newest version of each."""
        async with request.app.state.db.connect() as conn:
            return await list_toolsets(conn)

    @router.get("/{name}")
    async def toolset(name: str, request: Request, _: Principal = reader) -> dict[str, Any]:
        """One toolset: configuration (secrets masked), tools and schemas, versions."""
        _named(name)
        async with request.app.state.db.connect() as conn:
            found = await show(conn, name)
        if found is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no toolset {name!r}")
        return found

    async def _register(request: Request, read: Any, who: str) -> dict[str, Any]:
        async with request.app.state.db.begin() as conn:
            done = await register(conn, read, actor=who, topics=settings_of(request).topics)
        return {**summary(done.registration), "new_version": done.new}

    @router.post("", status_code=status.HTTP_201_CREATED)
    async def add(body: NewToolset, request: Request, principal: Principal = operator,
                  x_flywheel_actor: str | None = Header(default=None)) -> dict[str, Any]:
        """Register a toolset (or its next version): its tools are read from the backend."""
        who = actor_name(principal, x_flywheel_actor)
        try:
            read = await read_toolset(body.name, body.config)
        except ToolsetError as err:
            raise _unreadable(err) from err
        return await _register(request, read, who)

    @router.post("/{name}/check")
    async def check(name: str, request: Request, principal: Principal = operator,
                    x_flywheel_actor: str | None = Header(default=None)) -> dict[str, Any]:
        """Read a registered toolset's tools again (a new version if they changed)."""
        who = actor_name(principal, x_flywheel_actor)
        async with request.app.state.db.connect() as conn:
            reg = await current(conn, _named(name))
        if reg is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no toolset {name!r}")
        try:
            read = await read_toolset(name, reg.config)
        except ToolsetError as err:
            raise _unreadable(err) from err
        return await _register(request, read, who)

    @router.delete("/{name}")
    async def delete(name: str, request: Request, principal: Principal = operator,
                     x_flywheel_actor: str | None = Header(default=None)) -> dict[str, Any]:
        """Remove a toolset: no new episode runs on it."""
        who = actor_name(principal, x_flywheel_actor)
        try:
            async with request.app.state.db.begin() as conn:
                event = await remove(conn, _named(name), actor=who,
                                     topics=settings_of(request).topics)
        except NotRegistered as err:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from err
        return event.model_dump(mode="json")

    return router
