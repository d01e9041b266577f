"""`flywheel` CLI entry point: the command tree. The commands live in modules by what they
do; each imports what is heavy inside the command, so `--help` loads only typer and rich."""

from __future__ import annotations

import typer

from flywheel.cli.baseline import baseline
from flywheel.cli.bench import bench_app
from flywheel.cli.demo import demo, simulate
from flywheel.cli.losses import losses_app
from flywheel.cli.policy import policy_app
from flywheel.cli.publish import publish
from flywheel.cli.review import adapters_app, promotions_app, replay
from flywheel.cli.stack import down, migrate, status, up
from flywheel.cli.tasks import evalset_app, tasks_app
from flywheel.cli.tools import tools_app
from flywheel.cli.verify import verify_app
from flywheel.cli.vllm import vllm_app

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Flywheel: production agent failures → better models, safely.")
for name, group in [("bench", bench_app), ("tasks", tasks_app), ("evalset", evalset_app),
                    ("verify", verify_app), ("policy", policy_app),
                    ("promotions", promotions_app), ("vllm", vllm_app),
                    ("adapters", adapters_app), ("losses", losses_app), ("tools", tools_app)]:
    app.add_typer(group, name=name)
for command in [replay, publish, baseline, up, down, migrate, status, simulate, demo]:
    app.command()(command)  # type: ignore[type-var]  # a list of functions of many shapes


def main() -> None:
    app()


if __name__ == "__main__":
    main()
