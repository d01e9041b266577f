"""`flywheel up --detach` / `status --json` / `down` as a user runs them, in real processes."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from flywheel.demo.samples import make_trajectory
from flywheel.stack.broker import free_port, port_open

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]


def _cli(env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flywheel.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_up_publish_status_down(services_dir: Path) -> None:
    home = services_dir / f"stack-{uuid.uuid4().hex[:6]}"
    ports = {"kafka": free_port(), "db": free_port(), "api": free_port()}
    env = {**os.environ, "FLYWHEEL_HOME": str(home),
           "FLYWHEEL_KAFKA__LOCAL_PORT": str(ports["kafka"]),
           "FLYWHEEL_DB__LOCAL_PORT": str(ports["db"]), "FLYWHEEL_API__PORT": str(ports["api"])}
    env.pop("FLYWHEEL_KAFKA__BOOTSTRAP", None)
    env.pop("FLYWHEEL_DB__URL", None)
    up = _cli(env, "up", "--detach")
    try:
        assert up.returncode == 0, up.stderr
        # The real home, absolute: with two stacks side by side the user sees which is which.
        assert f"FLYWHEEL_HOME={home.resolve()}\n" in up.stderr
        run = json.loads((home / "run.json").read_text())
        assert run["home"] == str(home.resolve())
        assert {"kafka_bootstrap", "database_url", "api_url", "topics"} <= set(run)
        assert run["topics"]["trajectories"] == "flywheel.trajectories"
        assert run["kafka_bootstrap"].endswith(f":{ports['kafka']}")

        token = next(t for t, s in run["tokens"].items() if s == ["publish"])
        rng = random.Random(11)
        batch = [make_trajectory(rng) for _ in range(30)]
        with httpx.Client(base_url=run["api_url"], timeout=30) as http:
            r = http.post("/v1/trajectories", json=batch,
                          headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 202, r.text

        jsonl = home / "more.jsonl"
        more = [make_trajectory(rng, chat_format=True) for _ in range(20)]
        jsonl.write_text("\n".join(json.dumps(t) for t in more) + "\n{broken\n")
        pub = _cli(env, "publish", str(jsonl), "--json")
        assert pub.returncode == 1, pub.stderr  # an invalid line: the exit status says so
        report = json.loads(pub.stdout)
        assert (report["published"], report["invalid"]) == (20, 1)
        assert report["errors"][0]["line"] == 21

        deadline = time.monotonic() + 60
        while True:
            st = _cli(env, "status", "--json")
            assert st.returncode == 0, st.stderr
            status = json.loads(st.stdout)
            # Ingest commits its offsets just after the rows' transaction: wait for both.
            if (status["trajectories"] == 50
                    and status["lag"].get("flywheel-ingest", {}).get("total") == 0) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert status["trajectories"] == 50
        assert status["failures"] == sum(t["outcome"]["status"] != "success" for t in batch + more)
        assert status["dlq"] == 0
        assert status["lag"]["flywheel-ingest"]["total"] == 0
    finally:
        down = _cli(env, "down")
    assert down.returncode == 0, down.stderr
    assert not (home / "run.json").exists()
    assert not port_open("127.0.0.1", ports["kafka"])
    assert not port_open("127.0.0.1", ports["db"])
    assert not port_open("127.0.0.1", ports["api"])
