"""Production's false-promotion budget, and the gate settings that bound it (pure)."""

from __future__ import annotations

import math
import re

import pytest
from pydantic import ValidationError

from flywheel.config import GateSettings, Settings
from flywheel.gate.lifetime import TEST_ONLY_LEVEL, level, lifetime, rule_for, share, spent


def test_the_candidates_levels_sum_to_at_most_alpha() -> None:
    # γ_k = 6/(π² k²): 0.6079, 0.1520, 0.0675, …; Σ over all k is exactly 1.
    assert share(1) == pytest.approx(0.607927, abs=1e-6)
    assert share(2) == pytest.approx(share(1) / 4)
    assert spent(1000) < 1 and spent(1000) == pytest.approx(1 - 6 / (math.pi ** 2 * 1000),
                                                            abs=1e-6)
    assert level(0.05, 100) == pytest.approx(3.0396e-6, rel=1e-4)  # e ≥ 3.3·10⁵ to promote
    with pytest.raises(ValueError, match="numbered from 1"):
        share(0)


def test_each_candidate_is_judged_at_its_own_level() -> None:
    rule = GateSettings(alpha=0.05, min_gain=0.05)
    third = rule_for(rule, 3)
    assert third.alpha == pytest.approx(0.05 * 6 / (9 * math.pi ** 2))
    assert third.min_gain == 0.05 and rule.alpha == 0.05  # the settings are not changed
    record = lifetime(rule, 3)
    assert record is not None and record.candidate_number == 3
    assert record.spent == pytest.approx(0.05 * (1 + 1 / 4 + 1 / 9) * 6 / math.pi ** 2)


def test_the_test_only_override_passes_every_candidate_and_says_so() -> None:
    rule = GateSettings(test_only_accept=True)
    permissive = rule_for(rule, 7)
    assert permissive.alpha == TEST_ONLY_LEVEL and permissive.min_gain == -1.0
    assert lifetime(rule, 7) is None


@pytest.mark.parametrize("field, value, words", [
    ("alpha", 1.01, "gate.alpha must be in (0, 0.2]"),
    ("alpha", 0.0, "gate.alpha must be in (0, 0.2]"),
    ("alpha", 0.5, "test_only_accept"),
    ("min_gain", -1.0, "gate.min_gain must be in [0, 1]"),
    ("invalid_tolerance", -0.1, "greater than or equal to 0"),
    ("group_tolerance", 2.0, "less than or equal to 1"),
    ("latency_p95_ratio", 0.5, "greater than or equal to 1"),
    ("tokens_ratio", 0.0, "greater than or equal to 1"),
])
def test_unsafe_gate_settings_are_refused_with_a_clear_error(field: str, value: float,
                                                               words: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(words)):
        GateSettings(**{field: value})


def test_an_invalid_alpha_in_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    monkeypatch.setenv("FLYWHEEL_GATE__ALPHA", "1.01")
    with pytest.raises(ValidationError, match=r"gate\.alpha must be in \(0, 0\.2\]"):
        Settings()
