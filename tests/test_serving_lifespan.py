"""The serving endpoint has its own lifespan: mounted alone (no operator routes, no operator
lifespan), its routes answer from the `ServingSync` it keeps."""

from __future__ import annotations

import httpx

from flywheel.config import Settings
from flywheel.serving.lifespan import serving_lifespan
from flywheel.serving.responses_routes import responses_router
from flywheel.serving.routes import serving_router
from flywheel.web.app import create_app


async def test_serving_alone_lists_its_models(settings: Settings) -> None:
    s = settings.model_copy(update={"api": settings.api.model_copy(update={
        "tokens": {"reader": []}, "serve": False})})
    app = create_app(s, routers=[serving_router(), responses_router()],
                     lifespan_hooks=[serving_lifespan])
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
        r = await client.get("/v1/models", headers={"Authorization": "Bearer reader"})
        assert not hasattr(app.state, "db")  # nothing of the operator's was opened
        missing = await client.get("/v1/responses/resp_" + "0" * 32,
                                   headers={"Authorization": "Bearer reader"})
    assert r.status_code == 200, r.text
    cards = {c["id"]: c for c in r.json()["data"]}
    assert set(cards) == {"production", "base"} and cards["production"]["alias_of"] == "base"
    assert missing.status_code == 404 and missing.json()["error"]["code"]
