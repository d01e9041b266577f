"""Whether the trainer's warm start is still under way (the scheduler samples nothing then).

Baseline first: until the trainer's first stage is settled (the baseline is measured and,
if it says SFT, the SFT version published), groups sampled from the base model would only
be superseded. A trainer that gave up waiting (no baseline, no demonstrations) goes on with
GRPO, and so does sampling.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncConnection

from flywheel.adapters import registry
from flywheel.config import Settings
from flywheel.trainer.store import trainer_state


async def warm_starting(conn: AsyncConnection, settings: Settings) -> bool:
    """True while groups sampled now would come from a policy about to be replaced."""
    if settings.trainer.stages != "sft_then_grpo":
        return False
    policy = settings.policy
    state = await trainer_state(conn, policy)
    if state in ("waiting", "training", "starved", "stalled"):
        return False
    baseline = await registry.latest_baseline(conn, policy)
    return baseline is None or baseline["recommendation"] == "sft"
