"""The local adapter store: immutable, checksummed, atomically published LoRA versions on disk.

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
The manifest, the errors and the interface shared with the S3 store live in `artifacts`.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from flywheel.adapters.artifacts import (
    ADAPTER_CONFIG,
    MANIFEST,
    TRAINER_STATE,
    WEIGHT_FILES,
    AdapterExists,
    AdapterNotFound,
    AdapterStoreError,
    ArtifactStore,
    CorruptAdapter,
    FileEntry,
    Manifest,
    check_name,
    corrupt_error,
    exists_error,
    fsync_dir,
    new_manifest,
    retain_versions,
    source_files,
    verify_dir,
    write_durable,
)
from flywheel.adapters.artifacts import copy_file as _copy_file
from flywheel.policy.base import AdapterRef, served_name

__all__ = ["ADAPTER_CONFIG", "MANIFEST", "TRAINER_STATE", "WEIGHT_FILES", "AdapterExists",
           "AdapterNotFound", "AdapterStore", "AdapterStoreError", "ArtifactStore",
           "CorruptAdapter", "FileEntry", "Manifest"]

_VERSION_DIR_RE = re.compile(r"v(0|[1-9][0-9]*)")


class AdapterStore:
    """Published adapter versions under `root`; safe for concurrent publishers and readers."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()
        self.staging_dir = self.root

    def path(self, policy: str, version: int) -> Path:
        check_name(policy, version)
        return self.root / policy / f"v{version}"

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

    def publish(self, policy: str, version: int, source_dir: Path, *, base_model: str,
                steps: int, parent_version: int | None = None,
                groups_consumed: Iterable[uuid.UUID | str] = (),
                stage: Literal["sft", "grpo"] = "grpo",
                extra: Mapping[str, Any] | None = None) -> AdapterRef:
        """Copy `source_dir` (peft `save_pretrained` output plus e.g. `trainer_state.pt`) in as
        `<policy>@v<version>`, atomically; raises `AdapterExists` if that version exists."""
        final = self.path(policy, version)
        manifest = new_manifest(policy, version, base_model=base_model, steps=steps,
                                parent_version=parent_version, groups_consumed=groups_consumed,
                                stage=stage, extra=extra)
        source = Path(source_dir)
        rel_files = source_files(source)
        if final.exists():
            raise exists_error(policy, version, final)
        policy_dir = final.parent
        if not policy_dir.is_dir():
            policy_dir.mkdir(parents=True, exist_ok=True)
            fsync_dir(policy_dir.parent)
        tmp = policy_dir / f".tmp-{version}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            files: dict[str, FileEntry] = {}
            for rel in rel_files:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                files[rel] = _copy_file(source / rel, tmp / rel)
            for dirpath, _dirs, _names in os.walk(tmp, topdown=False):
                fsync_dir(Path(dirpath))
            manifest = manifest.model_copy(update={"files": files})
            write_durable(tmp / MANIFEST, manifest.model_dump_json(indent=2).encode())
            fsync_dir(tmp)
            try:
                os.rename(tmp, final)
            except OSError as exc:
                if final.exists():  # another publisher won the race for this version
                    raise exists_error(policy, version, final) from exc
                raise
            fsync_dir(policy_dir)
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
        manifest, problems = verify_dir(path, policy, version)
        if problems or manifest is None:
            if not path.exists():
                raise AdapterNotFound(f"adapter {name} was deleted (retention) while loading; "
                                      f"pin versions still in use via `retain(protected=...)`")
            raise corrupt_error(policy, version, problems)
        return AdapterRef(policy=policy, version=version, path=path), manifest

    def retain(self, policy: str, keep_latest: int, protected: set[int]) -> list[int]:
        """Delete versions older than the newest `keep_latest`, except `protected` ones
        (production, baseline, versions rollouts still use); returns the deleted versions."""
        return retain_versions(self, policy, keep_latest, protected)

    def discard(self, policy: str, version: int) -> bool:
        """Delete one version whatever retention says; False if it was not there (e.g. a
        concurrent `retain` removed it first)."""
        path = self.path(policy, version)
        trash = path.with_name(f".trash-{version}-{secrets.token_hex(4)}")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return False
        fsync_dir(path.parent)
        # Already invisible to readers; anything rmtree leaves behind, gc_temp removes.
        shutil.rmtree(trash, ignore_errors=True)
        return True

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
        return self.path(policy, 0).parent
