"""S3 adapter store against a real S3 protocol server (moto's, in a child process): publish and
load round trip, verification, crash leftovers, immutability, retention, configuration."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from pydantic import SecretStr, ValidationError

from flywheel.adapters.artifacts import (
    MANIFEST,
    TRAINER_STATE,
    AdapterExists,
    AdapterNotFound,
    CorruptAdapter,
)
from flywheel.adapters.factory import artifact_store
from flywheel.adapters.local import AdapterStore
from flywheel.adapters.s3 import S3AdapterStore
from flywheel.config import ArtifactSettings, Settings, settings_env
from flywheel.stack.broker import free_port

pytestmark = pytest.mark.s3
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                 "-p", str(port)], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def settings(s3_endpoint: str, tmp_path: Path) -> Settings:
    """Settings for the s3 backend on a fresh bucket of the test server."""
    artifacts = ArtifactSettings(
        backend="s3", bucket=f"adapters-{uuid.uuid4().hex[:12]}", endpoint_url=s3_endpoint,
        region="us-east-1", access_key_id="testing", secret_access_key=SecretStr("testing"),
        addressing_style="path", cache_dir=tmp_path / "cache")
    s = Settings(home=tmp_path / "home", artifacts=artifacts)
    _client(s).create_bucket(Bucket=artifacts.bucket)
    return s


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Path:
    """Files as the trainer publishes them (the store handles files only, so no torch)."""
    out = tmp_path / "source"
    (out / "sub").mkdir(parents=True)
    (out / "adapter_config.json").write_text('{"r": 2, "peft_type": "LORA"}')
    (out / WEIGHTS).write_bytes(os.urandom(100_000))
    (out / TRAINER_STATE).write_bytes(os.urandom(5_000))
    (out / "sub" / "notes.txt").write_text("nested files keep their relative path")
    return out


def _client(settings: Settings) -> Any:
    a = settings.artifacts
    return boto3.client("s3", endpoint_url=a.endpoint_url, region_name=a.region,
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def _keys(settings: Settings, prefix: str = "") -> list[str]:
    response = _client(settings).list_objects_v2(Bucket=settings.artifacts.bucket,
                                                 Prefix=prefix)
    return sorted(obj["Key"] for obj in response.get("Contents", []))


def _store(settings: Settings, cache_dir: Path | None = None, **changes: Any) -> S3AdapterStore:
    """Another store on the same bucket: another process, or another machine's cache."""
    if cache_dir is not None:
        changes["cache_dir"] = cache_dir
    artifacts = settings.artifacts.model_copy(update=changes)
    return S3AdapterStore.from_settings(settings.model_copy(update={"artifacts": artifacts}))


def _publish(s: S3AdapterStore, version: int, source: Path) -> None:
    s.publish("p", version, source, base_model="tiny-llama", steps=version,
              parent_version=version - 1 if version > 1 else None)


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in root.rglob("*") if p.is_file()}


def test_publish_then_load_elsewhere_round_trips_every_file(settings: Settings, tmp_path: Path,
                                                            adapter_dir: Path) -> None:
    (adapter_dir / WEIGHTS).write_bytes(os.urandom(9 << 20))  # over the multipart threshold
    s = artifact_store(settings)
    assert isinstance(s, S3AdapterStore)
    groups = [uuid.uuid4() for _ in range(2)]
    ref = s.publish("p", 1, adapter_dir, base_model="tiny-llama", steps=4,
                    groups_consumed=groups, extra={"lr": 1e-4})
    assert (ref.name, ref.path) == ("p@v1", tmp_path / "cache" / "p" / "v1")
    source = _files(adapter_dir)
    assert {k: v for k, v in _files(ref.path).items() if k != MANIFEST} == source
    assert sorted(p.name for p in ref.path.parent.iterdir()) == ["v1"]  # no temp dir left
    shas = {rel: hashlib.sha256(data).hexdigest() for rel, data in source.items()}
    assert _keys(settings) == sorted(["adapters/p/v1/manifest.json",
                                      *(f"adapters/p/v1/{shas[rel]}/{rel}" for rel in source)])

    elsewhere = _store(settings, tmp_path / "other-cache")
    loaded, manifest = elsewhere.load("p", 1)
    assert loaded.path == tmp_path / "other-cache" / "p" / "v1"
    assert _files(loaded.path) == _files(ref.path)
    assert {rel: e.sha256 for rel, e in manifest.files.items()} == shas
    assert (manifest.steps, manifest.groups_consumed, manifest.extra) == (4, groups, {"lr": 1e-4})

    _publish(s, 2, adapter_dir)
    assert (elsewhere.versions("p"), elsewhere.versions("q")) == ([1, 2], [])
    assert elsewhere.load("p", 2)[1].parent_version == 1
    with pytest.raises(AdapterNotFound, match=r"p@v3 is not published .* versions: \[1, 2\]"):
        elsewhere.load("p", 3)


def _put(settings: Settings, key: str, data: bytes) -> None:
    _client(settings).put_object(Bucket=settings.artifacts.bucket, Key=key, Body=data)


