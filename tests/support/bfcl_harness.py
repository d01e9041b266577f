"""BFCL cases as flywheel tasks, and the calls the differential test scores (test helper).

A BFCL case is a question, function docs (BFCL's Python-ish types: `dict`, `float`,
`tuple`, `any`, …) and a possible answer (each parameter maps to a list of acceptable
values; `""` means "may be omitted"). `convert` turns docs into OpenAI JSON schema and the
possible answer into `ExpectedCall`s; `generated_calls` makes the reference call (every
parameter at its first choice) and perturbations of it. Only the data comes from BFCL.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flywheel.tasks import ExpectedCall, ToolCallSpec

CATEGORIES = {"simple_python": 100, "multiple": 60, "parallel": 60, "parallel_multiple": 60,
              "live_simple": 60, "live_multiple": 80, "live_parallel": 16,
              "live_parallel_multiple": 24}
"""Category → cases drawn (live_parallel* are taken whole: 16 and 24 cases)."""
SEED = 20240_3
_TYPES = {"dict": "object", "float": "number", "integer": "integer", "string": "string",
          "boolean": "boolean", "array": "array", "tuple": "array"}
_JSON = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
         dict: "object", type(None): "null"}
_MAX_COMBOS = 64
Calls = list[tuple[str, dict[str, Any]]]


@dataclass(frozen=True)
class Case:
    id: str
    category: str
    functions: list[dict[str, Any]]
    answer: list[dict[str, dict[str, list[Any]]]]
    tools: list[dict[str, Any]]
    spec: ToolCallSpec


def to_schema(doc: dict[str, Any]) -> dict[str, Any]:
    """One BFCL parameter doc as JSON schema (`any` and unknown types: no type)."""
    out: dict[str, Any] = {}
    if doc.get("type") in _TYPES:
        out["type"] = _TYPES[doc["type"]]
    for key in ("enum", "default", "format", "required"):
        if key in doc:
            out[key] = doc[key]
    if isinstance(doc.get("items"), dict):
        out["items"] = to_schema(doc["items"])
    if isinstance(doc.get("properties"), dict):
        out["properties"] = {k: to_schema(v) for k, v in doc["properties"].items()}
    return out


def _fits(value: Any, schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    actual = _JSON.get(type(value))
    return kind is None or actual == kind or (kind == "number" and actual == "integer")


def _widened(schema: dict[str, Any], values: list[Any]) -> dict[str, Any]:
    """BFCL accepts a value of the possible answer's type where it differs from the doc's
    (its "variable" rule, e.g. "dontcare" for an integer): say so in the schema."""
    extra = sorted({_JSON[type(v)] for v in values if not _fits(v, schema)})
    return {"anyOf": [schema, *({"type": t} for t in extra)]} if extra else schema


def _combos(nested: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """A nested possible answer `{key: [alternatives]}` as whole dicts (BFCL's dict rule)."""
    omit = object()
    keys = list(nested)
    options = [[v for v in nested[k] if v != ""] + ([omit] if "" in nested[k] else [])
               for k in keys]
    return [{k: v for k, v in zip(keys, pick, strict=True) if v is not omit}
            for pick in itertools.islice(itertools.product(*options), _MAX_COMBOS + 1)]


def _values(values: list[Any], doc: dict[str, Any]) -> list[Any]:
    if doc.get("type") == "dict":
        return [c for v in values for c in (_combos(v) if isinstance(v, dict) else [v])]
    if doc.get("type") == "array" and doc.get("items", {}).get("type") == "dict":
        out = []
        for v in values:
            per_item = [_combos(d) if isinstance(d, dict) else [d] for d in v]
            out += [list(p) for p in itertools.islice(itertools.product(*per_item),
                                                      _MAX_COMBOS + 1)]
        return out
    return values


def convert(raw: dict[str, Any], answer: dict[str, Any], category: str) -> Case | str:
    """The case as a flywheel task, or why it cannot be one."""
    docs = {f["name"]: f for f in raw["function"]}
    tools, expected = [], []
    for f in raw["function"]:
        params = f["parameters"]
        props = {k: to_schema(v) for k, v in params.get("properties", {}).items()}
        tools.append({"type": "function", "name": f["name"],
                      "parameters": {"type": "object", "properties": props,
                                     "required": params.get("required", [])}})
    for call in answer["ground_truth"]:
        ((name, params),) = call.items()
        doc = docs[name]["parameters"].get("properties", {})
        tool = next(t for t in tools if t["name"] == name)
        arguments, alternatives, optional = {}, {}, []
        for key, alts in params.items():
            values = _values([v for v in alts if v != ""], doc.get(key, {}))
            if len(values) > _MAX_COMBOS:
                return f"{key}: more than {_MAX_COMBOS} nested combinations"
            if "" in alts:
                optional.append(key)
            elif not values:
                return f"{key}: no acceptable value and not optional"
            if key in tool["parameters"]["properties"]:
                props = tool["parameters"]["properties"]
                props[key] = _widened(props[key], values)
            if values and alts[0] != "":
                arguments[key] = values[0]
                values = values[1:]
            if values:
                alternatives[key] = values
        expected.append(ExpectedCall(name=name, arguments=arguments,
                                     alternatives=alternatives, optional=optional))
    return Case(raw["id"], category, raw["function"], answer["ground_truth"], tools,
                ToolCallSpec(expected=expected))


def load(data: Path, category: str, n: int, seed: int = SEED) -> tuple[list[Case], list[str]]:
    """`n` cases of `category` drawn with `seed`, and the reasons the others were skipped."""
    questions = [json.loads(line) for line in (data / f"BFCL_v4_{category}.json").open()]
    answers = {a["id"]: a for a in (json.loads(line) for line in
                                    (data / "possible_answer" / f"BFCL_v4_{category}.json")
                                    .open())}
    picked = random.Random(f"{seed}:{category}").sample(questions, min(n, len(questions)))
    cases, skipped = [], []
    for raw in picked:
        case = convert(raw, answers[raw["id"]], category)
        if isinstance(case, str):
            skipped.append(f"{raw['id']}: {case}")
        else:
            cases.append(case)
    return cases, skipped


def reference(spec: ToolCallSpec) -> Calls:
    return [(c.name, dict(c.arguments)) for c in spec.expected]


def _other_type(v: Any) -> Any:
    return {str: 42, bool: 1, int: True, float: True, list: "x", dict: ["x"]}.get(type(v), "x")


def _other_value(v: Any) -> Any:
    if isinstance(v, bool):
        return not v
    if isinstance(v, int | float):
        return v + (1 if isinstance(v, int) else 1.5)
    if isinstance(v, str):
        return v + " again"
    if isinstance(v, list):
        return [*v, v[0]] if v else ["x"]
    if isinstance(v, dict):
        return {**v, "zz_extra": 1}
    return "x"


def _sample_value(schema: dict[str, Any]) -> Any:
    kind = schema.get("type") or (schema.get("anyOf") or [{}])[0].get("type")
    return {"string": "extra", "integer": 7, "number": 2.5, "boolean": True, "array": [],
            "object": {}}.get(kind, "extra")


def _scalar_edits(v: Any) -> dict[str, Any]:
    """Perturbation kind → the edited value, for the kinds that apply to `v`."""
    out: dict[str, Any] = {"wrong_type": _other_type(v), "wrong_value": _other_value(v)}
    if isinstance(v, int) and not isinstance(v, bool):
        out["int_float"] = float(v)
    elif isinstance(v, float) and v.is_integer():
        out["int_float"] = int(v)
    elif isinstance(v, list) and v and all(type(x) in (int, float) for x in v):
        ints = any(isinstance(x, int) for x in v)
        if ints or all(x.is_integer() for x in v):
            out["int_float"] = [float(x) if ints else int(x) for x in v]
    if type(v) in (int, float):
        out["numeric_string"] = str(v)
    if isinstance(v, str) and v.swapcase() != v:
        out["case"] = v.swapcase()
    if isinstance(v, str) and v:
        out["spaces"] = " " + v.replace(" ", "  ") if " " in v else v + " "
    return out


def generated_calls(case: Case, rng: random.Random) -> list[tuple[str, Calls]]:
    """(kind, calls): the reference and its perturbations, deterministic for `rng`."""
    ref = reference(case.spec)
    out: list[tuple[str, Calls]] = [("reference", ref)]

    def edit(i: int, args: dict[str, Any]) -> Calls:
        return [(n, args if j == i else a) for j, (n, a) in enumerate(ref)]

    alt = [(n, {**a, **{k: rng.choice(v) for k, v in c.alternatives.items() if v}})
           for (n, a), c in zip(ref, case.spec.expected, strict=True)]
    if alt != ref:
        out.append(("alternative", alt))
    omit = [(n, {k: v for k, v in a.items() if k not in c.optional})
            for (n, a), c in zip(ref, case.spec.expected, strict=True)]
    if omit != ref:
        out.append(("omit_optional", omit))
    names = [f["name"] for f in case.functions]
    other = next((x for x in names if x != ref[0][0]), ref[0][0] + "_v2")
    out.append(("wrong_name", [(other, ref[0][1]), *ref[1:]]))
    i = rng.randrange(len(ref))
    name, args = ref[i]
    schema = next(t for t in case.tools if t["name"] == name)["parameters"]
    if args:
        key = rng.choice(sorted(args))
        out.append(("drop_arg", edit(i, {k: v for k, v in args.items() if k != key})))
        for kind, value in _scalar_edits(args[key]).items():
            out.append((kind, edit(i, {**args, key: value})))
    free = sorted(set(schema["properties"]) - set(args))
    extra_key = rng.choice(free) if free else "unexpected_flag"
    out.append(("extra_arg", edit(i, {**args, extra_key: _sample_value(
        schema["properties"].get(extra_key, {"type": "boolean"}))})))
    at_default = sorted(k for k in free if "default" in schema["properties"][k])
    if at_default:
        key = rng.choice(at_default)
        out.append(("default_given", edit(i, {**args, key: schema["properties"][key]["default"]})))
    written = sorted(k for k, v in args.items() if schema["properties"].get(k, {}).get(
        "default", object()) == v and k not in schema["required"])
    if written:
        out.append(("default_omitted", edit(i, {k: v for k, v in args.items()
                                                if k != rng.choice(written)})))
    optional = sorted(k for k in free if k not in schema["required"])
    if optional:
        out.append(("null_optional", edit(i, {**args, rng.choice(optional): None})))
    out.append(("extra_call", [*ref, ref[0]]))
    if len(ref) > 1:
        out.append(("reorder", ref[::-1]))
        out.append(("missing_call", ref[:-1]))
    return out
