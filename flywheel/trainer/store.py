"""Adapter artifact store: immutable, checksummed, atomically published LoRA versions on disk.

Layout under `root` (a local or shared filesystem):

    <policy>/v<N>/               a published version: the peft `save_pretrained` files, any
                                 extra files (`trainer_state.pt`: the optimizer state) and
                                 `manifest.json` (sha256 and size of every other file)
    <policy>/.tmp-<N>-<hex>/     a publish in progress, or left by a crash; readers ignore it
    <policy>/.trash-<N>-<hex>/   a version being deleted by retention; readers ignore it

A version directory appears only complete: every file is written and fsynced in a temp
directory, the manifest last, then the directory is renamed into place in one step. A
published version is never overwritten. `load` re-verifies every checksum, so a torn or
tampered copy fails loudly instead of serving wrong weights. Handles files only: no torch.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flywheel.policy.base import AdapterRef, served_name

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
"""The trainer's optimizer/scheduler state, published next to the adapter like any file."""
ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_CHUNK = 1 << 20
_POLICY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_VERSION_DIR_RE = re.compile(r"v(0|[1-9][0-9]*)")
_FIX = "it cannot be loaded — publish a new version from the trainer or roll back to an earlier one"


class AdapterStoreError(RuntimeError):
    """Base of the store's errors."""


class AdapterExists(AdapterStoreError):
    """The version is already published; versions are immutable."""


class AdapterNotFound(AdapterStoreError):
    """No such published version."""


class CorruptAdapter(AdapterStoreError):
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


