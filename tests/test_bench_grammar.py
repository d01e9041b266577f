"""`flywheel bench grammar` runs end to end on a tiny budget and reports both sides."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow]


def test_the_grammar_benchmark_reports_both_sides() -> None:
    from flywheel.bench.grammar import run_grammar_bench

    result = run_grammar_bench(requests=2, group_size=2, max_tokens=48, temperature=1.0,
                               repeats=1)
    for side in ("grammar", "no_grammar"):
        assert result[side]["tokens"] > 0 and result[side]["tokens_per_s"] > 0
        valid, rows = map(int, result[side]["valid_calls"].split("/"))
        assert rows == 4 and 0 <= valid <= rows
    assert 0 < result["grammar_vs_no_grammar_tokens_per_s"] < 10
