"""The local stack heals, on a real stack started by `flywheel up --detach` as a user does:
Postgres and the broker SIGKILLed in the middle of publishing 5,000 records (through the
SDK and the gateway), `flywheel up` on a stack whose Postgres is dead, bodies refused
before they are read, bounded logs and no password in anything printed.

One stack for the module (scenarios run in order, each on the stack the previous one
healed); `test_runtime_drain.py` stops and restarts its own."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from flywheel.demo.samples import make_trajectory
from flywheel.stack.broker import free_port
from flywheel.stack.processes import pid_alive, rss_mb
from producers.sdk import FlywheelClient

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

N = 5000
ACK_SEEN_LAG_S = 2.0
LOG_MAX = 64 * 1024


def cli(env: dict[str, str], *args: str, timeout: float = 300
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flywheel.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@dataclass
class Stack:
    home: Path
    env: dict[str, str]
    printed: list[str] = field(default_factory=list)

    def run(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.home / "run.json").read_text())
        return data

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        r = cli(self.env, *args, timeout=timeout)
        self.printed += [r.stdout, r.stderr]
        return r

    @property
    def token(self) -> str:
        return next(t for t, s in self.run()["tokens"].items() if "operate" in s)

    def dsn(self) -> str:
        return str(self.run()["database_url"]).replace("postgresql+asyncpg", "postgresql")

    def postgres_pid(self) -> int:
        pid_file = Path(self.run()["postgres_data"]) / "postmaster.pid"
        return int(pid_file.read_text().split()[0])

    def component(self, name: str) -> dict[str, Any]:
        info: dict[str, Any] = self.run()["components"][name]
        return info


def stack_env(home: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "FLYWHEEL_HOME": str(home),
           "FLYWHEEL_KAFKA__LOCAL_PORT": str(free_port()),
           "FLYWHEEL_DB__LOCAL_PORT": str(free_port()), "FLYWHEEL_API__PORT": str(free_port()),
           "FLYWHEEL_STACK__LOG_MAX_BYTES": str(LOG_MAX), "FLYWHEEL_STACK__LOG_KEEP": "2",
           "FLYWHEEL_STACK__WATCH_INTERVAL_S": "2", **extra}
    for key in ("FLYWHEEL_KAFKA__BOOTSTRAP", "FLYWHEEL_DB__URL"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def stack(services_dir: Path) -> Iterator[Stack]:
    home = services_dir / f"heal-{uuid.uuid4().hex[:6]}"
    s = Stack(home, stack_env(home))
    up = s.cli("up", "--detach")
    assert up.returncode == 0, up.stderr + up.stdout
    try:
        yield s
    finally:
        down = s.cli("down", "--no-drain")
        assert down.returncode == 0, down.stderr


def records(seed: int) -> list[dict[str, Any]]:
    rng = __import__("random").Random(seed)
    return [make_trajectory(rng, failure_rate=0.0) for _ in range(N)]  # no rollout work


@dataclass
class Publisher:
    """Half the records through the SDK, half through the gateway (batches of 50, retried
    on 503 and connection errors as a well-behaved client does), paced over a few seconds."""

    stack: Stack
    batch: list[dict[str, Any]]
    gateway_acked: list[tuple[float, list[str]]] = field(default_factory=list)
    """(time.monotonic() the 202 came, ids)."""
    sdk_sent: list[tuple[float, int]] = field(default_factory=list)
    """(time.monotonic(), records the SDK had seen acknowledged), sampled every 20 ms."""
    client: FlywheelClient | None = None
    gateway_deadline_s: float = 240
    refused: int = 0
    """Gateway requests answered 503 (intake closed, or the broker down)."""

    async def __aenter__(self) -> Publisher:
        run = self.stack.run()
        self.client = FlywheelClient(run["kafka_bootstrap"], run["topics"]["trajectories"],
                                     spool_dir=self.stack.home / "sdk-spool",
                                     retry_interval_s=0.5, request_timeout_ms=3000)
        await self.client.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.client is not None
        await self.client.close(timeout=30)

    @property
    def sdk_part(self) -> list[dict[str, Any]]:
        return self.batch[: N // 2]

    async def sdk(self) -> None:
        assert self.client is not None
        for i, record in enumerate(self.sdk_part):
            await self.client.log(record)
            if i % 50 == 49:
                await asyncio.sleep(0.1)

    async def gateway(self) -> None:
        part = self.batch[N // 2:]
        stop = time.monotonic() + self.gateway_deadline_s
        async with httpx.AsyncClient(base_url=self.stack.run()["api_url"], timeout=20,
                                     headers={"Authorization": f"Bearer {self.stack.token}"}
                                     ) as http:
            for i in range(0, len(part), 50):
                chunk = part[i:i + 50]
                while time.monotonic() < stop:
                    try:
                        r = await http.post("/v1/trajectories", json=chunk)
                        if r.status_code == 202:
                            self.gateway_acked.append(
                                (time.monotonic(), [c["trajectory_id"] for c in chunk]))
                            break
                        assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
                        self.refused += 1
                    except httpx.TransportError:
                        pass  # the API is down (stack restarting): retry
                    await asyncio.sleep(0.3)
                await asyncio.sleep(0.1)

    async def run(self) -> None:
        sampling = asyncio.ensure_future(self._sample_sdk())
        try:
            await asyncio.gather(self.sdk(), self.gateway())
        finally:
            sampling.cancel()

    async def _sample_sdk(self) -> None:
        assert self.client is not None
        while True:
            self.sdk_sent.append((time.monotonic(), self.client.stats["sent"]))
            await asyncio.sleep(0.02)

    def acked_before_wall(self, wall: float) -> set[str]:
        """Every record acknowledged (to the SDK, or by a gateway 202) before wall-clock
        time `wall`."""
        before = wall - (time.time() - time.monotonic())
        sent = max((n for t, n in self.sdk_sent if t < before), default=0)
        return {r["trajectory_id"] for r in self.sdk_part[:sent]} | \
            self.acked_gateway_ids(before=before)

    def acked_gateway_ids(self, before: float = float("inf")) -> set[str]:
        return {i for t, ids in self.gateway_acked if t < before for i in ids}


async def stored_ids(stack: Stack) -> set[str]:
    conn = await asyncpg.connect(stack.dsn())
    try:
        return {str(r[0]) for r in await conn.fetch("SELECT trajectory_id FROM trajectories")}
    finally:
        await conn.close()


async def wait_stored(stack: Stack, wanted: set[str], timeout: float = 120) -> set[str]:
    deadline = time.monotonic() + timeout
    got: set[str] = set()
    while time.monotonic() < deadline:
        try:
            got = await stored_ids(stack)
        except (OSError, asyncpg.PostgresError):
            got = set()
        if wanted <= got:
            break
        await asyncio.sleep(1)
    return got & wanted


async def readyz(stack: Stack) -> int:
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            return (await http.get(stack.run()["api_url"] + "/readyz")).status_code
    except httpx.TransportError:
        return -1


async def test_postgres_killed_while_publishing_loses_nothing(stack: Stack) -> None:
    batch = records(1)
    async with Publisher(stack, batch) as pub:
        publishing = asyncio.ensure_future(pub.run())
        await asyncio.sleep(2.0)
        killed_at = time.monotonic()
        os.kill(stack.postgres_pid(), signal.SIGKILL)
        assert await readyz(stack) == 503  # the supervisor restarts it after 1 s at the soonest
        while await readyz(stack) != 200:
            assert time.monotonic() - killed_at < 60, "Postgres was not restarted"
            await asyncio.sleep(0.2)
        healed_s = time.monotonic() - killed_at
        await publishing
        assert pub.client is not None
        await pub.client.flush(timeout=60)
    wanted = {r["trajectory_id"] for r in batch}
    got = await wait_stored(stack, wanted)
    stored_s = time.monotonic() - killed_at
    print(f"postgres kill: readyz 200 again after {healed_s:.1f}s, all {len(got)} of {N} "
          f"stored {stored_s:.1f}s after the kill")
    assert len(got) == N
    assert stack.component("postgres")["restarts"] == 1
    assert stack.component("postgres")["state"] == "up"


async def test_broker_killed_loses_at_most_what_ingest_had_not_consumed(stack: Stack) -> None:
    batch = records(2)
    before = stack.component("broker")["restarts"]
    async with Publisher(stack, batch) as pub:
        publishing = asyncio.ensure_future(pub.run())
        await asyncio.sleep(2.0)
        assert pub.client is not None
        killed_at = time.monotonic()
        os.kill(stack.run()["broker_pid"], signal.SIGKILL)
        await asyncio.sleep(0.5)
        while await readyz(stack) != 200:
            assert time.monotonic() - killed_at < 60, "the broker was not restarted"
            await asyncio.sleep(0.2)
        ready_s = time.monotonic() - killed_at
        await publishing
        await pub.client.flush(timeout=120)
        assert pub.client.stats["spooled"] == 0
    wanted = {r["trajectory_id"] for r in batch}
    got = await wait_stored(stack, wanted, timeout=60)
    lost = wanted - got
    run = stack.run()
    # Acknowledged before the new broker started: by the killed one (an ack it sent just
    # before the kill can arrive just after it), so possibly lost with it. ACK_SEEN_LAG_S:
    # the clients see an ack later than the broker sent it (the SDK's counter is sampled
    # every 20 ms; the gateway's 202 waits on the API's event loop), by seconds on a loaded
    # machine — a CI run beside other jobs counted 9 of 1,609 lost records as acknowledged
    # after the new broker started.
    at_risk = pub.acked_before_wall(run["broker"]["started_at"] + ACK_SEEN_LAG_S)
    loss = run["broker"]["losses"][-1]
    print(f"broker kill: readyz 200 again after {ready_s:.1f}s; {len(at_risk)} acknowledged "
          f"before the kill, {len(lost)} lost (the last lag read said ingest was "
          f"{loss['not_stored']} behind); {len(got)} of {N} stored "
          f"{time.monotonic() - killed_at:.1f}s after the kill")
    sdk_ids = {r["trajectory_id"] for r in pub.sdk_part}
    started_s = run["broker"]["started_at"] - (time.time() - time.monotonic()) - killed_at
    gw_seen = {i: t - killed_at for t, ids in pub.gateway_acked for i in ids}
    print(f"lost through the SDK: {len(lost & sdk_ids)} (acknowledged by then: "
          f"{[n for _, n in pub.sdk_sent[-1:]]}); through the gateway: {len(lost - sdk_ids)}, "
          f"their 202s {sorted({round(gw_seen[i], 1) for i in lost - sdk_ids})} s after the "
          f"kill; the new broker started {started_s:.1f} s after it")
    # What was lost had been acknowledged by the dead broker (and not yet consumed); every
    # record acknowledged by the new one (the SDK spooled them, the gateway answered 503
    # until the new broker took them) is stored.
    assert not lost & sdk_ids  # the SDK confirms by storage on the bundled broker: re-sent
    assert lost <= at_risk
    assert (wanted - at_risk) <= got
    assert stack.component("broker")["restarts"] == before + 1
    assert any("a broker instance was lost" in n for n in run["notes"]), run["notes"]
    assert loss["not_stored"] is not None  # a lag read came before the kill
    for name in ("ingest", "miner", "rollout", "trainer", "gate"):
        assert stack.component(name)["state"] == "up", name


async def test_up_repairs_a_stack_whose_postgres_is_dead(stack: Stack) -> None:
    os.kill(stack.postgres_pid(), signal.SIGKILL)
    up = stack.cli("up", "--detach", "--repair-wait", "30")
    assert up.returncode == 0, up.stderr
    assert "flywheel is up" in up.stderr
    assert pid_alive(stack.postgres_pid()) and await readyz(stack) == 200


async def test_up_says_what_is_dead_and_why_when_it_cannot_repair(stack: Stack) -> None:
    port = int(stack.env["FLYWHEEL_DB__LOCAL_PORT"])
    os.kill(stack.postgres_pid(), signal.SIGKILL)
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + 10
    while True:  # the dying postmaster may hold the port for a moment
        try:
            squatter.bind(("127.0.0.1", port))
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    squatter.listen()
    try:
        up = stack.cli("up", "--detach", "--repair-wait", "8")
        assert up.returncode != 0
        assert "postgres is down" in up.stderr, up.stderr
        assert "postgres did not start" in up.stderr or "could not" in up.stderr, up.stderr
    finally:
        squatter.close()
    up = stack.cli("up", "--detach", "--repair-wait", "60")
    assert up.returncode == 0, up.stderr
    assert await readyz(stack) == 200


def test_a_huge_body_is_refused_before_it_is_read(stack: Stack) -> None:
    run = stack.run()
    api_pid = run["pids"]["api"]
    rss_before = rss_mb(api_pid) or 0
    host, port = run["api_url"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + stack.token.encode() + b"\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 67108864\r\n\r\n"
                     + b'{"messages": [' + b" " * 65536)
        answer = conn.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 413"), answer
    assert (rss_mb(api_pid) or 0) - rss_before < 20


def test_logs_are_bounded_and_nothing_printed_holds_the_password(stack: Stack) -> None:
    st = stack.cli("status", "--json")
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout)
    assert status["dependencies"]["postgres"]["up"] and status["stack"]["components"]
    password = stack.run()["database_url"].split(":")[2].split("@")[0]
    assert len(password) > 10
    logs = Path(stack.run()["logs"])
    for path in logs.iterdir():
        # Rotation runs every 2 s: a file may pass the limit by what was written meanwhile.
        assert path.stat().st_size < LOG_MAX + 1_048_576, path
        assert password not in path.read_text(errors="replace"), path
    assert len(list(logs.glob("*.log.3"))) == 0  # keep = 2
    for text in stack.printed:
        assert password not in text
    assert "postgres:***@" in "".join(stack.printed)


async def test_a_killed_supervisor_is_replaced_keeping_the_broker_and_its_records(
        stack: Stack) -> None:
    old = stack.run()
    os.kill(old["supervisor_pid"], signal.SIGKILL)
    up = stack.cli("up", "--detach")
    assert up.returncode == 0, up.stderr
    new = stack.run()
    assert new["supervisor_pid"] != old["supervisor_pid"]
    assert new["broker_pid"] == old["broker_pid"]  # adopted, with what it holds
    assert not any(pid_alive(pid) for name, pid in old["pids"].items())
    assert any("kept the running broker" in n for n in new["notes"]), new["notes"]
    batch = records(6)[:200]
    async with httpx.AsyncClient(base_url=new["api_url"], timeout=30,
                                 headers={"Authorization": f"Bearer {stack.token}"}) as http:
        r = await http.post("/v1/trajectories", json=batch)
    assert r.status_code == 202, r.text
    assert len(await wait_stored(stack, {b["trajectory_id"] for b in batch})) == 200
