"""The HTTP API process (`flywheel up` runs it): gateway, review, rollback, serving."""

from __future__ import annotations

import logging

import uvicorn

from flywheel.config import Settings


def main() -> None:
    from flywheel.api import create_app
    from flywheel.operator_api import operator_lifespan, operator_router
    from producers.gateway import gateway_lifespan, gateway_router

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = Settings()
    app = create_app(settings, routers=[gateway_router(), operator_router()],
                     lifespan_hooks=[gateway_lifespan, operator_lifespan])
    uvicorn.run(app, host=settings.api.host, port=settings.api.port, log_level="warning")


if __name__ == "__main__":
    main()
