"""Counting what a lost broker took (`flywheel.runtime.losses`): pure parts and the files."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.runtime.losses import (
    Losses,
    acknowledge,
    arrived,
    candidates,
    count_loss,
    unstored_total,
    with_earlier_keys,
)


def test_candidates_name_what_was_read_and_count_the_rest() -> None:
    # p0: 5 not committed, 3 read with keys (one keyless); p1: 2 behind, none read.
    ids, counted, acked = candidates(
        {"0": [10, 15], "1": [4, 6], "2": [7, 7]},
        {"0": [[9, None], [10, "a"], [11, None], [12, "b"]]})  # offset 9: already committed
    assert (sorted(ids), counted, acked) == (["a", "b"], 1 + 2 + 2, 7)


def test_a_failed_key_read_keeps_the_keys_earlier_reads_named() -> None:
    """The read in flight when the broker is killed gets the positions and no keys: the
    earlier read's keys still name what is behind, and only those (committed since: gone)."""
    state = {"unstored": {"t": {"0": [[10, "a"], [11, "b"], [12, "c"]], "1": [[3, "x"]]}}}
    failed = {"stored_positions": {"t": {"0": [11, 15], "1": [3, 4]}, "f": {"0": [0, 2]}},
              "unstored": {}}
    merged = with_earlier_keys(state, failed)["unstored"]
    assert merged == {"t": {"0": [[11, "b"], [12, "c"]], "1": [[3, "x"]]}}
    ids, counted, _ = candidates(failed["stored_positions"]["t"], merged["t"])
    assert (sorted(ids), counted) == (["b", "c", "x"], 2)  # offsets 13, 14: by count
    # A read that got further wins where both have an offset; one with nothing behind
    # keeps nothing.
    partial = {"stored_positions": {"t": {"0": [11, 15]}},
               "unstored": {"t": {"0": [[12, "c"], [13, "d"]]}}}
    assert with_earlier_keys(state, partial)["unstored"]["t"] == {
        "0": [[11, "b"], [12, "c"], [13, "d"]]}
    drained = {"stored_positions": {"t": {"0": [15, 15]}}, "unstored": {"t": {}}}
    assert with_earlier_keys(state, drained)["unstored"] == {"t": {}}


def test_arrivals_and_what_is_left() -> None:
    before = {"stored_positions": {"t": {"0": [0, 10]}, "f": {"0": [0, 0]}}}
    after = {"stored_positions": {"t": {"0": [12, 12], "1": [0, 3]}, "f": {"0": [1, 1]}}}
    assert arrived(before, after) == 2 + 3 + 1
    assert unstored_total(after) == 3 and unstored_total(before) == 10


def test_a_loss_stays_open_until_acknowledged(tmp_path: Path) -> None:
    losses = Losses(tmp_path)
    losses.add({"id": "l1", "not_stored": 3,
                "topics": {"t": {"not_stored": 3, "counted": 1, "missing_ids": ["x", "y"]}}})
    again = Losses(tmp_path)  # kept across supervisor restarts
    assert [e["id"] for e in again.open()] == ["l1"]
    assert "missing_ids" not in again.open()[0]["topics"]["t"]
    with pytest.raises(LookupError):
        acknowledge(tmp_path, "nope")
    assert acknowledge(tmp_path, None) == ["l1"]
    assert Losses(tmp_path).open() == []


async def test_an_instance_lost_before_any_read_has_an_unknown_loss_not_zero(
        tmp_path: Path) -> None:
    # No read of it: nothing to look up (no database is reached), nothing known.
    loss = await count_loss("postgresql+asyncpg://nobody@127.0.0.1:1/none",
                            {"started_at": 1.0, "lag": {}, "lag_read_at": None})
    assert loss["not_stored"] is None and loss["topics"] == {}
    losses = Losses(tmp_path)
    losses.add(loss)
    assert not await losses.recount("postgresql+asyncpg://nobody@127.0.0.1:1/none")
    assert Losses(tmp_path).open()[0]["not_stored"] is None  # still open, still unknown


async def test_a_cancellation_leaking_out_of_a_read_is_a_failed_read_not_the_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """aiokafka's `consumer.stop` can let its fetcher's CancelledError out when the broker
    dies mid-read (it ended the stack's watch thread in a clean-clone CI run); a read that
    meets it answers None. A cancellation of the reading task itself still propagates."""
    import asyncio

    from flywheel.stack import drain

    async def leaks(bootstrap: str, group: str, topic: str) -> dict[int, tuple[int, int]]:
        raise asyncio.CancelledError

    monkeypatch.setattr(drain, "group_positions", leaks)
    assert await drain.read_positions("127.0.0.1:1", [("g", "t")]) is None

    async def hangs(bootstrap: str, group: str, topic: str) -> dict[int, tuple[int, int]]:
        await asyncio.sleep(60)
        return {}

    monkeypatch.setattr(drain, "group_positions", hangs)
    task = asyncio.ensure_future(drain.read_positions("127.0.0.1:1", [("g", "t")]))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
