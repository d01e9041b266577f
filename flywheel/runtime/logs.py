"""Bounded log files for everything the local stack starts, and secrets kept out of output.

Rotation is *copy-truncate*: the file is copied to `<name>.1` (older copies shift up to
`<name>.<keep>`, the oldest is dropped) and then truncated in place. Every process the stack
starts writes its log with O_APPEND, so after the truncation its next write lands at the
new end (offset 0) without reopening anything. That works the same for our Python
services, the broker and Postgres, and for processes that outlive their supervisor (an
adopted broker keeps logging where it did). The price, as with logrotate's copytruncate:
lines written between the copy and the truncation are lost (microseconds of writing).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@\s/]+)@",
                           re.IGNORECASE)
_SECRET_KEYS = re.compile(r"(password|passwd|secret|token|access_key|credential)", re.I)
_KEY_VALUE = re.compile(r"\b(password|passwd|pwd|secret|PGPASSWORD)=([^\s&;,'\"]+)", re.I)
MASK = "***"


def rotate_if_needed(path: Path, max_bytes: int, keep: int) -> bool:
    """Rotate `path` when it is larger than `max_bytes`; True when it did.

    A missing file is not an error (the process has not written yet)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size <= max_bytes:
        return False
    for i in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
    first = path.with_name(f"{path.name}.1")
    with open(path, "rb") as src, open(first, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        # Whatever arrived while copying, so that only the last instant can be lost.
        shutil.copyfileobj(src, dst, 1 << 20)
        os.truncate(path, 0)
    stat = path.stat()
    with_owner = (stat.st_uid, stat.st_gid)
    if hasattr(os, "chown") and os.geteuid() == 0:
        os.chown(first, *with_owner)  # Postgres' log stays readable by its own user
    return True


def rotated_files(path: Path) -> list[Path]:
    """`path` and its rotated copies that exist, newest first."""
    out = [path] if path.exists() else []
    i = 1
    while (p := path.with_name(f"{path.name}.{i}")).exists():
        out.append(p)
        i += 1
    return out


def mask_url(url: str) -> str:
    """`postgresql+asyncpg://user:secret@host/db` → `postgresql+asyncpg://user:***@host/db`."""
    return _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", url)


def mask_text(text: str) -> str:
    """Every `scheme://user:password@` and `password=…` in free text (a log line, an
    error) masked."""
    return _KEY_VALUE.sub(lambda m: f"{m[1]}={MASK}", mask_url(text))


class MaskingFormatter(logging.Formatter):
    """A formatter whose every line (tracebacks included) has its secrets masked."""

    def format(self, record: logging.LogRecord) -> str:
        return mask_text(super().format(record))


def configure_logging(level: int = logging.INFO,
                      fmt: str = "%(asctime)s %(name)s %(message)s") -> None:
    """`logging.basicConfig` for every process of the stack, with secrets masked."""
    logging.basicConfig(level=level, format=fmt)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(MaskingFormatter(fmt))


def mask_secrets(data: Any, *, key: str = "") -> Any:
    """A JSON-like value with passwords in URLs masked and secret-named fields (`tokens`,
    `password`, …) replaced by a note: safe to print, to log, or to serve in a status."""
    if isinstance(data, dict):
        if key and _SECRET_KEYS.search(key):
            return {MASK: f"{len(data)} entries, see the file itself (mode 0600)"}
        return {k: mask_secrets(v, key=str(k)) for k, v in data.items()}
    if isinstance(data, list):
        return [mask_secrets(v, key=key) for v in data]
    if isinstance(data, str):
        if key and _SECRET_KEYS.search(key):
            return MASK
        return mask_text(data)
    return data
