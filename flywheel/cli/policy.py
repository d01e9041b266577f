"""`flywheel policy`: facts about the configured policy that deployments need."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from flywheel.cli.common import JsonOpt, console, fail, load_settings, print_result

policy_app = typer.Typer(no_args_is_help=True, help="The configured policy (model, chat format).")


def chat_format_info() -> dict[str, Any]:
    """The policy's chat format and the template file vLLM must serve (`--chat-template`)."""
    from flywheel.policy.chat_format import ChatFormatError
    from flywheel.policy.factory import policy_chat_format
    from flywheel.policy.model_cache import resolve_model_dir

    settings = load_settings()
    model_dir = resolve_model_dir(settings.rollout.model_dir)
    try:
        fmt = policy_chat_format(settings)
    except ChatFormatError as err:
        fail(str(err))
    path = fmt.path
    if path is None and (model_dir / "chat_template.jinja").is_file():
        path = model_dir / "chat_template.jinja"  # the model's own, as a file vLLM can read
    return {**fmt.describe(), "path": None if path is None else str(path),
            "setting": settings.rollout.chat_template, "model_dir": str(model_dir)}


@policy_app.command("chat-template")
def chat_template(
    write: Annotated[Path | None, typer.Option(
        help="Also write the template to this .jinja file (and its response template "
             "beside it), e.g. onto a volume a vLLM image mounts; then print that path.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print the chat template file of the policy's format, for `vllm serve --chat-template`
    (rollouts, the gate, SFT and serving must all render prompts with it)."""
    info = chat_format_info()
    if write is not None:
        from flywheel.policy.factory import policy_chat_format

        if write.suffix != ".jinja":
            fail(f"--write needs a .jinja path, got {write}")
        policy_chat_format(load_settings()).write(write)
        info["path"] = str(write)
    if as_json:
        print_result(info, True)
        return
    if info["path"] is None:
        fail(f"the policy uses the model's own chat template ({info['version']}), which its "
              "tokenizer carries but no file holds; start vLLM without --chat-template")
    console.print(f"chat format {info['version']} (rollout.chat_template: {info['setting']})")
    print(info["path"])
