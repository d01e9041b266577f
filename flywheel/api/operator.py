"""HTTP API for operators: review decisions, roll back, where the `production` alias points.

Reads (`GET /v1/status`, `/v1/whoami`, `/v1/adapters…`, `/v1/promotions…`, `/v1/serving`)
need any valid token; actions (approve, reject, rollback) need the `operate` scope and are
audited as events whose `actor` is the token fingerprint (plus the `X-Flywheel-Actor` name
when sent). The lifespan hook opens the database pool (`app.state.db`) these routes, the
metrics and the trace intake read; serving has its own (`flywheel.serving.lifespan`).

Mount with `create_app(settings, routers=[operator_router()], lifespan_hooks=[operator_lifespan])`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Header, HTTPException, Request, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.adapters import lifecycle, queries
from flywheel.db.engine import make_engine
from flywheel.errors import unavailable
from flywheel.observe.status import (
    dependency_report,
    describe_error,
    lag_or_error,
    overview,
    stack_state,
)
from flywheel.runtime.endpoints import resolve_db_url
from flywheel.web.app import settings_of
from flywheel.web.auth import Principal, require_scope
from flywheel.web.guards import StorableText, existing_version, storable_or_422
from flywheel.web.health import add_probe

STATUS_DB_TIMEOUT_S = 5.0
MAX_REASON = 4000
MAX_ACTOR = 200
EvaluationState = Literal["pending", "promoted", "rejected", "superseded"]


class Decide(BaseModel):
    reason: StorableText = Field(min_length=1, max_length=MAX_REASON,
                                 description="Why (kept in the audit log).")
    force: bool = Field(default=False,
                        description="Approve against the gate's reject recommendation.")


class Rollback(BaseModel):
    reason: StorableText = Field(min_length=1, max_length=MAX_REASON)
    to: int | None = Field(default=None, strict=True,
                           description="Version to return to; omitted = the previous "
                                       "production version; 0 = the base model.")


@asynccontextmanager
async def operator_lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings = settings_of(app)
    engine = make_engine(resolve_db_url(settings), pool_size=4)
    app.state.db = engine

    async def postgres_answers() -> None:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))

    add_probe(app, "postgres", postgres_answers)
    try:
        yield
    finally:
        await engine.dispose()


def _db(request: Request) -> AsyncEngine:
    engine: AsyncEngine = request.app.state.db
    return engine


def actor_name(principal: Principal, name: str | None) -> str:
    if name is not None:
        storable_or_422(name, "the X-Flywheel-Actor header")
        if len(name) > MAX_ACTOR:
            raise HTTPException(422, f"the X-Flywheel-Actor header is {len(name)} characters; "
                                f"at most {MAX_ACTOR}")
    return f"{name} (token {principal.fingerprint})" if name else f"token {principal.fingerprint}"


def _error(err: lifecycle.LifecycleError) -> HTTPException:
    code = (status.HTTP_404_NOT_FOUND if isinstance(err, lifecycle.NotFound)
            else status.HTTP_409_CONFLICT)
    return HTTPException(code, str(err))


def operator_router() -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["review"])
    reader = require_scope(None)
    operator = require_scope("operate")

    @router.get("/whoami", tags=["ops"])
    async def whoami(principal: Principal = reader) -> dict[str, Any]:
        """The caller's token fingerprint and scopes (the dashboard shows the actions its
        token may take)."""
        return {"fingerprint": principal.fingerprint, "scopes": sorted(principal.scopes)}

    @router.get("/status", tags=["ops"], responses={503: {
        "description": "Postgres is down: `detail` says so, `dependencies`, `lag` and `stack` "
                       "say what is still known"}})
    async def pipeline_status(request: Request, _: Principal = reader) -> Any:
        """`flywheel status --json` plus what the dashboard draws: trainer state, reward and
        holdout curves per adapter version, failure-mode breakdown, baseline. `lag_error`
        says why `lag` is empty when Kafka does not answer; `dependencies` says which of
        Postgres and Kafka answer; `stack` is the local supervisor's view (restarts, …)."""
        settings = settings_of(request)
        lag, lag_error = await lag_or_error(settings)
        data: dict[str, Any] | None = None
        db_error: str | None = None
        try:
            async with asyncio.timeout(STATUS_DB_TIMEOUT_S), _db(request).connect() as conn:
                data = await overview(conn, settings)
        except Exception as err:
            if unavailable(err) is None:
                raise
            db_error = describe_error(err)
        known = {"lag": lag, "lag_error": lag_error,
                 "dependencies": dependency_report(db_error, lag_error),
                 "stack": stack_state(settings)}
        if data is None:
            return JSONResponse({**known, "detail": f"Postgres is unavailable ({db_error});"
                                 " the pipeline figures come back when it answers"},
                                status_code=503, headers={"Retry-After": "5"})
        return {**data, **known}

    @router.get("/adapters")
    async def adapters(request: Request, _: Principal = reader) -> dict[str, Any]:
        """Every adapter version of the policy, its status and holdout result."""
        policy = settings_of(request).policy
        async with _db(request).connect() as conn:
            return {"production": await queries.production(conn, policy),
                    "adapters": await queries.list_adapters(conn, policy)}

    @router.get("/adapters/{version}")
    async def adapter(version: int, request: Request, _: Principal = reader) -> dict[str, Any]:
        """One version: its row, its lifecycle events and its evaluations (404: none)."""
        existing_version(version)
        async with _db(request).connect() as conn:
            found = await queries.get_adapter(conn, settings_of(request).policy, version)
        if found is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no adapter version {version}")
        return found

    @router.post("/adapters/rollback")
    async def rollback(body: Rollback, request: Request, principal: Principal = operator,
                       x_flywheel_actor: str | None = Header(default=None)) -> dict[str, Any]:
        """Re-point production to an earlier promoted version (audited)."""
        settings = settings_of(request)
        if body.to not in (None, 0):  # checked before mapping: -1 is lifecycle.BASE
            existing_version(body.to)
        to = lifecycle.BASE if body.to == 0 else body.to
        try:
            async with _db(request).begin() as conn:
                event = await lifecycle.rollback(
                    conn, settings.policy, to=to, reason=body.reason,
                    actor=actor_name(principal, x_flywheel_actor), topics=settings.topics)
        except lifecycle.LifecycleError as err:
            raise _error(err) from err
        return event.model_dump(mode="json")

    @router.get("/promotions")
    async def promotions(request: Request, state: EvaluationState | None = None,
                         _: Principal = reader) -> list[dict[str, Any]]:
        """Gate decision records, newest first (`state=pending` for the review queue)."""
        async with _db(request).connect() as conn:
            return await queries.list_evaluations(conn, settings_of(request).policy,
                                                  state=state)

    @router.get("/promotions/{evaluation_id}")
    async def promotion(evaluation_id: uuid.UUID, request: Request,
                        _: Principal = reader) -> dict[str, Any]:
        async with _db(request).connect() as conn:
            found = await queries.get_evaluation(conn, evaluation_id)
        if found is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no evaluation {evaluation_id}")
        return found

    @router.post("/promotions/{evaluation_id}/approve")
    async def approve(evaluation_id: uuid.UUID, body: Decide, request: Request,
                      principal: Principal = operator,
                      x_flywheel_actor: str | None = Header(default=None)) -> dict[str, Any]:
        settings = settings_of(request)
        try:
            async with _db(request).begin() as conn:
                event = await lifecycle.approve(
                    conn, evaluation_id, actor=actor_name(principal, x_flywheel_actor),
                    reason=body.reason, topics=settings.topics, force=body.force)
        except lifecycle.LifecycleError as err:
            raise _error(err) from err
        return event.model_dump(mode="json")

    @router.post("/promotions/{evaluation_id}/reject")
    async def reject(evaluation_id: uuid.UUID, body: Decide, request: Request,
                     principal: Principal = operator,
                     x_flywheel_actor: str | None = Header(default=None)) -> dict[str, Any]:
        settings = settings_of(request)
        try:
            async with _db(request).begin() as conn:
                event = await lifecycle.reject(
                    conn, evaluation_id, actor=actor_name(principal, x_flywheel_actor),
                    reason=body.reason, topics=settings.topics)
        except lifecycle.LifecycleError as err:
            raise _error(err) from err
        return event.model_dump(mode="json")

    @router.get("/serving")
    async def serving(request: Request, _: Principal = reader) -> dict[str, Any]:
        """What the `production` alias resolves to, and on which replicas."""
        async with _db(request).connect() as conn:
            return await queries.production(conn, settings_of(request).policy)

    return router
