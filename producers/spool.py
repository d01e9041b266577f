"""The SDK's disk spool: an append-only record file per client and its acked offset.

Spool line: `<crc32 hex> <base64 key | -> <base64 value>\\n`. A torn last line (crash mid-
write) is cut on open; a line failing its checksum is skipped. `<name>.acked` holds the byte
offset replayed so far, so a crash mid-replay re-sends at most one batch. Records the broker
refuses for good (too large, corrupt) go to `<topic>.rejected` instead of blocking the rest.
Records logged while spooling are written at once (a killed process loses none) and fsync'd
within `linger_ms` (an OS crash may lose that window); spilled batches are fsync'd at once.
"""

from __future__ import annotations

import base64
import fcntl
import logging
import os
import zlib
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("producers.sdk")

Record = tuple[bytes | None, bytes]
_SPOOL_SLOTS = 64


def encode(key: bytes | None, value: bytes) -> bytes:
    body = (base64.b64encode(key) if key is not None else b"-") + b" " + base64.b64encode(value)
    return b"%08x %s\n" % (zlib.crc32(body), body)


def decode(line: bytes) -> Record | None:
    """None for a line that fails its checksum, i.e. was never written whole."""
    try:
        crc, body = line.rstrip(b"\n").split(b" ", 1)
        if int(crc, 16) != zlib.crc32(body):
            return None
        key, value = body.split(b" ", 1)
        return (None if key == b"-" else base64.b64decode(key, validate=True),
                base64.b64decode(value, validate=True))
    except ValueError:  # includes binascii.Error
        return None


class Spool:
    """Append-only record file plus its acked offset; one client owns a file (flock)."""

    def __init__(self, directory: Path, topic: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path, self._fd = self._claim(directory, topic)
        self._ack_fd = os.open(self.path.with_suffix(".acked"), os.O_RDWR | os.O_CREAT, 0o600)
        raw = os.pread(self._ack_fd, 32, 0).strip()
        self.size = os.fstat(self._fd).st_size
        self.acked = int(raw) if raw.isdigit() and int(raw) <= self.size else 0
        self.count = self._scan()
        self._dirty = False

    @staticmethod
    def _claim(directory: Path, topic: str) -> tuple[Path, int]:
        # Slot 0 first: a restarted process gets the spool its predecessor left behind.
        for slot in range(_SPOOL_SLOTS):
            path = directory / f"{topic}.{slot}.spool"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return path, fd
        raise RuntimeError(f"all {_SPOOL_SLOTS} spool files for {topic!r} in {directory} are"
                           " held by running clients; close some or use another spool_dir")

    def _scan(self) -> int:
        count, pos = 0, self.acked
        with open(self.path, "rb") as f:
            f.seek(pos)
            for line in f:
                if not line.endswith(b"\n"):
                    log.warning("spool %s: cutting a torn last line (%d bytes) left by a crash",
                                self.path, len(line))
                    os.ftruncate(self._fd, pos)
                    os.fsync(self._fd)
                    self.size = pos
                    break
                pos += len(line)
                if decode(line) is None:
                    log.warning("spool %s: skipping a corrupt line at byte %d", self.path, pos)
                else:
                    count += 1
        return count

    def append(self, records: Iterable[Record], *, sync: bool) -> None:
        lines = [encode(k, v) for k, v in records]
        blob = b"".join(lines)
        view = memoryview(blob)
        while view:  # O_APPEND and one writer: a short write's rest still lands contiguously
            view = view[os.write(self._fd, view):]
        self.count += len(lines)
        self.size += len(blob)
        self._dirty = True
        if sync:
            self.sync()

    def read(self, max_records: int) -> list[tuple[Record, int]]:
        """Up to `max_records` unacked records, each with the byte offset just past it."""
        out: list[tuple[Record, int]] = []
        pos = self.acked
        with open(self.path, "rb") as f:
            f.seek(pos)
            for line in f:
                pos += len(line)
                record = decode(line)
                if record is not None:
                    out.append((record, pos))
                    if len(out) >= max_records:
                        break
        return out

    def ack(self, offset: int, n: int) -> None:
        self.acked, self.count = offset, self.count - n
        os.pwrite(self._ack_fd, b"%020d\n" % offset, 0)
        os.fsync(self._ack_fd)

    def clear(self) -> None:
        # Offset first: a crash between the two steps re-sends (duplicates), never skips.
        self.ack(0, self.count)
        os.ftruncate(self._fd, 0)
        os.fsync(self._fd)
        self.size = self.count = 0

    def sync(self) -> None:
        if self._dirty:
            os.fsync(self._fd)
            self._dirty = False

    def close(self) -> None:
        self.sync()
        os.close(self._ack_fd)
        os.close(self._fd)  # releases the flock
