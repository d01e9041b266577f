"""`flywheel status` reads the status model without the HTTP stack: importing it (and the CLI)
loads neither fastapi nor starlette, so the command stays fast."""

from __future__ import annotations

import subprocess
import sys


def test_the_status_model_and_the_cli_import_no_http_framework() -> None:
    code = ("import sys, flywheel.observe.status, flywheel.cli.main\n"
            "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", f"imported by `flywheel status`: {out}"
