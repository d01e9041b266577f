"""The operator dashboard: one static page (`index.html`, inline CSS and JS, no build step)
served at `/dashboard`, with `/` redirecting to it.

The page holds no data: it asks for a token, keeps it in `sessionStorage` and reads
`/v1/status`, `/v1/promotions` and `/v1/whoami` with it; approve, reject and rollback call the
operator API, which checks the `operate` scope. The Content-Security-Policy admits only the
page's own inline script and style (by hash) and requests to this origin, so text from the
database can never run as code.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, RedirectResponse


def _hashes(html: str, tag: str) -> str:
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
                    for b in blocks)


def dashboard_router() -> APIRouter:
    html = resources.files("flywheel.api.dashboard").joinpath("index.html").read_text(
        encoding="utf-8")
    headers = {
        "Content-Security-Policy": (
            f"default-src 'none'; script-src {_hashes(html, 'script')}; "
            f"style-src {_hashes(html, 'style')}; connect-src 'self'; img-src 'self' data:; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }
    router = APIRouter(tags=["dashboard"])

    @router.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard", status_code=307)

    @router.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        """The operator dashboard (needs no token to load; it asks for one)."""
        return HTMLResponse(html, headers=headers)

    return router
