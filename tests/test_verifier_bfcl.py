"""Differential test: the tool_call verifier against BFCL's AST checker, the field's yardstick.

Cases are BFCL's own (question, function docs, possible answer), drawn with a fixed seed
from simple, multiple, parallel and live categories; each is scored with its reference
call and perturbations of it (`bfcl_harness`). The oracle is `ast_checker(...)["valid"]`;
ours is `verify_calls(...).reward == 1.0`. Every disagreement must fall in a class that
docs/VERIFIER.md explains; the numbers there come from `pytest -s` on this file.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from flywheel.environments.calls import Call
from flywheel.environments.scoring import verify_calls
from flywheel.environments.tool_call import ToolCallEnvironment
from tests.support.bfcl_harness import (
    CATEGORIES,
    SEED,
    Calls,
    Case,
    generated_calls,
    load,
    reference,
)

bfcl_eval = pytest.importorskip(
    "bfcl_eval", reason="bfcl-eval (BFCL's data and AST checker) is a test-only dependency; "
    "`make install` installs it with --no-deps")
DATA = Path(bfcl_eval.__file__).parent / "data"
MODEL = "flywheel"


def _checker() -> Any:
    # The checker's package imports a registry of dozens of model SDKs through
    # `constants.model_config`; it only reads `underscore_to_dot` of the model named.
    name = "bfcl_eval.constants.model_config"
    registry = sys.modules.setdefault(name, types.ModuleType(name))
    if not hasattr(registry, "MODEL_CONFIG_MAPPING"):
        registry.MODEL_CONFIG_MAPPING = {}  # type: ignore[attr-defined]
    registry.MODEL_CONFIG_MAPPING.setdefault(
        MODEL, types.SimpleNamespace(underscore_to_dot=False))
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    return lambda case, calls: ast_checker(
        case.functions, [{n: a} for n, a in calls], case.answer, Language.PYTHON,
        case.category, MODEL)


def _message(calls: Calls) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{n}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(args)}}
        for n, (name, args) in enumerate(calls)]}


def _explain(kind: str, case: Case, calls: Calls, bfcl_valid: bool, check: Any) -> str:
    """The documented class of a disagreement (docs/VERIFIER.md), or "unexplained"."""
    edited = _edited(case, calls)
    if not bfcl_valid and len(calls) > 1 and any(
            check(case, list(order))["valid"] for order in itertools.permutations(calls)):
        return "bfcl_greedy_pairing"  # BFCL accepts the same calls in another order
    if bfcl_valid and kind in ("case", "spaces") and edited and all(
            "enum" in _property(case, name, key) for name, key in edited):
        return "enum_exact"
    if not bfcl_valid and kind in ("default_given", "default_omitted"):
        return "default_is_absent"
    if not bfcl_valid and kind == "int_float" and all(
            _property(case, name, key).get("items", {}).get("type") == "number"
            for name, key in edited):
        return "integers_in_float_array"
    return "unexplained"


def _edited(case: Case, calls: Calls) -> list[tuple[str, str]]:
    """(tool, argument) pairs whose value differs from the reference call's."""
    ref = reference(case.spec)
    if len(ref) != len(calls):
        return []
    return [(n, k) for (n, a), (_, b) in zip(calls, ref, strict=True)
            for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


def _property(case: Case, name: str, key: str) -> dict[str, Any]:
    tool = next((t for t in case.tools if t["name"] == name), None)
    schema = tool["parameters"]["properties"].get(key, {}) if tool else {}
    return schema.get("anyOf", [schema])[0]  # type: ignore[no-any-return]


def test_agrees_with_bfcl_ast_checker() -> None:
    check, env = _checker(), ToolCallEnvironment()
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for category, n in CATEGORIES.items():
        cases, skip = load(DATA, category, n)
        skipped += skip
        for case in cases:
            rng = random.Random(f"{SEED}:{case.id}")
            for kind, calls in generated_calls(case, rng):
                bfcl = check(case, calls)
                ours = verify_calls(case.spec, [Call(n, a) for n, a in calls], case.tools)
                # The main path (a parsed assistant message, arguments as JSON text) agrees.
                assert env.verify(case.spec, _message(calls), tools=case.tools) == ours
                row = {"id": case.id, "category": category, "kind": kind,
                       "bfcl": bool(bfcl["valid"]), "ours": ours.reward == 1.0}
                if row["bfcl"] != row["ours"]:
                    row["why"] = _explain(kind, case, calls, row["bfcl"], check)
                    row["detail"] = (bfcl.get("error_type"), str(bfcl.get("error"))[:160],
                                     ours.failure_mode, calls)
                rows.append(row)
    references = [r for r in rows if r["kind"] == "reference"]
    unsolvable = {r["id"] for r in references if not r["bfcl"]}
    scored = [r for r in rows if r["id"] not in unsolvable]
    agree = [r for r in scored if r["bfcl"] == r["ours"]]
    off = [r for r in scored if r["bfcl"] != r["ours"]]
    _report(scored, off, skipped, unsolvable)
    assert len({r["id"] for r in scored}) >= 400
    assert {r["category"] for r in scored} == set(CATEGORIES)
    assert all(r["ours"] for r in scored if r["kind"] == "reference")
    assert len(agree) / len(scored) >= 0.97
    unexplained = [(r["id"], r["kind"], r["detail"]) for r in off if r["why"] == "unexplained"]
    assert not unexplained, unexplained


def _report(scored: list[dict[str, Any]], off: list[dict[str, Any]], skipped: list[str],
            unsolvable: set[str]) -> None:
    print(f"\ncases {len({r['id'] for r in scored})}, calls scored {len(scored)}, agreement "
          f"{1 - len(off) / len(scored):.4f}; skipped {len(skipped)}, BFCL rejects its own "
          f"first answer in {len(unsolvable)}: {sorted(unsolvable)}")
    for s in skipped:
        print("  skipped", s)
    for category in CATEGORIES:
        mine = [r for r in scored if r["category"] == category]
        bad = sum(r["bfcl"] != r["ours"] for r in mine)
        print(f"  {category:24} cases {len({r['id'] for r in mine}):4} calls {len(mine):5} "
              f"agreement {1 - bad / len(mine):.4f}")
    kinds = Counter(r["kind"] for r in scored)
    valid = Counter(r["kind"] for r in scored if r["bfcl"])
    print("  by kind (calls, BFCL-valid):", {k: (kinds[k], valid[k]) for k in sorted(kinds)})
    print("  disagreements:", dict(Counter((r["why"], r["kind"], r["bfcl"]) for r in off)))
    for r in off:
        print("   ", r["why"], r["id"], r["kind"], "bfcl" if r["bfcl"] else "ours", r["detail"])
