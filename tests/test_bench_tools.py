"""`flywheel bench tools` runs end to end on a tiny budget and reports every figure."""

from __future__ import annotations

import pytest

from flywheel.bench.tools import run_tools_bench

pytestmark = [pytest.mark.slow]


def test_the_tools_benchmark_reports_every_leg() -> None:
    result = run_tools_bench(calls=10, episodes=4, in_flight=2, sessions=3)
    trip = result["round_trip"]
    assert 0 < trip["python_direct_us"] < trip["python_us"]  # the session layer costs
    assert trip["stdio_us"] > 0 and trip["http_us"] > 0
    assert set(result["episodes_per_s"]) == {"python", "stdio", "http", "stdio_process"}
    assert all(leg["in_flight_2"] > 0 and leg["in_flight_1"] > 0
               for leg in result["episodes_per_s"].values())
    memory = result["memory"]
    assert memory["sessions"] == memory["server_processes"] == 3  # one server per session
    assert memory["rss_mib_per_session"] > 10
