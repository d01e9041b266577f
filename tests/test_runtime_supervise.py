"""The supervisor's pure parts, with hand-computed inputs: restart backoff, what a lost
broker instance must republish, log rotation, secret masking, the drain's words."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from flywheel.runtime.logs import (
    MaskingFormatter,
    mask_secrets,
    mask_text,
    mask_url,
    rotate_if_needed,
    rotated_files,
)
from flywheel.stack.drain import DrainReport, progress_line
from flywheel.stack.heal import postgres_reason
from flywheel.stack.processes import Backoff, pid_alive
from flywheel.stack.recovery import (
    MARGIN_S,
    first_unconsumed,
    loss_report,
    mark_clean,
    record,
    republish_since,
    save_state,
)

GROUPS = [("ingest", "t.traj"), ("miner", "t.traj"), ("rollout", "t.req"),
          ("trainer", "t.groups")]


def test_backoff_doubles_in_a_crash_loop_and_starts_over_after_a_stable_run() -> None:
    b = Backoff(max_s=30)
    b.started(0)
    waits = []
    now = 0.0
    for _ in range(7):
        now += 0.5  # dies half a second after each start
        b.died(now)
        waits.append(b.delay())
        assert not b.due(now + b.delay() - 0.01) and b.due(now + b.delay())
        now += b.delay()
        b.restarting(now)
    assert waits == [1, 2, 4, 8, 16, 30, 30]
    assert b.restarts == 7
    b.died(now + 100)  # ran for 100 s: a new incident
    assert b.delay() == 1
    b.died(now + 200)  # the same death seen again changes nothing
    assert b.delay() == 1
    b.reset()
    assert b.due(now + 100)  # a repair asked for: at once


def test_a_reaped_or_zombie_process_is_not_alive() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not pid_alive(proc.pid)  # exited, not reaped yet: os.kill(pid, 0) would succeed
    proc.wait()
    assert not pid_alive(proc.pid) and not pid_alive(None) and not pid_alive(0)
    assert pid_alive(os.getpid())


def test_clean_marks_only_groups_that_had_consumed_everything() -> None:
    clean = mark_clean({"miner": 50.0}, {"ingest": 0, "miner": 3, "rollout": 0}, 100.0)
    assert clean == {"ingest": 100.0, "miner": 50.0, "rollout": 100.0}


def test_a_positions_read_is_folded_into_the_state() -> None:
    state: dict[str, object] = {"clean_at": {"ingest": 1.0}}
    record(state, {"ingest": {0: (10, 10), 1: (7, 9)}, "miner": {0: (4, 10), 1: (9, 9)},
                   "rollout": {0: (3, 3)}}, read_at=50.0)
    assert state["lag"] == {"ingest": 2, "miner": 6, "rollout": 0}
    assert state["clean_at"] == {"ingest": 1.0, "rollout": 50.0}
    assert state["committed"] == {"ingest": {"0": 10, "1": 7}, "miner": {"0": 4, "1": 9},
                                  "rollout": {"0": 3}}
    # From where stored trajectories must go back: the lower of ingest's and the miner's.
    assert first_unconsumed(state, ["ingest", "miner"]) == {0: 4, 1: 7}
    assert first_unconsumed({}, ["ingest"]) == {}


def test_what_a_lost_broker_instance_must_republish() -> None:
    clean = {"ingest": 100.0, "miner": 50.0, "rollout": 90.0}
    since = republish_since(clean, broker_started_at=40.0, groups=GROUPS)
    assert since == {"t.traj": 50.0 - MARGIN_S,      # the slower of ingest and the miner
                     "t.req": 90.0 - MARGIN_S,
                     "t.groups": 40.0 - MARGIN_S}   # never clean: since the instance began
    # A clean time from an older instance cannot reach before this one started.
    assert republish_since({"rollout": 10.0}, 40.0, GROUPS)["t.req"] == 40.0 - MARGIN_S


def test_loss_report_counts_what_ingest_had_not_stored() -> None:
    state = {"started_at": 10.0, "lag": {"ingest": 7, "miner": 900}, "lag_read_at": 95.0}
    report = loss_report(state, GROUPS, "t.traj", now=100.0)
    assert report["not_stored"] == 7  # the miner's 900 are stored: republished, not lost
    assert report["lag_read_age_s"] == 5.0
    assert loss_report({"started_at": 1.0}, GROUPS, "t.traj", now=2.0)["not_stored"] is None


def test_rotation_copies_then_truncates_and_keeps_n(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    with open(log, "ab") as writer:  # a process appending, as the services do
        for i in range(5):
            writer.write(f"round {i}\n".encode() * 100)
            writer.flush()
            assert rotate_if_needed(log, max_bytes=500, keep=2)
            assert log.stat().st_size == 0
        writer.write(b"after\n")
        writer.flush()
    assert log.read_bytes() == b"after\n"  # the writer's next line lands at the new start
    assert [p.name for p in rotated_files(log)] == ["svc.log", "svc.log.1", "svc.log.2"]
    assert (tmp_path / "svc.log.1").read_bytes().startswith(b"round 4")
    assert (tmp_path / "svc.log.2").read_bytes().startswith(b"round 3")
    assert not rotate_if_needed(log, max_bytes=500, keep=2)
    assert not rotate_if_needed(tmp_path / "missing.log", max_bytes=1, keep=1)


def test_secrets_are_masked_in_urls_text_and_structures() -> None:
    url = "postgresql+asyncpg://postgres:s3cr3t-pw@127.0.0.1:5433/flywheel"
    assert mask_url(url) == "postgresql+asyncpg://postgres:***@127.0.0.1:5433/flywheel"
    assert mask_text(f"connect to {url} failed; PGPASSWORD=abc") == (
        "connect to postgresql+asyncpg://postgres:***@127.0.0.1:5433/flywheel failed; "
        "PGPASSWORD=***")
    assert mask_url("http://127.0.0.1:8765/v1") == "http://127.0.0.1:8765/v1"
    masked = mask_secrets({"database_url": url, "tokens": {"fw_op_x": ["operate"]},
                           "nested": [{"secret_access_key": "k"}], "port": 5})
    assert masked == {"database_url": mask_url(url),
                      "tokens": {"***": "1 entries, see the file itself (mode 0600)"},
                      "nested": [{"secret_access_key": "***"}], "port": 5}
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "down: %s", (url,), None)
    assert "s3cr3t" not in MaskingFormatter("%(message)s").format(record)


def test_drain_words() -> None:
    assert progress_line({"ingest": 1200, "miner": 0, "trainer": 3}, 4, 87.2) == \
        "draining: ingest 1200 · trainer 3 · outbox 4 (87s left)"
    assert progress_line({"ingest": 0}, None, 5) == \
        "draining: consumers caught up · outbox ? (5s left)"
    done = DrainReport(done=True, trajectories_drained=True, waited_s=3.2)
    assert done.summary() == "drained in 3s: every consumer caught up, outbox empty"
    held = DrainReport(trajectories_drained=True, waited_s=20, lag={"ingest": 0, "trainer": 3},
                       outbox_pending=0, trajectory_groups=("ingest",))
    assert "not consumed yet (republished from the outbox at the next start, not lost): " \
           "trainer 3" in held.summary()
    short = DrainReport(waited_s=120, lag={"ingest": 40, "trainer": 0}, outbox_pending=2,
                        trajectory_groups=("ingest",))
    text = short.summary()
    assert "NOT all trajectories were consumed (ingest 40 behind)" in text
    assert "2 outbox rows unpublished" in text


def test_postgres_reason_keeps_the_lines_that_say_why() -> None:
    failure = ("postgres did not start on port 5433:\nwaiting for server to start.... stopped\n"
               "2026-01-01 UTC [1] LOG:  could not bind IPv4 address \"127.0.0.1\": Address "
               "already in use\n2026-01-01 UTC [1] LOG:  database system is shut down\n"
               "2026-01-01 UTC [1] FATAL:  could not create any TCP/IP sockets")
    assert postgres_reason(failure) == (
        "postgres did not start on port 5433: LOG: could not bind IPv4 address "
        "\"127.0.0.1\": Address already in use; FATAL: could not create any TCP/IP sockets")


class _Broker:
    def __init__(self) -> None:
        self.starts = 0

    def adopt(self, pid: int, started_at: float | None) -> bool:
        return True

    def alive(self) -> bool:
        return True

    def stop(self) -> None:
        pass

    def start(self) -> None:
        self.starts += 1


class _Consumer:
    def __init__(self, name: str) -> None:
        self.name, self.held, self.started = name, True, 0

    def start(self, env: dict[str, str], now: float) -> None:
        self.held, self.started = False, self.started + 1

    def alive(self) -> bool:
        return self.started > 0


def test_a_failed_recovery_on_a_new_broker_is_retried_without_replacing_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A freshly started broker may answer UNKNOWN_SERVER_ERROR while its topics are made
    (tansu did, in CI): the recovery is retried on later ticks against the same broker, and
    the consumers start once it succeeded."""
    from aiokafka.errors import UnknownError

    from flywheel.config import Settings
    from flywheel.stack.heal import Healer

    failures = [UnknownError(), UnknownError()]
    recovered: list[dict[str, Any]] = []

    def recover_lost(lost: dict[str, Any]) -> None:
        if failures:
            raise failures.pop(0)
        recovered.append(lost)

    ingest = _Consumer("ingest")
    healer = Healer(Settings(home=tmp_path), [ingest], [])  # type: ignore[list-item]
    monkeypatch.setattr(healer, "recover_lost", recover_lost)
    monkeypatch.setattr(healer, "hold_consumers", lambda: None)
    broker = _Broker()
    healer.broker = broker  # type: ignore[assignment]
    save_state(tmp_path, {"broker_pid": 1, "started_at": 5.0})
    healer.start_broker({"broker_pid": 1})  # adopts it, with what it held

    healer.replace_broker(100.0, drained=False)
    assert healer.pending_recovery is not None and ingest.started == 0
    assert healer.broker_error is not None and "UnknownError" in healer.broker_error
    healer.heal(healer.recovery_retry_at - 0.1, ready=False)
    assert len(failures) == 1  # not due yet: not retried
    healer.heal(healer.recovery_retry_at, ready=False)
    assert len(failures) == 0 and healer.pending_recovery is not None
    healer.heal(healer.recovery_retry_at, ready=False)
    assert healer.pending_recovery is None and healer.broker_error is None
    assert recovered == [{"broker_pid": 1, "started_at": 5.0, "drained": False}]
    assert broker.starts == 1  # the same broker throughout
    assert ingest.started == 1 and not ingest.held
