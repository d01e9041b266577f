"""What an adapter version is, wherever it is stored: the stores' shared vocabulary — the
manifest, the store's errors, the `ArtifactStore` interface both backends implement, and
checking a directory against its manifest. The backends, which import this module and are
never imported by it: `local.AdapterStore` (a local directory, the default) and
`s3.S3AdapterStore` (an S3-compatible bucket, over `s3bucket.Bucket`);
`factory.artifact_store(settings)` builds the configured one. Handles files only: no torch,
no boto3.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, Literal, Protocol, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flywheel.errors import PermanentError
from flywheel.policy.base import AdapterRef, served_name

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
"""The trainer's optimizer/scheduler state, published next to the adapter like any file."""
ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_CHUNK = 1 << 20
_POLICY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_FIX = "it cannot be loaded — publish a new version from the trainer or roll back to an earlier one"


class AdapterStoreError(RuntimeError):
    """Base of the store's errors."""


class AdapterExists(AdapterStoreError):
    """The version is already published; versions are immutable."""


class AdapterNotFound(AdapterStoreError, PermanentError):
    """No such published version."""


class CorruptAdapter(AdapterStoreError, PermanentError):
    """A published version fails verification against its manifest."""


class FileEntry(BaseModel):
    model_config = ConfigDict(frozen=True)

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)


class Manifest(BaseModel):
    """What a version is and how it was made; written last, so its presence means complete."""

    model_config = ConfigDict(frozen=True)

    schema_version: Literal[1] = 1
    policy: str
    version: int = Field(ge=0)
    base_model: str
    """Id or path of the base model the adapter applies to."""
    parent_version: int | None = Field(default=None, ge=0)
    """The version training resumed from; None when trained from the base model."""
    steps: int = Field(ge=0)
    """Optimizer steps since the base model (cumulative over the parent chain)."""
    groups_consumed: list[uuid.UUID] = Field(default_factory=list)
    """Every GRPO group trained on between `parent_version` and this version (not cumulative),
    so a resume can prove no group was trained twice."""
    created_at: datetime
    files: dict[str, FileEntry]
    """Relative POSIX path → checksum and size, for every file except the manifest."""
    stage: Literal["sft", "grpo"] = "grpo"
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.parent_version is not None and self.parent_version >= self.version:
            raise ValueError(f"parent_version {self.parent_version} must be older than "
                             f"version {self.version}")
        twice = sorted(str(g) for g, n in Counter(self.groups_consumed).items() if n > 1)
        if twice:
            raise ValueError(f"groups_consumed lists group(s) {', '.join(twice)} more than once; "
                             "a group is trained at most once")
        return self


class ArtifactStore(Protocol):
    """Published adapter versions: immutable, checksummed, visible only once complete."""

    staging_dir: Path
    """A local directory to write a version into before `publish` (same filesystem as the
    store's files when they are local)."""

    def versions(self, policy: str) -> list[int]:
        """Published versions, oldest first."""
        ...

    def publish(self, policy: str, version: int, source_dir: Path, *, base_model: str,
                steps: int, parent_version: int | None = None,
                groups_consumed: Iterable[uuid.UUID | str] = (),
                stage: Literal["sft", "grpo"] = "grpo",
                extra: Mapping[str, Any] | None = None) -> AdapterRef:
        """Publish `source_dir` as `<policy>@v<version>`, all or nothing; raises
        `AdapterExists` if that version exists. The ref's path is a local copy."""
        ...

    def load(self, policy: str, version: int) -> tuple[AdapterRef, Manifest]:
        """A verified local copy of the version; raises `CorruptAdapter` on any mismatch."""
        ...

    def retain(self, policy: str, keep_latest: int, protected: set[int]) -> list[int]:
        """Delete versions older than the newest `keep_latest`, except `protected` ones;
        returns the deleted versions."""
        ...

    def discard(self, policy: str, version: int) -> bool:
        """Delete one version whatever retention says (e.g. published but never registered);
        False when it was not there."""
        ...

    def gc_temp(self, policy: str | None = None, *,
                min_age_s: float = 3600.0) -> Sequence[object]:
        """Remove what crashed or losing publishes left (older than `min_age_s`, so an
        in-flight publish is spared); returns what was removed."""
        ...


def retain_versions(store: ArtifactStore, policy: str, keep_latest: int,
                    protected: set[int]) -> list[int]:
    """Discard versions older than the newest `keep_latest`, except `protected` ones; the
    retention rule every store shares. Returns the discarded versions."""
    if keep_latest < 1:
        raise ValueError(f"keep_latest must be at least 1 (got {keep_latest}): the newest "
                         "version is the trainer's resume point")
    published = store.versions(policy)
    keep = set(published[-keep_latest:]) | set(protected)
    return [v for v in published if v not in keep and store.discard(policy, v)]


