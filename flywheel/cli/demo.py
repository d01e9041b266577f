"""`flywheel simulate` (realistic agent traffic as JSONL) and `flywheel demo` (the whole loop)."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from flywheel.cli.common import load_settings


def simulate(
    agents: Annotated[int, typer.Option(
        help="Simulated agents (1-4: support, ops, code, and a helpdesk agent in multi-turn "
             "conversations on its registered toolset `workplace`).")] = 3,
    n: Annotated[int, typer.Option(help="Trajectories to write.")] = 2000,
    failure_rate: Annotated[float, typer.Option(help="Share of failed attempts.")] = 0.3,
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same output).")] = 0,
    chat_share: Annotated[float, typer.Option(help="Share written as Chat Completions "
                                              "transcripts.")] = 0.2,
) -> None:
    """Write realistic agent trajectories as JSONL to stdout (pipe into `flywheel publish -`)."""
    from flywheel.demo.simulate import simulate as run

    out = sys.stdout
    for record in run(n, agents=agents, failure_rate=failure_rate, seed=seed,
                      chat_share=chat_share):
        out.write(json.dumps(record) + "\n")


def demo(keep: Annotated[bool, typer.Option(help="Leave the stack running afterwards.")] = False,
         minutes: Annotated[float, typer.Option(help="Time budget of the whole demo.")] = 20.0,
         seed: Annotated[int | None, typer.Option(
             help="Seed of the simulated traffic (tasks, holdout split); default: a new one "
                  "each run, printed.")] = None,
         ) -> None:
    """The whole loop on the embedded default: trajectories → tasks → baseline → SFT/GRPO →
    gate → promotion decisions; writes .flywheel/demo-summary.json."""
    from flywheel.demo.run import run_demo

    raise typer.Exit(run_demo(load_settings(), keep=keep, minutes=minutes, seed=seed))
