"""Type-aware argument matching: is the model's argument value the one that was expected?

The tool's JSON schema decides what "equal" means, so harmless spelling differences of the
same value do not cost reward:

* `number` / `integer`: numeric equality; `1`, `1.0` and `"1"` are the same value.
* `boolean`: `true` and `"true"` (any case) are the same value; `1` is not a boolean.
* `string`: surrounding whitespace is stripped and inner runs collapse to one space; the
  comparison stays case-sensitive (a name or an id in another case is another value).
* `enum` / `const`: exact JSON equality, no normalisation (the allowed spellings are listed).
* `object`: key order never matters; missing or extra keys are mismatches.
* `array`: order matters, unless the schema says `uniqueItems: true` (a set) or
  `x-unordered: true`, in which case it is compared as a multiset.
* `anyOf` / `oneOf` / a list of types: a match under any alternative is a match.
* no schema: the same rules by the values' own JSON types (strings still whitespace-folded).

An optional argument given as `null`, or equal to its schema `default`, counts as absent on
either side: `attendees=[]` where the default is `[]` is the same call as omitting it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

Schema = Mapping[str, Any]


def fold_ws(text: str) -> str:
    return " ".join(text.split())


def _as_number(value: object) -> int | float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


def _numbers_equal(a: object, b: object) -> bool:
    x, y = _as_number(a), _as_number(b)
    if x is None or y is None:
        return False
    if isinstance(x, int) and isinstance(y, int):
        return x == y  # exact for ints beyond 2**53
    return math.isclose(x, y, rel_tol=1e-9, abs_tol=0.0)


def _as_bool(value: object) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return None


def _json_equal(a: object, b: object) -> bool:
    """Exact JSON equality: booleans are not numbers, 1 == 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _generic_equal(a: object, b: object) -> bool:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_generic_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_generic_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, str) and isinstance(b, str):
        return fold_ws(a) == fold_ws(b)
    if isinstance(a, int | float) and isinstance(b, int | float):
        return not isinstance(a, bool) and not isinstance(b, bool) and _numbers_equal(a, b)
    return _json_equal(a, b)


def _multiset_equal(expected: list[Any], actual: list[Any], item: Schema | None) -> bool:
    if len(expected) != len(actual):
        return False
    # Greedy pairing is exact here because every rule above is an equivalence relation.
    left = list(actual)
    for e in expected:
        hit = next((i for i, a in enumerate(left) if values_match(e, a, item)), None)
        if hit is None:
            return False
        left.pop(hit)
    return True


def values_match(expected: object, actual: object, schema: Schema | None = None) -> bool:
    """Whether `actual` is the same value as `expected` under `schema` (see module doc)."""
    if not schema:
        return _generic_equal(expected, actual)
    if "enum" in schema or "const" in schema:
        return _json_equal(expected, actual)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            rest = {k: v for k, v in schema.items() if k != key}
            return any(values_match(expected, actual, {**rest, **sub})
                       for sub in schema[key] if isinstance(sub, Mapping))
    kind = schema.get("type")
    if isinstance(kind, list):
        return any(values_match(expected, actual, {**schema, "type": k}) for k in kind)
    if kind in ("number", "integer"):
        return _numbers_equal(expected, actual)
    if kind == "boolean":
        e, a = _as_bool(expected), _as_bool(actual)
        return e is not None and e == a
    if kind == "string":
        return isinstance(expected, str) and isinstance(actual, str) and \
            fold_ws(expected) == fold_ws(actual)
    if kind == "null":
        return expected is None and actual is None
    if kind == "object":
        if not (isinstance(expected, Mapping) and isinstance(actual, Mapping)):
            return False
        return arguments_match(expected, actual, schema)[0] == 1.0
    if kind == "array":
        if not (isinstance(expected, list) and isinstance(actual, list)):
            return False
        item = schema.get("items") if isinstance(schema.get("items"), Mapping) else None
        if schema.get("uniqueItems") or schema.get("x-unordered"):
            return _multiset_equal(expected, actual, item)
        return len(expected) == len(actual) and all(
            values_match(e, a, item) for e, a in zip(expected, actual, strict=True))
    return _generic_equal(expected, actual)


def _property(schema: Schema | None, key: str) -> Schema | None:
    if not schema:
        return None
    props = schema.get("properties")
    if isinstance(props, Mapping) and isinstance(props.get(key), Mapping):
        return props[key]  # type: ignore[no-any-return]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, Mapping) else None


def _effective(args: Mapping[str, Any], schema: Schema | None) -> dict[str, Any]:
    """`args` without optional arguments that say nothing (null, or the schema default)."""
    required = set(schema.get("required", [])) if schema else set()
    kept = {}
    for key, value in args.items():
        prop = _property(schema, key)
        if key not in required and (
                value is None or (prop is not None and "default" in prop
                                  and values_match(prop["default"], value, prop))):
            continue
        kept[key] = value
    return kept


def arguments_match(expected: Mapping[str, Any], actual: Mapping[str, Any],
                    schema: Schema | None = None) -> tuple[float, dict[str, list[str]]]:
    """Share of argument names (expected ∪ given) whose values match, and the mismatches.

    An extra or a missing argument counts against the share, so 1.0 means an exact match.
    """
    exp, act = _effective(expected, schema), _effective(actual, schema)
    keys = sorted(exp.keys() | act.keys())
    missing = [k for k in keys if k not in act]
    extra = [k for k in keys if k not in exp]
    wrong = [k for k in keys if k in exp and k in act
             and not values_match(exp[k], act[k], _property(schema, k))]
    bad = len(missing) + len(extra) + len(wrong)
    share = 1.0 if not keys else (len(keys) - bad) / len(keys)
    return share, {"missing": missing, "extra": extra, "wrong": wrong}
