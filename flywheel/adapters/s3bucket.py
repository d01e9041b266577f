"""One S3-compatible bucket, reduced to the operations the S3 adapter store relies on.

The one operation S3 servers differ on is "create this key unless it exists" (`put_new`):
AWS S3, MinIO, R2 and recent Ceph honour `If-None-Match: *` on a put, atomically; others
ignore or refuse the header, and then it can only be checked, then put (`conditional_put`
in the settings; `auto` tests the server once). Needs boto3, imported only when used.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from flywheel.adapters.artifacts import AdapterStoreError

if TYPE_CHECKING:
    from flywheel.config import ArtifactSettings

log = logging.getLogger("flywheel.trainer.s3")


class Bucket:
    def __init__(self, client: Any, name: str,
                 conditional_put: Literal["auto", "always", "never"] = "auto", *,
                 probe_prefix: str = "") -> None:
        self.client, self.name = client, name
        self.probe_prefix = f"{probe_prefix.strip('/')}/" if probe_prefix.strip("/") else ""
        """Where `supports_conditional_put` may write its probe (the key prefix we own)."""
        self._conditional: bool | None = {"auto": None, "always": True,
                                          "never": False}[conditional_put]

    @classmethod
    def connect(cls, a: ArtifactSettings) -> Bucket:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise ImportError("the s3 artifact backend needs boto3: pip install "
                              "'flywheel[s3]' (or set artifacts.backend to 'local')") from exc
        if a.bucket is None:
            raise ValueError("artifacts.bucket is unset; set FLYWHEEL_ARTIFACTS__BUCKET")
        secret = a.secret_access_key.get_secret_value() if a.secret_access_key else None
        client = boto3.client(
            "s3", endpoint_url=a.endpoint_url, region_name=a.region,
            aws_access_key_id=a.access_key_id, aws_secret_access_key=secret,
            # Checksums only where S3 requires them: many S3-compatible servers reject the
            # newer default ones, and the store verifies every sha256 end to end anyway.
            config=Config(s3={"addressing_style": a.addressing_style},
                          retries={"mode": "standard", "max_attempts": 5},
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"))
        return cls(client, a.bucket, a.conditional_put, probe_prefix=a.prefix)

    def uri(self, key: str) -> str:
        return f"s3://{self.name}/{key}"

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.name, Key=key)
        except Exception as exc:
            if _status(exc) == 404:
                return False
            raise
        return True

    def get(self, key: str) -> bytes | None:
        """The object's bytes; None if there is no such key."""
        try:
            body: bytes = self.client.get_object(Bucket=self.name, Key=key)["Body"].read()
        except Exception as exc:
            if _status(exc) == 404:
                return None
            raise
        return body

    def put_new(self, key: str, body: bytes) -> bool:
        """Create `key` unless it exists; False if it does (atomically where supported)."""
        if not self.supports_conditional_put():
            if self.exists(key):
                return False
            self.client.put_object(Bucket=self.name, Key=key, Body=body)
            return True
        for attempt in range(5):
            try:
                self.client.put_object(Bucket=self.name, Key=key, Body=body, IfNoneMatch="*")
                return True
            except Exception as exc:
                status = _status(exc)
                if status == 412:
                    return False
                # 409: AWS is still deciding a concurrent conditional put of this key.
                if status != 409 or attempt == 4:
                    raise
                time.sleep(0.2 * 2**attempt)
        raise AssertionError("unreachable")

    def supports_conditional_put(self) -> bool:
        """Whether the server refuses a second `If-None-Match: *` put (tested once)."""
        if self._conditional is None:
            key = f"{self.probe_prefix}.conditional-put-probe-{secrets.token_hex(8)}"
            try:
                self.client.put_object(Bucket=self.name, Key=key, Body=b"", IfNoneMatch="*")
                try:
                    self.client.put_object(Bucket=self.name, Key=key, Body=b"",
                                           IfNoneMatch="*")
                    self._conditional = False  # the header was ignored
                except Exception as exc:
                    if _status(exc) != 412:
                        raise
                    self._conditional = True
            except Exception as exc:
                if _status(exc) not in (400, 501):
                    raise
                self._conditional = False  # the header was refused
            finally:
                self.client.delete_object(Bucket=self.name, Key=key)
            if not self._conditional:
                log.warning("s3://%s does not support conditional puts (If-None-Match: *); "
                            "publishing checks, then puts: run one publisher per policy",
                            self.name)
        return self._conditional

    def upload(self, path: Path, key: str) -> None:
        self.client.upload_file(str(path), self.name, key)

    def download(self, key: str, path: Path) -> bool:
        """Download `key` to `path`; False if there is no such key."""
        try:
            self.client.download_file(self.name, key, str(path))
        except Exception as exc:
            if _status(exc) == 404:
                return False
            raise
        return True

    def objects(self, prefix: str) -> Iterator[tuple[str, datetime]]:
        """Key and last-modified time of every object under `prefix`."""
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name,
                                                                           Prefix=prefix):
            for obj in page.get("Contents", []):
                yield obj["Key"], obj["LastModified"]

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": key} for key in keys[i:i + 1000]]
            errors = self.client.delete_objects(
                Bucket=self.name, Delete={"Objects": batch, "Quiet": True}).get("Errors", [])
            if errors:
                raise AdapterStoreError(f"s3://{self.name}: could not delete {len(errors)} "
                                        f"object(s), e.g. {errors[0]}")


def _status(exc: BaseException) -> int | None:
    """The HTTP status of a botocore `ClientError`; None for any other error."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None
