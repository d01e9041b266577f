"""What Postgres cannot store, found in a decoded JSON value (pure, no I/O).

Checked on the decoded value, keys included, never on the bytes: the JSON text
`"C:\\\\u0000file"` (a backslash, then `u0000`) holds no NUL and is fine.

* NUL (`\\u0000`): neither `text` nor `jsonb` can hold it.
* A lone surrogate (`\\ud800` without its pair): not Unicode at all; it cannot be encoded
  as UTF-8, so no column, no log line and no hash of the record could take it.
* NaN, Infinity, or a number beyond a double (`1e400` decodes to infinity): JSON has no such
  numbers (RFC 8259) and `jsonb` refuses them, so they are refused rather than turned into
  `null` or a string behind the sender's back.
* Nesting deeper than `MAX_DEPTH`: the pydantic parser and Postgres both stop somewhere;
  one limit everywhere means the gateway and Kafka decide alike.
"""

from __future__ import annotations

import math
import re
from typing import Any

from flywheel.ingest.fastpath import MAX_DEPTH

TOO_DEEP = (f"arrays/objects are nested too deeply to store; keep nesting under {MAX_DEPTH} "
            "levels (e.g. send deep values as JSON strings)")
_NUL = ("contains a NUL character (\\u0000), which Postgres cannot store; remove it (the text"
        " backslash-u0000 is fine)")
_SURROGATE = ("contains a lone surrogate (a \\ud800-\\udfff escape without its pair), which "
              "is not valid Unicode and cannot be stored; send the character it stands for")
_NOT_FINITE = ("is NaN, Infinity or a number beyond ±1.8e308, which JSON does not allow and "
               "Postgres cannot store; send null or a finite number")
_SURROGATES = re.compile("[\ud800-\udfff]")
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_\-]+")

Path = tuple[str | int, ...]
_CONTAINERS = (dict, list, tuple)


def _text_problem(s: str) -> str | None:
    if "\x00" in s:
        return _NUL
    if not s.isascii() and _SURROGATES.search(s):
        return _SURROGATE
    return None


def text_problem(s: str) -> str | None:
    """Why one string cannot be stored (a NUL, a lone surrogate), or None."""
    return _text_problem(s)


def _where(path: Path) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.fullmatch(part):
            out += f".{part}" if out else part
        else:  # ascii(): the location itself must be storable text
            out += f"[{part!a}]"
    return out or "(root)"


def unstorable(doc: Any) -> str | None:
    """Why `doc` (a decoded JSON value) cannot be stored as sent, or None when it can.

    Iterative, so a deep document cannot exhaust the stack. The first pass only looks (the
    common, clean case); a problem is then located by a second pass that keeps the path
    (`metadata.notes[2]: contains a NUL character …`).
    """
    return None if _clean(doc) else _locate(doc)


def _clean(doc: Any) -> bool:
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        node, depth = stack.pop()
        kind = type(node)
        if kind is str:
            if _text_problem(node):
                return False
        elif kind is float:
            if not math.isfinite(node):
                return False
        elif kind is dict:
            if depth >= MAX_DEPTH:
                return False
            for key, value in node.items():
                if type(key) is str and _text_problem(key):
                    return False
                stack.append((value, depth + 1))
        elif kind is list:
            if depth >= MAX_DEPTH:
                return False
            stack.extend((value, depth + 1) for value in node)
        elif isinstance(node, dict | list | tuple):  # built in Python (the SDK): look inside
            return False  # rare; `_locate` has the general walk
        elif _scalar_problem(node) is not None:  # str/float subclasses
            return False
    return True


def _locate(doc: Any) -> str | None:
    problem = _scalar_problem(doc)
    if problem is not None:
        return f"(root): {problem}"
    stack: list[tuple[Any, int, Path]] = [(doc, 1, ())] if isinstance(doc, _CONTAINERS) else []
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            # No location: past a few hundred levels the JSON parser itself gives up first,
            # at a depth that depends on the process, and the words must not.
            return TOO_DEEP
        children = node.items() if isinstance(node, dict) else enumerate(node)
        pending = []
        for key, value in children:
            if isinstance(key, str) and (problem := _text_problem(key)) is not None:
                return f"{_where(path)}: a key {problem}"
            if isinstance(value, _CONTAINERS):
                pending.append((value, depth + 1, (*path, key)))
            elif (problem := _scalar_problem(value)) is not None:
                return f"{_where((*path, key))}: {problem}"
        stack.extend(reversed(pending))  # document order: the first problem is reported
    return None


def _scalar_problem(value: Any) -> str | None:
    if isinstance(value, str):
        return _text_problem(value)
    if isinstance(value, float) and not math.isfinite(value):
        return _NOT_FINITE
    return None
