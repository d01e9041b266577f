"""The HTTP API process (`flywheel up` runs it): gateway and, later, the review endpoints."""

from __future__ import annotations

import logging

import uvicorn

from flywheel.config import Settings


def main() -> None:
    from producers.gateway import create_gateway_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = Settings()
    app = create_gateway_app(settings)
    uvicorn.run(app, host=settings.api.host, port=settings.api.port, log_level="warning")


if __name__ == "__main__":
    main()
