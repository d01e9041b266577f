"""`make gpu-bundle` carries everything the GPU paths import: the trainer, the local engine,
`flywheel bench gpu` and the tests infra/gpu-check.sh runs on a bare machine, which has only
torch, transformers, peft and pytest (and what they require). Every distribution those
modules import is either one of those, required by them, or in the bundle's list
(infra/gpu-bundle.sh's PACKAGES); otherwise the bare machine would fail at import."""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
MACHINE = ("torch", "transformers", "peft", "pytest")
GPU_MODULES = ("flywheel.trainer.engine", "flywheel.policy.local", "flywheel.bench.gpu",
               "flywheel.cli.bench", "tests.conftest", "tests.test_trainer_gpu",
               "tests.test_trainer_precision", "tests.test_policy_prefix_attention",
               "tests.test_policy_memory")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _bundle_list() -> set[str]:
    text = (ROOT / "infra" / "gpu-bundle.sh").read_text()
    body = re.search(r"PACKAGES=\(([^)]*)\)", text)
    assert body is not None, "infra/gpu-bundle.sh lost its PACKAGES list"
    return {_norm(n) for n in body.group(1).split()}


def _required(names: tuple[str, ...]) -> set[str]:
    """The distributions `names` require, transitively (extras left out)."""
    seen: set[str] = set()
    todo = [_norm(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for req in reqs:
            if "extra ==" in req:
                continue
            todo.append(_norm(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0]))
    return seen


MACHINE_IMPORTS = """
import torch, transformers, peft, pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask
import transformers.models.llama.modeling_llama
from peft import LoraConfig, PeftModel, get_peft_model
"""
"""What the machine's own packages import when the GPU paths use them: whatever else they
import when it happens to be installed (boto3, protobuf, …) is theirs, not ours."""


def test_the_bundle_covers_what_the_gpu_paths_import() -> None:
    code = ("import sys, json\n" + MACHINE_IMPORTS
            + "before = {m.split('.')[0] for m in sys.modules}\n"
            + "".join(f"import {m}\n" for m in GPU_MODULES)
            + "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} - before)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True)
    top = set(json.loads(out.stdout.strip().splitlines()[-1]))
    ours = {"flywheel", "tests", "consumers", "producers"}
    owners = md.packages_distributions()
    used = {_norm(d) for m in top - set(sys.stdlib_module_names) - ours
            for d in owners.get(m, [])}
    machine = _required(MACHINE)
    bundle = _bundle_list()
    # jsonschema imports these format checkers when they are installed, never needs them.
    optional = {"jsonpointer", "rfc3339-validator", "rfc3987", "uri-template", "webcolors",
                "fqdn", "isoduration", "idna"}
    missing = used - machine - bundle - optional
    assert missing == set(), f"add these to infra/gpu-bundle.sh: {missing}"
    # And the list holds nothing the GPU paths never import (but the test plugin and what
    # the imported ones require).
    unused = bundle - used - _required(tuple(bundle & used)) - {"pytest-asyncio"}
    assert unused == set(), f"infra/gpu-bundle.sh bundles what nothing imports: {unused}"
