"""The S3 adapter store: the local store's guarantees on an S3-compatible bucket.

Layout under `s3://<bucket>/<prefix>/`:

    <policy>/v<N>/manifest.json        the commit marker, written last: a version exists
                                       exactly when its manifest does
    <policy>/v<N>/<sha256>/<path>      every other file, keyed by its content

Keys carry the file's checksum so that a lost race is harmless: two publishers of one version
(or a publish retried after a crash) can only ever write the same bytes to one key, so no
object a committed manifest names is overwritten with other content. The manifest is created
only if absent (`Bucket.put_new`: `If-None-Match: *` where the server honours it, else check
then put). `retain` and `discard` delete the manifest first, so a half-deleted version is
invisible. Objects no manifest names (a crashed or losing publish) are invisible too; the
trainer removes them after each publication (`gc_temp`, once an hour old).

Engines load local files, so every version passes through the cache, a local `AdapterStore`:
`publish` copies the source into a temp directory there (hashing exactly the bytes copied),
uploads that copy and, once committed, renames it into place; `load` downloads into a temp
directory, re-verifies every sha256 against the manifest and renames it into place.
"""

from __future__ import annotations

import logging
import re
import secrets
import shutil
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from flywheel.adapters.artifacts import (
    MANIFEST,
    AdapterNotFound,
    AdapterStoreError,
    Manifest,
    check_name,
    corrupt_error,
    exists_error,
    retain_versions,
    safe_rel,
    verify_dir,
    write_durable,
)
from flywheel.adapters.local import AdapterStore
from flywheel.adapters.s3bucket import Bucket
from flywheel.policy.base import AdapterRef, served_name

if TYPE_CHECKING:
    from flywheel.config import Settings

log = logging.getLogger("flywheel.trainer.s3")
_VERSION_KEY_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)/v(0|[1-9][0-9]*)/(.+)")


