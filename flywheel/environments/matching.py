"""Strict argument matching: is the model's argument value one that was expected?

The tool's JSON schema types the *model's* value strictly (the expected values are data a
person wrote and are compared by value); a value of the wrong JSON type never matches:

* `integer`: a JSON integer only — not `"5"`, not `5.0` (BFCL's checker rejects both), not
  `true`. `number`: an integer or a float, never a string. Values compare numerically
  (`5 == 5.0` for a `number`; `math.isclose` with rel_tol 1e-9).
* `boolean`: `true`/`false` only — not `"true"`, not `1`. `null`: `null` only.
* `string`: a JSON string only, never a number or a boolean. Free text compares after
  `fold_text` (BFCL's `standardize_string` rule: lower case, no whitespace, none of
  `,./-_*^`, `'` read as `"`), so "April 1, 2024" is "april 1 2024". A string the schema
  constrains — `enum`, `const`, `pattern` or `format` — compares exactly: there the spelling
  is the value (a schema-validating tool rejects "Celsius" for `enum: ["celsius"]`).
* `enum` / `const` on any type: the schema's type check, then exact JSON equality.
* `object`: key order never matters; properties recursively, missing or extra keys are
  mismatches. `array`: same length, items recursively (`items`, `prefixItems` for tuples),
  in order unless `uniqueItems: true` or `x-unordered: true` (then a multiset).
* `anyOf` / `oneOf` / a list of types: a match under any alternative is a match.
* no type in the schema: the values' own JSON types, by the same rules (numbers by value).

An argument the schema does not require counts as absent, on either side, when it is given
as its schema `default` (the tool behaves the same) or as `null` where its schema admits
null (`"type": ["string", "null"]`, strict-mode style) or it has no schema. A `null` the
schema does not admit is a wrong value, as a JSON-schema validator (and BFCL) says. BFCL's
checker calls a parameter given at its default unexpected unless its possible answer lists
it: docs/VERIFIER.md measures where that makes the two disagree.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

Schema = Mapping[str, Any]
_FOLDED = re.compile(r"[\s,./\-_*^]")


def fold_ws(text: str) -> str:
    return " ".join(text.split())


def fold_text(text: str) -> str:
    """Free text as compared (see module doc): "San Francisco, CA" → "sanfranciscoca"."""
    return _FOLDED.sub("", text).lower().replace("'", '"')


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _numbers_equal(a: object, b: object) -> bool:
    if not (isinstance(a, int | float) and isinstance(b, int | float)
            and _is_number(a) and _is_number(b)):
        return False
    if isinstance(a, int) and isinstance(b, int):
        return a == b  # exact for ints beyond 2**53
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def _json_equal(a: object, b: object) -> bool:
    """Exact JSON equality: booleans are not numbers, 1 == 1.0, no string folding."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if _is_number(a) or _is_number(b):
        return _numbers_equal(a, b)
    return a == b


_KIND_OF = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}


_JSON_TYPES = frozenset(_KIND_OF.values())


def _kind(value: object) -> str | None:
    return _KIND_OF.get(type(value))


def _has_type(value: object, kind: str) -> bool:
    """Whether `value` is a JSON value of schema type `kind` (integer ⊂ number)."""
    actual = _kind(value)
    return actual == kind or (kind == "number" and actual == "integer")


def _items_schema(schema: Schema, index: int) -> Schema | None:
    prefix = schema.get("prefixItems")
    if isinstance(prefix, list) and index < len(prefix) and isinstance(prefix[index], Mapping):
        return prefix[index]  # type: ignore[no-any-return]
    item = schema.get("items")
    return item if isinstance(item, Mapping) else None


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