def _weights_key(settings: Settings) -> str:
    return next(k for k in _keys(settings, "adapters/p/v2/") if k.endswith(WEIGHTS))


def _flip_byte(settings: Settings) -> None:
    key = _weights_key(settings)
    body = _client(settings).get_object(Bucket=settings.artifacts.bucket, Key=key)["Body"]
    data = bytearray(body.read())
    data[len(data) // 2] ^= 0xFF
    _put(settings, key, bytes(data))


def _truncate(settings: Settings) -> None:
    _put(settings, _weights_key(settings), b"\0" * 100)


def _delete_weights(settings: Settings) -> None:
    _client(settings).delete_object(Bucket=settings.artifacts.bucket, Key=_weights_key(settings))


def _manifest_of_v1(settings: Settings) -> None:
    body = _client(settings).get_object(Bucket=settings.artifacts.bucket,
                                        Key="adapters/p/v1/manifest.json")["Body"].read()
    _put(settings, "adapters/p/v2/manifest.json", body)


@pytest.mark.parametrize(("tamper", "problem"), [
    (_flip_byte, f"{WEIGHTS} sha256 mismatch (expected "),
    (_truncate, f"{WEIGHTS} size mismatch (expected "),
    (_delete_weights, f"{WEIGHTS} is missing"),
    (lambda s: _put(s, "adapters/p/v2/manifest.json", b"{not json"),
     f"{MANIFEST} is unreadable"),
    (_manifest_of_v1, "describes p@v1 instead"),
], ids=["flipped-byte", "truncated", "deleted", "bad-manifest", "foreign-manifest"])
def test_a_tampered_object_is_refused_naming_the_file(settings: Settings, tmp_path: Path,
                                                      adapter_dir: Path,
                                                      tamper: Callable[[Settings], None],
                                                      problem: str) -> None:
    s = artifact_store(settings)
    _publish(s, 1, adapter_dir)
    _publish(s, 2, adapter_dir)
    tamper(settings)
    elsewhere = _store(settings, tmp_path / "other-cache")
    with pytest.raises(CorruptAdapter) as err:
        elsewhere.load("p", 2)
    message = str(err.value)
    assert message.startswith("adapter p@v2 is corrupted: ")
    assert problem in message
    assert "roll back" in message
    assert sorted(p.name for p in (tmp_path / "other-cache" / "p").iterdir()) == []
    elsewhere.load("p", 1)  # the other version is unaffected


def test_a_damaged_cached_copy_is_downloaded_again(settings: Settings,
                                                   adapter_dir: Path) -> None:
    s = artifact_store(settings)
    ref = s.publish("p", 1, adapter_dir, base_model="tiny-llama", steps=1)
    (ref.path / WEIGHTS).write_bytes(b"damaged on local disk")
    loaded, _ = s.load("p", 1)
    assert loaded.path == ref.path
    assert (ref.path / WEIGHTS).read_bytes() == (adapter_dir / WEIGHTS).read_bytes()


def test_a_crash_mid_upload_leaves_no_version_and_the_version_can_be_published(
        settings: Settings, adapter_dir: Path) -> None:
    # A real crash: the publishing process dies right after uploading its first file.
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from flywheel.config import Settings\n"
        "from flywheel.adapters.factory import artifact_store\n"
        "s = artifact_store(Settings())\n"
        "real, calls = s.bucket.client.upload_file, []\n"
        "def dying(*args):\n"
        "    calls.append(args)\n"
        "    if len(calls) == 2:\n"
        "        os._exit(17)\n"
        "    return real(*args)\n"
        "s.bucket.client.upload_file = dying\n"
        "s.publish('p', 1, Path(sys.argv[1]), base_model='tiny-llama', steps=1)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(adapter_dir)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **settings_env(settings)})
    assert proc.returncode == 17, proc.stderr

    s = artifact_store(settings)
    leftovers = _keys(settings)
    assert len(leftovers) == 1 and leftovers[0].startswith("adapters/p/v1/")
    assert s.versions("p") == []
    with pytest.raises(AdapterNotFound, match="p@v1 is not published"):
        s.load("p", 1)

    assert s.gc_temp() == []  # fresh: it could be another process's publish in flight
    removed = s.gc_temp("p", min_age_s=0)
    assert removed[0] == f"s3://{settings.artifacts.bucket}/{leftovers[0]}"
    assert [Path(p).name[:7] for p in removed[1:]] == [".tmp-1-"]  # the local staging copy
    assert _keys(settings) == []

    _publish(s, 1, adapter_dir)
    assert s.versions("p") == [1]
    assert s.load("p", 1)[1].files[WEIGHTS].bytes == 100_000


def test_a_version_without_manifest_is_invisible_and_published_over(
        settings: Settings, adapter_dir: Path) -> None:
    s = artifact_store(settings)
    _publish(s, 1, adapter_dir)
    # As a crashed publish with other content (or a half-finished deletion) leaves it.
    _put(settings, "adapters/p/v2/" + "0" * 64 + "/adapter_config.json", b"{}")
    assert s.versions("p") == [1]
    _publish(s, 2, adapter_dir)
    assert s.versions("p") == [1, 2]
    _, manifest = s.load("p", 2)
    assert sorted(manifest.files) == sorted(_files(adapter_dir))
    assert s.gc_temp("p", min_age_s=0) == [
        f"s3://{settings.artifacts.bucket}/adapters/p/v2/{'0' * 64}/adapter_config.json"]
    s.load("p", 2)


@pytest.mark.parametrize("conditional_put", ["always", "never", "auto"])
def test_a_published_version_is_never_overwritten(settings: Settings, tmp_path: Path,
                                                  adapter_dir: Path,
                                                  conditional_put: str) -> None:
    s = _store(settings, conditional_put=conditional_put)
    _publish(s, 1, adapter_dir)
    before = _keys(settings), (s.cache.path("p", 1) / MANIFEST).read_bytes()
    (adapter_dir / WEIGHTS).write_bytes(b"other weights")
    with pytest.raises(AdapterExists, match=r"p@v1 is already published at s3://"):
        _publish(s, 1, adapter_dir)
    assert (_keys(settings), (s.cache.path("p", 1) / MANIFEST).read_bytes()) == before
    if conditional_put == "never":
        return
    assert s.bucket.supports_conditional_put()  # moto honours If-None-Match: *; the probe saw it
    assert _keys(settings) == before[0]  # the probe cleaned up after itself
    # A publisher that checked before the other committed: the server refuses the manifest.
    racing = _store(settings, tmp_path / "racing-cache", conditional_put=conditional_put)
    racing.bucket.exists = lambda key: False  # type: ignore[method-assign]
    with pytest.raises(AdapterExists, match="p@v1 is already published"):
        _publish(racing, 1, adapter_dir)
    assert _store(settings, tmp_path / "fresh").load("p", 1)[1].files[WEIGHTS].bytes == 100_000
    assert not (tmp_path / "racing-cache" / "p" / "v1").exists()


def test_retention_keeps_the_newest_k_and_every_protected_version(settings: Settings,
                                                                 adapter_dir: Path) -> None:
    s = artifact_store(settings)
    assert isinstance(s, S3AdapterStore)
    for v in range(1, 7):
        _publish(s, v, adapter_dir)
    assert s.retain("p", keep_latest=2, protected={1, 3, 99}) == [2, 4]
    assert s.versions("p") == [1, 3, 5, 6]
    assert {k.split("/")[2] for k in _keys(settings)} == {"v1", "v3", "v5", "v6"}
    assert sorted(p.name for p in s.cache.path("p", 1).parent.iterdir()) == [
        "v1", "v3", "v5", "v6"]
    assert s.retain("p", keep_latest=2, protected={1, 3}) == []
    assert s.retain("p", keep_latest=1, protected=set()) == [1, 3, 5]
    assert (s.versions("p"), _keys(settings)[0].split("/")[2]) == ([6], "v6")
    with pytest.raises(ValueError, match="keep_latest must be at least 1"):
        s.retain("p", keep_latest=0, protected=set())
    assert s.discard("p", 6) and not s.discard("p", 6)
    assert _keys(settings) == []


def test_a_half_deleted_version_is_invisible(settings: Settings, adapter_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    s = artifact_store(settings)
    assert isinstance(s, S3AdapterStore)
    for v in (1, 2):
        _publish(s, v, adapter_dir)

    real = s.bucket.delete

    def dying(keys: list[str]) -> None:
        if not all(k.endswith(MANIFEST) for k in keys):
            raise ConnectionError("connection lost while deleting the files")
        real(keys)

    monkeypatch.setattr(s.bucket, "delete", dying)
    with pytest.raises(ConnectionError):
        s.retain("p", keep_latest=1, protected=set())
    assert "adapters/p/v1/manifest.json" not in _keys(settings)
    assert len(_keys(settings, "adapters/p/v1/")) == len(_files(adapter_dir))
    assert s.versions("p") == [2]
    with pytest.raises(AdapterNotFound):
        _store(settings, settings.home / "other-cache").load("p", 1)
    monkeypatch.undo()
    assert len(s.gc_temp("p", min_age_s=0)) == len(_files(adapter_dir))
    assert _keys(settings, "adapters/p/v1/") == []


def test_configuration_local_by_default_s3_on_request(settings: Settings,
                                                      tmp_path: Path) -> None:
    local = artifact_store(Settings(home=tmp_path / "home"))
    assert isinstance(local, AdapterStore)
    assert local.root == (tmp_path / "home" / "adapters").resolve()
    with pytest.raises(ValidationError, match="no bucket is set; set FLYWHEEL_ARTIFACTS__BUCKET"):
        ArtifactSettings(backend="s3")
    with pytest.raises(ValidationError, match="set both"):
        ArtifactSettings(access_key_id="AKIA")
    env = settings_env(settings)  # child processes get the real secret, not '**********'
    assert env["FLYWHEEL_ARTIFACTS__SECRET_ACCESS_KEY"] == "testing"
    assert env["FLYWHEEL_ARTIFACTS__BACKEND"] == "s3"