class AdapterStore:
    """Published adapter versions under `root`; safe for concurrent publishers and readers."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()

    def path(self, policy: str, version: int) -> Path:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"adapter version must be a non-negative int, got {version!r}")
        return self._policy_dir(policy) / f"v{version}"

    def versions(self, policy: str) -> list[int]:
        """Published versions, oldest first (temp and trash directories never count)."""
        policy_dir = self._policy_dir(policy)
        if not policy_dir.is_dir():
            return []
        found = []
        with os.scandir(policy_dir) as entries:
            for entry in entries:
                m = _VERSION_DIR_RE.fullmatch(entry.name)
                if m and entry.is_dir(follow_symlinks=False):
                    found.append(int(m.group(1)))
        return sorted(found)

    def latest(self, policy: str) -> int | None:
        published = self.versions(policy)
        return published[-1] if published else None

    def publish(self, policy: str, version: int, source_dir: Path, *, base_model: str,
                steps: int, parent_version: int | None = None,
                groups_consumed: Iterable[uuid.UUID | str] = (),
                stage: Literal["sft", "grpo"] = "grpo",
                extra: Mapping[str, Any] | None = None) -> AdapterRef:
        """Copy `source_dir` (peft `save_pretrained` output plus e.g. `trainer_state.pt`) in as
        `<policy>@v<version>`, atomically; raises `AdapterExists` if that version exists."""
        final = self.path(policy, version)
        manifest = Manifest.model_validate({
            "policy": policy, "version": version, "base_model": base_model, "steps": steps,
            "parent_version": parent_version, "groups_consumed": list(groups_consumed),
            "created_at": datetime.now(UTC), "files": {}, "stage": stage,
            "extra": dict(extra or {})})
        source = Path(source_dir)
        rel_files = _source_files(source)
        if final.exists():
            raise _exists(policy, version, final)
        policy_dir = final.parent
        if not policy_dir.is_dir():
            policy_dir.mkdir(parents=True, exist_ok=True)
            _fsync_dir(policy_dir.parent)
        tmp = policy_dir / f".tmp-{version}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            files: dict[str, FileEntry] = {}
            for rel in rel_files:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                files[rel] = _copy_file(source / rel, tmp / rel)
            for dirpath, _dirs, _names in os.walk(tmp, topdown=False):
                _fsync_dir(Path(dirpath))
            manifest = manifest.model_copy(update={"files": files})
            _write_durable(tmp / MANIFEST, manifest.model_dump_json(indent=2).encode())
            _fsync_dir(tmp)
            try:
                os.rename(tmp, final)
            except OSError as exc:
                if final.exists():  # another publisher won the race for this version
                    raise _exists(policy, version, final) from exc
                raise
            _fsync_dir(policy_dir)
        except Exception:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return AdapterRef(policy=policy, version=version, path=final)

    def load(self, policy: str, version: int) -> tuple[AdapterRef, Manifest]:
        """The verified version: raises `CorruptAdapter` on any mismatch with its manifest."""
        path = self.path(policy, version)
        name = served_name(policy, version)
        if not path.is_dir():
            raise AdapterNotFound(
                f"adapter {name} is not published under {path.parent}; published versions: "
                f"{self.versions(policy) or 'none'}")
        manifest, problems = _verify(path, policy, version)
        if problems or manifest is None:
            if not path.exists():
                raise AdapterNotFound(f"adapter {name} was deleted (retention) while loading; "
                                      f"pin versions still in use via `retain(protected=...)`")
            raise CorruptAdapter(f"adapter {name} is corrupted: {'; '.join(problems)}; {_FIX}")
        return AdapterRef(policy=policy, version=version, path=path), manifest

    def retain(self, policy: str, keep_latest: int, protected: set[int]) -> list[int]:
        """Delete versions older than the newest `keep_latest`, except `protected` ones
        (production, baseline, versions rollouts still use); returns the deleted versions."""
        if keep_latest < 1:
            raise ValueError(f"keep_latest must be at least 1 (got {keep_latest}): the newest "
                             "version is the trainer's resume point")
        published = self.versions(policy)
        keep = set(published[-keep_latest:]) | set(protected)
        policy_dir = self._policy_dir(policy)
        deleted = []
        for version in published:
            if version in keep:
                continue
            trash = policy_dir / f".trash-{version}-{secrets.token_hex(4)}"
            try:
                os.rename(self.path(policy, version), trash)
            except FileNotFoundError:
                continue  # a concurrent retain removed it first
            _fsync_dir(policy_dir)
            # Already invisible to readers; anything rmtree leaves behind, gc_temp removes.
            shutil.rmtree(trash, ignore_errors=True)
            deleted.append(version)
        return deleted

    def gc_temp(self, policy: str | None = None, *, min_age_s: float = 3600.0) -> list[Path]:
        """Remove leftovers of crashed publishes (temp dirs older than `min_age_s`, so an
        in-flight publish is spared) and of interrupted deletions; returns what was removed.
        Pass `min_age_s=0` only when no other process can be publishing."""
        if policy is not None:
            policy_dirs = [self._policy_dir(policy)]
        else:
            policy_dirs = list(self.root.iterdir()) if self.root.is_dir() else []
        now = time.time()
        removed = []
        for policy_dir in filter(Path.is_dir, policy_dirs):
            for entry in policy_dir.iterdir():
                try:
                    age = now - entry.stat().st_mtime
                except FileNotFoundError:
                    continue  # just renamed into place by its publisher, or already removed
                if ((entry.name.startswith(".tmp-") and age >= min_age_s)
                        or entry.name.startswith(".trash-")):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
        return removed

    def _policy_dir(self, policy: str) -> Path:
        if not _POLICY_RE.fullmatch(policy):
            raise ValueError(f"policy name {policy!r} is not a safe directory name; use letters, "
                             "digits, '.', '_' and '-', starting with a letter or digit")
        return self.root / policy


def _exists(policy: str, version: int, path: Path) -> AdapterExists:
    return AdapterExists(f"adapter {served_name(policy, version)} is already published at "
                         f"{path}; versions are immutable — publish under a new version")


def _source_files(source: Path) -> list[str]:
    """Relative POSIX paths of every file under `source`, validated as a peft adapter dir."""
    hint = "pass the directory written by peft's save_pretrained"
    if not source.is_dir():
        raise ValueError(f"adapter source {source} is not a directory; {hint}")
    rel_files = sorted(_tree_files(source))
    if ADAPTER_CONFIG not in rel_files:
        raise ValueError(f"adapter source {source} has no {ADAPTER_CONFIG}; {hint}")
    if not any(w in rel_files for w in WEIGHT_FILES):
        raise ValueError(f"adapter source {source} has no weights ({' or '.join(WEIGHT_FILES)}); "
                         f"{hint}")
    if MANIFEST in rel_files:
        raise ValueError(f"adapter source {source} contains {MANIFEST}, a name the store "
                         "reserves; remove or rename it")
    return rel_files


def _tree_files(root: Path) -> list[str]:
    found = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            found.append((Path(dirpath) / name).relative_to(root).as_posix())
    return found


def _copy_file(src: Path, dst: Path) -> FileEntry:
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


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _safe_rel(rel: str) -> bool:
    p = PurePosixPath(rel)
    return (not p.is_absolute() and ".." not in p.parts and p.as_posix() == rel
            and rel != MANIFEST)


def _verify(path: Path, policy: str, version: int) -> tuple[Manifest | None, list[str]]:
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
    on_disk = set(_tree_files(path)) - {MANIFEST}
    for rel, entry in sorted(manifest.files.items()):
        if not _safe_rel(rel):
            problems.append(f"{MANIFEST} lists an unsafe path {rel!r}")
        elif rel not in on_disk:
            problems.append(f"{rel} is missing")
        else:
            try:
                size = (path / rel).stat().st_size
                found = _sha256(path / rel) if size == entry.bytes else ""
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
