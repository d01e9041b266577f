"""The HTTP API process (`flywheel up` runs it): gateway, review, rollback, serving, status,
`/metrics` and the dashboard."""

from __future__ import annotations

import logging

import uvicorn
from fastapi import FastAPI

from flywheel.config import Settings


def build_app(settings: Settings) -> FastAPI:
    """The API as `flywheel up` serves it (tests build the same app)."""
    from flywheel.api.dashboard import dashboard_router
    from flywheel.api.feedback_routes import feedback_router
    from flywheel.api.gateway import gateway_router
    from flywheel.api.intake import intake_router
    from flywheel.api.metrics import metrics_router
    from flywheel.api.operator import operator_lifespan, operator_router
    from flywheel.api.publishing import gateway_lifespan
    from flywheel.api.toolsets_routes import toolsets_router
    from flywheel.api.traces import traces_router
    from flywheel.serving.lifespan import serving_lifespan
    from flywheel.serving.responses_routes import responses_router
    from flywheel.serving.routes import serving_router
    from flywheel.web.app import create_app

    return create_app(settings,
                      routers=[gateway_router(), traces_router(), feedback_router(),
                               intake_router(), operator_router(), toolsets_router(),
                               serving_router(),
                               responses_router(),
                               metrics_router(), dashboard_router()],
                      lifespan_hooks=[gateway_lifespan, operator_lifespan, serving_lifespan])


def main() -> None:
    from flywheel.runtime.logs import configure_logging

    configure_logging(logging.INFO)
    settings = Settings()
    uvicorn.run(build_app(settings), host=settings.api.host, port=settings.api.port,
                log_level="warning")


if __name__ == "__main__":
    main()