def new_manifest(policy: str, version: int, *, base_model: str, steps: int,
                 parent_version: int | None, groups_consumed: Iterable[uuid.UUID | str],
                 stage: Literal["sft", "grpo"], extra: Mapping[str, Any] | None) -> Manifest:
    """The manifest of a version about to be published (files filled in once copied)."""
    return Manifest.model_validate({
        "policy": policy, "version": version, "base_model": base_model, "steps": steps,
        "parent_version": parent_version, "groups_consumed": list(groups_consumed),
        "created_at": datetime.now(UTC), "files": {}, "stage": stage,
        "extra": dict(extra or {})})


def check_name(policy: str, version: int) -> None:
    """Refuse names that could escape the store's directory or key prefix."""
    if not _POLICY_RE.fullmatch(policy):
        raise ValueError(f"policy name {policy!r} is not a safe directory name; use letters, "
                         "digits, '.', '_' and '-', starting with a letter or digit")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"adapter version must be a non-negative int, got {version!r}")


def exists_error(policy: str, version: int, where: object) -> AdapterExists:
    return AdapterExists(f"adapter {served_name(policy, version)} is already published at "
                         f"{where}; versions are immutable — publish under a new version")


def corrupt_error(policy: str, version: int, problems: list[str]) -> CorruptAdapter:
    return CorruptAdapter(f"adapter {served_name(policy, version)} is corrupted: "
                          f"{'; '.join(problems)}; {_FIX}")


def source_files(source: Path) -> list[str]:
    """Relative POSIX paths of every file under `source`, validated as a peft adapter dir."""
    hint = "pass the directory written by peft's save_pretrained"
    if not source.is_dir():
        raise ValueError(f"adapter source {source} is not a directory; {hint}")
    rel_files = sorted(tree_files(source))
    if ADAPTER_CONFIG not in rel_files:
        raise ValueError(f"adapter source {source} has no {ADAPTER_CONFIG}; {hint}")
    if not any(w in rel_files for w in WEIGHT_FILES):
        raise ValueError(f"adapter source {source} has no weights ({' or '.join(WEIGHT_FILES)}); "
                         f"{hint}")
    if MANIFEST in rel_files:
        raise ValueError(f"adapter source {source} contains {MANIFEST}, a name the store "
                         "reserves; remove or rename it")
    return rel_files


def tree_files(root: Path) -> list[str]:
    found = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            found.append((Path(dirpath) / name).relative_to(root).as_posix())
    return found


def copy_file(src: Path, dst: Path) -> FileEntry:
    """Copy, fsync and checksum one file (hashing exactly the bytes written)."""
    digest = hashlib.sha256()
    size = 0
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        while chunk := fin.read(_CHUNK):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return FileEntry(sha256=digest.hexdigest(), bytes=size)


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def safe_rel(rel: str) -> bool:
    p = PurePosixPath(rel)
    return (not p.is_absolute() and ".." not in p.parts and p.as_posix() == rel
            and rel != MANIFEST)


def verify_dir(path: Path, policy: str, version: int) -> tuple[Manifest | None, list[str]]:
    """The manifest and every problem found comparing the directory against it."""
    try:
        manifest = Manifest.model_validate_json((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        return None, [f"{MANIFEST} is missing"]
    except ValidationError as exc:
        why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'document'}: {e['msg']}"
                        for e in exc.errors()[:3])
        return None, [f"{MANIFEST} is unreadable ({why})"]
    except OSError as exc:
        return None, [f"{MANIFEST} is unreadable ({exc})"]
    problems = []
    if (manifest.policy, manifest.version) != (policy, version):
        problems.append(f"{MANIFEST} describes "
                        f"{served_name(manifest.policy, manifest.version)} instead")
    on_disk = set(tree_files(path)) - {MANIFEST}
    for rel, entry in sorted(manifest.files.items()):
        if not safe_rel(rel):
            problems.append(f"{MANIFEST} lists an unsafe path {rel!r}")
        elif rel not in on_disk:
            problems.append(f"{rel} is missing")
        else:
            try:
                size = (path / rel).stat().st_size
                found = sha256_file(path / rel) if size == entry.bytes else ""
            except OSError as exc:
                problems.append(f"{rel} is unreadable ({exc.strerror or exc})")
                continue
            if size != entry.bytes:
                problems.append(f"{rel} size mismatch (expected {entry.bytes} bytes, found {size})")
            elif found != entry.sha256:
                problems.append(f"{rel} sha256 mismatch (expected {entry.sha256}, found {found})")
    for rel in sorted(on_disk - manifest.files.keys()):
        problems.append(f"{rel} is not listed in the manifest (unexpected file)")
    return manifest, problems
