"""The `flywheel` command line (typer + rich)."""
