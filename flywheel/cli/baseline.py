"""`flywheel baseline`: the base model (and production) on the frozen holdout, next stage."""

from __future__ import annotations

import asyncio
from typing import Any

from flywheel.cli.common import JsonOpt, console, fail, load_settings, print_result


def baseline(as_json: JsonOpt = False) -> None:
    """Evaluate the base model (and production) on the frozen holdout; record the baseline
    and recommend the next stage (SFT first, GRPO, or more tasks). Loads the policy engine."""
    from flywheel.db.engine import make_engine
    from flywheel.gate.candidate import GateService
    from flywheel.gate.evaluate import NoEvalSet
    from flywheel.policy.factory import make_policy
    from flywheel.runtime.endpoints import StackNotRunning, resolve_db_url
    from flywheel.tools.registry import registry_catalog
    from flywheel.tools.runtime import use_catalog

    settings = load_settings()

    async def go() -> Any:
        engine = make_engine(resolve_db_url(settings), pool_size=2)
        policy = make_policy(settings)
        toolsets = registry_catalog(engine, settings.tools.registry_refresh_s)
        use_catalog(toolsets)
        try:
            return await GateService(settings, engine, policy).baseline(force=True)
        finally:
            await policy.close()
            await toolsets.aclose()
            await engine.dispose()

    try:
        record = asyncio.run(go())
    except (NoEvalSet, StackNotRunning) as err:
        fail(str(err))
    if as_json:
        print_result(record, True)
        return
    base = record["base"]
    console.print(f"eval set v{record['eval_set_version']}: base model success "
                  f"{base['success_rate']:.1%}, invalid outputs {base['invalid_rate']:.1%}, "
                  f"unsafe {base['unsafe_rate']:.1%} over {base['samples']} attempts")
    for group, rate in base["groups"].items():
        console.print(f"  {group:<28} {rate:.1%} ({base['group_samples'][group]} attempts)")
    if record["production"]:
        console.print(f"production v{record['production']['version']}: success "
                      f"{record['production']['success_rate']:.1%}")
    console.print(f"next stage: [bold]{record['recommendation']}[/bold] — {record['reason']}")
