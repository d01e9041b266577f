"""`flywheel losses`: what lost bundled brokers took with them (`flywheel.runtime.losses`).

A loss stays in `flywheel status` (and here) until an operator acknowledges it.
"""

from __future__ import annotations

from typing import Annotated

import typer

from flywheel.cli.common import JsonOpt, console, fail, load_settings, print_result

losses_app = typer.Typer(no_args_is_help=True,
                         help="Records a lost bundled broker had acknowledged, not stored.")


@losses_app.command("ls")
def ls(as_json: JsonOpt = False) -> None:
    """Losses not acknowledged yet, per topic (recounted while SDK clients re-send)."""
    from flywheel.runtime.losses import Losses

    print_result(Losses(load_settings().home).open(), as_json)


@losses_app.command("ack")
def ack(loss_id: Annotated[str | None, typer.Argument(
            help="The loss to acknowledge (`flywheel losses ls`).")] = None,
        every: Annotated[bool, typer.Option("--all", help="Acknowledge every open loss.")]
        = False) -> None:
    """Acknowledge a loss (it leaves `flywheel status`)."""
    if (loss_id is None) == (not every):
        fail("name one loss id, or pass --all")
    try:
        from flywheel.runtime.losses import acknowledge

        marked = acknowledge(load_settings().home, loss_id)
    except LookupError as err:
        fail(str(err))
    console.print(f"acknowledged {len(marked)} loss(es): {', '.join(marked) or 'none open'}")
