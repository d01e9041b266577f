"""`flywheel publish` and `FlywheelClient.log` on the records that used to crash them: every
bad line is counted as invalid with its reason and the file goes on; `log` raises only
`ValueError`. No broker needed: the client spools while it cannot reach one."""

from __future__ import annotations

import io
import json
import uuid
from pathlib import Path

import pytest

from flywheel.config import KafkaSettings, Settings
from flywheel.runtime.kafka import ensure_topics
from flywheel.stack.broker import LocalBroker, free_port
from producers.replay import publish_lines
from producers.sdk import FlywheelClient
from tests.support.poison import POISON


def offline(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, kafka=KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}",
                                                       topic_prefix=f"t{uuid.uuid4().hex[:8]}"))


def good() -> str:
    return json.dumps({"trajectory_id": str(uuid.uuid4()), "agent": "a",
                       "outcome": {"status": "success"}})


async def test_publish_counts_every_bad_line_and_never_stops_mid_file(tmp_path: Path) -> None:
    bad = [p for p in POISON if p.expected]
    lines = [good(), *(p.value.decode() for p in bad),
             "{broken", "[1, 2]", "\udcff\udcfe not utf-8",  # as surrogateescape reads it
             json.dumps({"agent": "a", "outcome": {"status": "success"},
                         "metadata": {"blob": "x" * 1_100_000}}),  # too large for Kafka
             good()]
    report = await publish_lines(offline(tmp_path), io.StringIO("\n".join(lines) + "\n"),
                                 progress=False, flush_timeout=0.5)
    assert report["published"] == 2 and report["spooled"] == 2
    assert report["invalid"] == len(lines) - 2
    by_line = {e["line"]: e["error"] for e in report["errors"]}
    for n, p in enumerate(bad, start=2):
        assert p.says in by_line[n], (p.name, by_line[n])
    n = len(bad) + 2
    assert "not valid JSON" in by_line[n] and "must be a JSON object" in by_line[n + 1]
    assert "not valid JSON" in by_line[n + 2] and "the limit is" in by_line[n + 3]


async def test_publish_raw_counts_a_line_too_large_for_kafka(tmp_path: Path) -> None:
    lines = [good(), "x" * 1_100_000, good()]
    report = await publish_lines(offline(tmp_path), io.StringIO("\n".join(lines)), raw=True,
                                 progress=False, flush_timeout=0.5)
    assert (report["published"], report["invalid"]) == (2, 1)
    assert report["errors"][0]["line"] == 2


@pytest.mark.parametrize("case", [p for p in POISON if p.expected],
                         ids=[p.name for p in POISON if p.expected])
async def test_log_raises_value_error_for_any_invalid_record(tmp_path: Path, case: object
                                                             ) -> None:
    client = FlywheelClient(f"127.0.0.1:{free_port()}", "t", spool_dir=tmp_path,
                            retry_interval_s=0.2, request_timeout_ms=500)
    async with client:
        with pytest.raises(ValueError, match="invalid trajectory: "):
            await client.log(json.loads(case.value))  # type: ignore[attr-defined]
        assert client.stats["pending"] == 0


@pytest.mark.kafka
def test_the_cli_reads_a_file_that_is_not_utf8_line_by_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broker: LocalBroker) -> None:
    from typer.testing import CliRunner

    from flywheel.cli.main import app

    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    monkeypatch.setenv("FLYWHEEL_KAFKA__BOOTSTRAP", broker.bootstrap)
    monkeypatch.setenv("FLYWHEEL_KAFKA__TOPIC_PREFIX", f"t{uuid.uuid4().hex[:8]}")
    path = tmp_path / "logs.jsonl"
    path.write_bytes(good().encode() + b'\n{"agent": "\xff\xfe"}\n' + good().encode() + b"\n")
    result = CliRunner().invoke(app, ["publish", str(path), "--json"])
    report = json.loads(result.stdout)
    assert (report["published"], report["invalid"]) == (2, 1), result.output
    assert report["errors"][0]["line"] == 2 and "not valid JSON" in report["errors"][0]["error"]


@pytest.mark.kafka
async def test_publish_to_a_bundled_broker_reports_what_is_not_stored(tmp_path: Path) -> None:
    """Acknowledged by a stack's bundled broker and stored by no one (ingest is not running):
    not delivered, and said so, whichever way the broker was named (here FLYWHEEL_KAFKA__
    BOOTSTRAP, which once turned confirmation off)."""
    broker = LocalBroker(free_port(), tmp_path / "b.log", bundled=True)
    broker.start()
    try:
        settings = Settings(home=tmp_path, kafka=KafkaSettings(
            bootstrap=broker.bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:8]}"))
        await ensure_topics(broker.bootstrap, [settings.topics.trajectories], partitions=1)
        report = await publish_lines(settings, io.StringIO("\n".join([good(), good()])),
                                     progress=False, flush_timeout=1)
    finally:
        broker.stop()
    assert report["published"] == 2 and report["spooled"] == 2