class S3AdapterStore:
    """Published adapter versions in `bucket` under `prefix`, verified local copies in
    `cache_dir`; safe for concurrent publishers and readers, like `AdapterStore`."""

    def __init__(self, bucket: Bucket, *, cache_dir: Path, prefix: str = "adapters") -> None:
        self.bucket = bucket
        self.base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self.cache = AdapterStore(cache_dir)
        self.staging_dir = self.cache.root

    @classmethod
    def from_settings(cls, settings: Settings) -> S3AdapterStore:
        a = settings.artifacts
        return cls(Bucket.connect(a), prefix=a.prefix,
                   cache_dir=(a.cache_dir or settings.home / "adapter-cache").resolve())

    def uri(self, policy: str, version: int) -> str:
        return self.bucket.uri(self._prefix(policy, version))

    def versions(self, policy: str) -> list[int]:
        """Versions with a manifest, oldest first (objects of unfinished publishes never count)."""
        check_name(policy, 0)
        found = set()
        for key, _ in self.bucket.objects(f"{self.base}{policy}/"):
            m = _VERSION_KEY_RE.fullmatch(key[len(self.base):])
            if m and m.group(1) == policy and m.group(3) == MANIFEST:
                found.add(int(m.group(2)))
        return sorted(found)

    def publish(self, policy: str, version: int, source_dir: Path, *, base_model: str,
                steps: int, parent_version: int | None = None,
                groups_consumed: Iterable[uuid.UUID | str] = (),
                stage: Literal["sft", "grpo"] = "grpo",
                extra: Mapping[str, Any] | None = None) -> AdapterRef:
        """Upload `source_dir` as `<policy>@v<version>`, the manifest last; raises
        `AdapterExists` if that version exists. The ref's path is the local cached copy."""
        prefix = self._prefix(policy, version)
        if self.bucket.exists(prefix + MANIFEST):
            raise exists_error(policy, version, self.uri(policy, version))
        cached = self.cache.path(policy, version)
        tmp = cached.with_name(f".tmp-{version}-{secrets.token_hex(4)}")
        try:
            staged = AdapterStore(tmp).publish(
                policy, version, source_dir, base_model=base_model, steps=steps,
                parent_version=parent_version, groups_consumed=groups_consumed, stage=stage,
                extra=extra)
            body = (staged.path / MANIFEST).read_bytes()
            for rel, entry in Manifest.model_validate_json(body).files.items():
                self.bucket.upload(staged.path / rel, f"{prefix}{entry.sha256}/{rel}")
            if not self.bucket.put_new(prefix + MANIFEST, body):
                raise exists_error(policy, version, self.uri(policy, version))
            self._install(staged.path, cached, body, policy, version)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return AdapterRef(policy=policy, version=version, path=cached)

    def load(self, policy: str, version: int) -> tuple[AdapterRef, Manifest]:
        """A verified local copy: the cached one if it still matches the bucket's manifest,
        else downloaded; raises `CorruptAdapter` on any mismatch with the manifest."""
        body = self.bucket.get(self._prefix(policy, version) + MANIFEST)
        if body is None:
            raise AdapterNotFound(
                f"adapter {served_name(policy, version)} is not published under "
                f"{self.uri(policy, version)}; published versions: "
                f"{self.versions(policy) or 'none'}")
        cached = self.cache.path(policy, version)
        manifest = self._verified(cached, body, policy, version)
        if manifest is None:
            tmp = cached.with_name(f".tmp-{version}-{secrets.token_hex(4)}")
            try:
                manifest = self._download(tmp, body, policy, version)
                self._install(tmp, cached, body, policy, version)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return AdapterRef(policy=policy, version=version, path=cached), manifest

    def retain(self, policy: str, keep_latest: int, protected: set[int]) -> list[int]:
        """Delete versions older than the newest `keep_latest`, except `protected` ones
        (production, baseline, versions rollouts still use); returns the deleted versions."""
        return retain_versions(self, policy, keep_latest, protected)

    def discard(self, policy: str, version: int) -> bool:
        """Delete one version (manifest first) and its cached copy; False if it had no
        manifest."""
        prefix = self._prefix(policy, version)
        existed = self.bucket.exists(prefix + MANIFEST)
        self.bucket.delete([prefix + MANIFEST])
        self.bucket.delete([key for key, _ in self.bucket.objects(prefix)])
        self.cache.discard(policy, version)
        return existed

    def gc_temp(self, policy: str | None = None, *, min_age_s: float = 3600.0) -> list[str]:
        """Remove objects no manifest names (crashed or losing publishes) older than
        `min_age_s`, so an in-flight publish is spared, and the cache's leftovers; returns
        what was removed. Pass `min_age_s=0` only when no other process can be publishing."""
        if policy is not None:
            check_name(policy, 0)
        cutoff = datetime.now(UTC) - timedelta(seconds=min_age_s)
        by_version: dict[str, list[tuple[str, datetime]]] = {}
        for key, modified in self.bucket.objects(self.base + (f"{policy}/" if policy else "")):
            m = _VERSION_KEY_RE.fullmatch(key[len(self.base):])
            if m:  # anything else in the bucket is not ours to delete
                prefix = f"{self.base}{m.group(1)}/v{m.group(2)}/"
                by_version.setdefault(prefix, []).append((key, modified))
        doomed = []
        for prefix, objects in by_version.items():
            named = {prefix + MANIFEST}
            body = self.bucket.get(prefix + MANIFEST)
            if body is not None:
                try:
                    files = Manifest.model_validate_json(body).files
                except ValueError:
                    continue  # a damaged version: `load` reports it, a person decides
                named |= {f"{prefix}{e.sha256}/{rel}" for rel, e in files.items()}
            doomed += [key for key, modified in objects
                       if key not in named and modified <= cutoff]
        self.bucket.delete(doomed)
        return ([self.bucket.uri(key) for key in doomed]
                + [str(p) for p in self.cache.gc_temp(policy, min_age_s=min_age_s)])

    def _prefix(self, policy: str, version: int) -> str:
        check_name(policy, version)
        return f"{self.base}{policy}/v{version}/"

    def _verified(self, path: Path, body: bytes, policy: str,
                  version: int) -> Manifest | None:
        """The manifest, if `path` holds exactly the version `body` describes."""
        try:
            if (path / MANIFEST).read_bytes() != body:
                return None
        except FileNotFoundError:
            return None
        manifest, problems = verify_dir(path, policy, version)
        if problems:
            log.warning("cached copy %s is damaged (%s); downloading it again", path,
                        "; ".join(problems))
            return None
        return manifest

    def _download(self, tmp: Path, body: bytes, policy: str, version: int) -> Manifest:
        tmp.mkdir(parents=True)
        write_durable(tmp / MANIFEST, body)
        try:
            files = Manifest.model_validate_json(body).files
        except ValueError:
            files = {}  # verify_dir names the problem
        prefix = self._prefix(policy, version)
        for rel, entry in files.items():
            if safe_rel(rel):  # an unsafe one is never written outside `tmp`; verify_dir names it
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                self.bucket.download(f"{prefix}{entry.sha256}/{rel}", tmp / rel)
        manifest, problems = verify_dir(tmp, policy, version)
        if problems or manifest is None:
            if self.bucket.get(prefix + MANIFEST) is None:
                raise AdapterNotFound(
                    f"adapter {served_name(policy, version)} was deleted (retention) while "
                    "loading; pin versions still in use via `retain(protected=...)`")
            raise corrupt_error(policy, version, problems)
        return manifest

    def _install(self, tmp: Path, final: Path, body: bytes, policy: str, version: int) -> None:
        """Rename the verified copy into the cache, replacing a stale or damaged copy but
        keeping a good one a concurrent loader put there first (it may be in use)."""
        for _ in range(3):
            try:
                tmp.rename(final)
                return
            except OSError:
                if not final.exists():
                    raise
            if self._verified(final, body, policy, version) is not None:
                return
            self.cache.discard(policy, version)
        raise AdapterStoreError(f"could not install {final}: it keeps being replaced")
