"""Adapter store: atomic publish, immutability, verification on load, retention, concurrency."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from flywheel.adapters import local as store
from flywheel.adapters.local import (
    AdapterExists,
    AdapterNotFound,
    AdapterStore,
    CorruptAdapter,
    FileEntry,
)

WEIGHTS = "adapter_model.safetensors"
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real peft LoRA adapter of a tiny random Llama, plus a fake optimizer state."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=2, vocab_size=64))
    lora = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))
    out = tmp_path_factory.mktemp("adapter")
    lora.save_pretrained(out)
    torch.save({"step": 3}, out / store.TRAINER_STATE)
    return out


def _publish(s: AdapterStore, version: int, source: Path) -> None:
    s.publish("p", version, source, base_model="tiny-llama", steps=version,
              parent_version=version - 1 if version > 1 else None)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_publish_then_load_round_trips_and_checksums_every_file(adapter_dir: Path,
                                                                tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    s = AdapterStore(tmp_path / "store")
    groups = [uuid.uuid4() for _ in range(3)]
    ref = s.publish("p", 1, adapter_dir, base_model="tiny-llama", steps=4,
                    groups_consumed=[str(g) for g in groups], extra={"lr": 1e-4})
    assert (ref.name, ref.path) == ("p@v1", tmp_path / "store" / "p" / "v1")

    loaded, manifest = s.load("p", 1)
    assert loaded == ref
    assert (manifest.steps, manifest.parent_version, manifest.stage) == (4, None, "grpo")
    assert manifest.groups_consumed == groups
    assert manifest.extra == {"lr": 1e-4}
    source_files = sorted(p.name for p in adapter_dir.iterdir())
    assert {store.ADAPTER_CONFIG, WEIGHTS, store.TRAINER_STATE} <= set(source_files)
    assert sorted(manifest.files) == source_files
    for name, entry in manifest.files.items():
        original = adapter_dir / name
        assert entry == FileEntry(sha256=_sha(original), bytes=original.stat().st_size)
        assert (ref.path / name).read_bytes() == original.read_bytes()
    on_disk = json.loads((ref.path / store.MANIFEST).read_text())
    assert on_disk["files"][WEIGHTS]["sha256"] == _sha(adapter_dir / WEIGHTS)
    assert [p.name for p in ref.path.parent.iterdir()] == ["v1"]  # no temp dir left behind

    # The published directory is a usable peft adapter despite the manifest and trainer state.
    base = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=2, vocab_size=64))
    PeftModel.from_pretrained(base, ref.path)

    _publish(s, 2, adapter_dir)
    assert (s.versions("p"), s.versions("other")) == ([1, 2], [])
    assert s.load("p", 2)[1].parent_version == 1


def test_a_killed_publish_leaves_no_version_only_a_temp_dir_gc_removes(adapter_dir: Path,
                                                                       tmp_path: Path) -> None:
    root = tmp_path / "store"
    # A real crash: the publishing process dies halfway through writing its second file.
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from flywheel.adapters import local as store\n"
        "real, calls = store._copy_file, []\n"
        "def dying(src, dst):\n"
        "    calls.append(src)\n"
        "    if len(calls) == 2:\n"
        "        dst.write_bytes(src.read_bytes()[:10])\n"
        "        os._exit(17)\n"
        "    return real(src, dst)\n"
        "store._copy_file = dying\n"
        "store.AdapterStore(Path(sys.argv[1])).publish(\n"
        "    'p', 1, Path(sys.argv[2]), base_model='tiny-llama', steps=1)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(root), str(adapter_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 17, proc.stderr

    s = AdapterStore(root)
    leftovers = [p.name for p in (root / "p").iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".tmp-1-")
    assert s.versions("p") == []
    with pytest.raises(AdapterNotFound, match="p@v1 is not published"):
        s.load("p", 1)

    assert s.gc_temp() == []  # fresh: it could be another process's publish in flight
    assert [p.name for p in s.gc_temp("p", min_age_s=0)] == leftovers
    assert list((root / "p").iterdir()) == []
    _publish(s, 1, adapter_dir)
    assert s.load("p", 1)[0].path == root / "p" / "v1"


def test_a_failed_publish_cleans_up_and_can_be_retried(adapter_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    s = AdapterStore(tmp_path)
    real: Callable[[Path, Path], FileEntry] = store._copy_file
    calls: list[Path] = []

    def failing(src: Path, dst: Path) -> FileEntry:
        calls.append(src)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(store, "_copy_file", failing)
    with pytest.raises(OSError, match="No space left"):
        _publish(s, 1, adapter_dir)
    assert list((tmp_path / "p").iterdir()) == []
    monkeypatch.setattr(store, "_copy_file", real)
    _publish(s, 1, adapter_dir)
    assert s.versions("p") == [1]


def test_a_published_version_is_never_overwritten(adapter_dir: Path, tmp_path: Path) -> None:
    s = AdapterStore(tmp_path)
    _publish(s, 1, adapter_dir)
    before = (tmp_path / "p" / "v1" / store.MANIFEST).read_bytes()
    with pytest.raises(AdapterExists, match="p@v1 is already published"):
        _publish(s, 1, adapter_dir)
    assert (tmp_path / "p" / "v1" / store.MANIFEST).read_bytes() == before
    assert [p.name for p in (tmp_path / "p").iterdir()] == ["v1"]


def test_racing_publishers_of_one_version_exactly_one_wins(adapter_dir: Path,
                                                           tmp_path: Path) -> None:
    s = AdapterStore(tmp_path)
    barrier = threading.Barrier(4)
    outcomes: list[str] = []

    def publish() -> None:
        barrier.wait()
        try:
            _publish(s, 1, adapter_dir)
            outcomes.append("ok")
        except AdapterExists:
            outcomes.append("exists")

    threads = [threading.Thread(target=publish) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["exists", "exists", "exists", "ok"]
    s.load("p", 1)
    assert [p.name for p in (tmp_path / "p").iterdir()] == ["v1"]


def test_concurrent_publishers_of_different_versions_all_succeed(adapter_dir: Path,
                                                                 tmp_path: Path) -> None:
    s = AdapterStore(tmp_path)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def publish(version: int) -> None:
        barrier.wait()
        try:
            _publish(s, version, adapter_dir)
        except BaseException as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=(v,)) for v in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert s.versions("p") == [1, 2]
    assert [s.load("p", v)[1].version for v in (1, 2)] == [1, 2]


def _flip_byte(v: Path) -> None:
    data = bytearray((v / WEIGHTS).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (v / WEIGHTS).write_bytes(bytes(data))


def _truncate(v: Path) -> None:
    with open(v / WEIGHTS, "r+b") as f:
        f.truncate(100)


@pytest.mark.parametrize(("tamper", "problem"), [
    (_flip_byte, f"{WEIGHTS} sha256 mismatch (expected "),
    (_truncate, f"{WEIGHTS} size mismatch (expected "),
    (lambda v: (v / store.TRAINER_STATE).unlink(), f"{store.TRAINER_STATE} is missing"),
    (lambda v: (v / store.MANIFEST).unlink(), f"{store.MANIFEST} is missing"),
    (lambda v: (v / store.MANIFEST).write_text("{not json"), f"{store.MANIFEST} is unreadable"),
    (lambda v: shutil.copy(v / WEIGHTS, v / "adapter_model.bin"),
     "adapter_model.bin is not listed in the manifest"),
], ids=["flipped-byte", "truncated", "missing-file", "no-manifest", "bad-manifest", "extra-file"])
def test_tampered_versions_fail_loudly_naming_the_file(adapter_dir: Path, tmp_path: Path,
                                                       tamper: Callable[[Path], object],
                                                       problem: str) -> None:
    s = AdapterStore(tmp_path)
    _publish(s, 1, adapter_dir)
    _publish(s, 2, adapter_dir)
    tamper(tmp_path / "p" / "v2")
    with pytest.raises(CorruptAdapter) as err:
        s.load("p", 2)
    message = str(err.value)
    assert message.startswith("adapter p@v2 is corrupted: ")
    assert problem in message
    assert "roll back" in message
    s.load("p", 1)  # the other version is unaffected


def test_a_manifest_copied_from_another_version_is_rejected(adapter_dir: Path,
                                                            tmp_path: Path) -> None:
    s = AdapterStore(tmp_path)
    _publish(s, 1, adapter_dir)
    _publish(s, 2, adapter_dir)
    shutil.copy(tmp_path / "p" / "v1" / store.MANIFEST, tmp_path / "p" / "v2" / store.MANIFEST)
    with pytest.raises(CorruptAdapter, match="describes p@v1 instead"):
        s.load("p", 2)


def test_retention_keeps_the_newest_k_and_every_protected_version(adapter_dir: Path,
                                                                 tmp_path: Path) -> None:
    s = AdapterStore(tmp_path)
    for v in range(1, 7):
        _publish(s, v, adapter_dir)
    assert s.retain("p", keep_latest=2, protected={1, 3, 99}) == [2, 4]
    assert s.versions("p") == [1, 3, 5, 6]
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["v1", "v3", "v5", "v6"]
    assert s.retain("p", keep_latest=2, protected={1, 3}) == []
    assert s.retain("p", keep_latest=1, protected=set()) == [1, 3, 5]
    assert s.versions("p") == [6]
    with pytest.raises(ValueError, match="keep_latest must be at least 1"):
        s.retain("p", keep_latest=0, protected=set())


def test_readers_ignore_temp_trash_and_foreign_entries(adapter_dir: Path, tmp_path: Path) -> None:
    s = AdapterStore(tmp_path)
    _publish(s, 1, adapter_dir)
    for name in (".tmp-2-abcd", ".trash-0-abcd", "v03", "notes", "vx"):
        (tmp_path / "p" / name).mkdir()
    (tmp_path / "p" / "v4").write_text("a file, not a version")
    assert s.versions("p") == [1]
    removed = s.gc_temp("p")  # trash goes at once; a fresh temp dir might be in flight
    assert [p.name for p in removed] == [".trash-0-abcd"]


def test_bad_publish_requests_explain_the_fix(adapter_dir: Path, tmp_path: Path) -> None:
    s = AdapterStore(tmp_path / "store")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"has no adapter_config\.json; pass the directory"):
        s.publish("p", 1, empty, base_model="b", steps=0)
    g = uuid.uuid4()
    with pytest.raises(ValueError, match="trained at most once"):
        s.publish("p", 1, adapter_dir, base_model="b", steps=1, groups_consumed=[g, g])
    with pytest.raises(ValueError, match="must be older than version 1"):
        s.publish("p", 1, adapter_dir, base_model="b", steps=1, parent_version=1)
    with pytest.raises(ValueError, match="not a safe directory name"):
        s.publish("../p", 1, adapter_dir, base_model="b", steps=1)
    assert not (tmp_path / "store").exists()  # nothing was written