def _typed_match(expected: object, actual: object, kind: str, schema: Schema) -> bool:
    if not _has_type(actual, kind):
        return False
    if kind in ("integer", "number"):
        return _numbers_equal(expected, actual)
    if isinstance(expected, str) and isinstance(actual, str):
        if any(k in schema for k in ("pattern", "format")):
            return expected == actual
        return fold_text(expected) == fold_text(actual)
    if isinstance(expected, Mapping) and isinstance(actual, Mapping):
        return arguments_match(expected, actual, schema)[0] == 1.0
    if isinstance(expected, list) and isinstance(actual, list):
        if schema.get("uniqueItems") or schema.get("x-unordered"):
            item = schema.get("items")
            return _multiset_equal(expected, actual, item if isinstance(item, Mapping) else None)
        return len(expected) == len(actual) and all(
            values_match(e, a, _items_schema(schema, i))
            for i, (e, a) in enumerate(zip(expected, actual, strict=True)))
    return kind in ("boolean", "null") and _json_equal(expected, actual)


def values_match(expected: object, actual: object, schema: Schema | None = None) -> bool:
    """Whether `actual` is the same value as `expected` under `schema` (see module doc)."""
    schema = schema or {}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            rest = {k: v for k, v in schema.items() if k != key}
            return any(values_match(expected, actual, {**rest, **sub})
                       for sub in schema[key] if isinstance(sub, Mapping))
    kind = schema.get("type")
    if isinstance(kind, list):
        return any(values_match(expected, actual, {**schema, "type": k}) for k in kind)
    if kind not in _JSON_TYPES:
        kind = _kind(expected)  # untyped: judged by the expected value's own JSON type
        if kind is None:
            return False
        if kind == "integer":
            kind = "number"  # an untyped 5 may be written 5.0
    if "enum" in schema or "const" in schema:
        return _has_type(actual, kind) and _json_equal(expected, actual)
    return _typed_match(expected, actual, kind, schema)


def _property(schema: Schema | None, key: str) -> Schema | None:
    if not schema:
        return None
    props = schema.get("properties")
    if isinstance(props, Mapping) and isinstance(props.get(key), Mapping):
        return props[key]  # type: ignore[no-any-return]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, Mapping) else None


def says_nothing(key: str, value: object, schema: Schema | None) -> bool:
    """An optional argument given as its schema default, or as null where null is a value
    its schema admits: the same as absent."""
    if schema and key in (schema.get("required") or ()):
        return False
    prop = _property(schema, key)
    if value is None:
        return prop is None or values_match(None, None, prop)
    return prop is not None and "default" in prop and values_match(prop["default"], value, prop)


def arguments_match(expected: Mapping[str, Any], actual: Mapping[str, Any],
                    schema: Schema | None = None, *,
                    alternatives: Mapping[str, Sequence[Any]] | None = None,
                    optional: Collection[str] = ()) -> tuple[float, dict[str, list[str]]]:
    """Share of the arguments that match, and the mismatches by kind.

    `expected` is the canonical call; `alternatives[k]` further acceptable values of `k`;
    `optional` names arguments that may be left out (never one the schema requires).
    Counted are the arguments given and those missing; a left-out argument whose omission
    is fine counts as a match when the canonical call has it. 1.0 means an exact match.
    """
    alternatives = alternatives or {}
    required = set(schema.get("required") or ()) if schema else set()
    given = {k: v for k, v in actual.items() if not says_nothing(k, v, schema)}
    out: dict[str, list[str]] = {"missing": [], "extra": [], "wrong": []}
    good = counted = 0
    for key in sorted({*expected, *alternatives, *given}):
        accepted = ([expected[key]] if key in expected else []) + list(alternatives.get(key, []))
        if key in given:
            counted += 1
            prop = _property(schema, key)
            if any(values_match(v, given[key], prop) for v in accepted):
                good += 1
            else:
                out["wrong" if accepted else "extra"].append(key)
            continue
        omissible = key not in required and (
            key in optional or any(says_nothing(key, v, schema) for v in accepted))
        if not omissible:
            counted += 1
            out["missing"].append(key)
        elif key in expected and not says_nothing(key, expected[key], schema):
            counted += 1
            good += 1
    return (1.0 if not counted else good / counted), out
