"""False promotions bounded over a production's lifetime: alpha-spending across candidates.

Continual training proposes candidate after candidate against the same production. Testing
each at `alpha` would promote a stream of no-better candidates at about alpha each, and
production would random-walk. Instead the k-th candidate evaluated against one production
(k = 1, 2, … counted since that production was set) is tested at level

    alpha_k = alpha · γ_k,   γ_k = 6 / (π² k²),   Σ_k γ_k = 1,

so by the union bound — valid however the candidates depend on each other (they share
production's cached samples and each other's training) — the chance that *any* no-better
candidate is promoted over the whole lifetime is at most Σ_k alpha_k ≤ alpha. A promotion
ends the lifetime: the new production starts again at k = 1 with the whole budget, which
is exactly what e-LOND (online testing with e-values) reduces to when every discovery ends
the stream. γ_k ∝ 1/k² rather than 2^-k: the threshold 1/alpha_k grows like k², so the
evidence a candidate needs (ln 1/alpha_k pairs' worth) grows only by 2 ln k — the 100th
candidate needs e ≥ 3.3·10⁵ instead of 2.5·10³¹. The first candidate pays ln(1/0.61) ≈ 0.5
nats more than a lone test at alpha. tests/test_gate_simulation.py measures both ends.

The count k is not stored on its own: it is the number of decision rows against the current
production (same `baseline_version`, created since the pointer last moved), plus one;
`incomplete` evaluations never promote and spend nothing. Every decision records its k,
level and the budget spent (`GateLifetime`).
"""

from __future__ import annotations

import math

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.config import GateSettings
from flywheel.events import GateLifetime

TEST_ONLY_LEVEL = 1.01
"""The level under `gate.test_only_accept`: ln(1/1.01) < 0, so any e-value "crosses"."""


def share(k: int) -> float:
    """γ_k = 6 / (π² k²): the share of the lifetime budget the k-th candidate may spend."""
    if k < 1:
        raise ValueError(f"candidates are numbered from 1, got {k}")
    return 6 / (math.pi ** 2 * k * k)


def spent(k: int) -> float:
    """Σ_{j≤k} γ_j (< 1)."""
    return sum(share(j) for j in range(1, k + 1))


def level(alpha: float, k: int) -> float:
    """alpha_k = alpha · γ_k, the level of the k-th candidate."""
    return alpha * share(k)


def lifetime(rule: GateSettings, k: int) -> GateLifetime | None:
    """What the k-th candidate spends (None under `test_only_accept`)."""
    if rule.test_only_accept:
        return None
    return GateLifetime(candidate_number=k, alpha=rule.alpha, level=level(rule.alpha, k),
                        spent=rule.alpha * spent(k))


def rule_for(rule: GateSettings, k: int) -> GateSettings:
    """The rule the k-th candidate is judged by: `alpha` replaced by its level. Under the
    test-only override, a rule every candidate passes (level 1.01, min_gain −1, the guards
    kept)."""
    if rule.test_only_accept:
        return rule.model_copy(update={"alpha": TEST_ONLY_LEVEL, "min_gain": -1.0})
    return rule.model_copy(update={"alpha": level(rule.alpha, k)})


async def candidate_number(conn: AsyncConnection, policy: str, production: int | None) -> int:
    """k of the next candidate of `policy` against `production` (see the module doc)."""
    done = (await conn.execute(text("""
        SELECT count(*) FROM evaluations e
        WHERE e.policy = :p AND e.baseline_version IS NOT DISTINCT FROM CAST(:v AS int)
          AND e.recommendation <> 'incomplete'
          AND e.created_at >= coalesce(
              (SELECT updated_at FROM production WHERE policy = :p), '-infinity')"""),
        {"p": policy, "v": production})).scalar_one()
    return int(done) + 1
