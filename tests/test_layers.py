"""The package layering: no upward imports, no forbidden role edges, no import circles —
between packages or between the modules of one package — and no allowance left unused.

Every `import` in flywheel/, consumers/ and producers/ counts — at module level, inside
functions (lazy imports) and under `TYPE_CHECKING` — since each one is a dependency a reader
must follow. A unit is a subpackage of `flywheel` (`flywheel.gate`), a top-level module of
the vocabulary (`flywheel.config`, …), or the `consumers` / `producers` package.

The rules are plain functions of a source root, so the self-tests at the end run each of them
on a small fake tree in `tmp_path` and show that it fires on a planted violation (and stays
quiet on a clean tree).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("flywheel", "consumers", "producers")
VOCABULARY = {"config", "errors", "events", "trajectory", "tasks", "formats", "feedback",
              "responses_log", "toolsets"}
LAYERS: dict[str, int] = {
    # 0: the vocabulary, the ground floor: imports nothing else of ours
    **dict.fromkeys(VOCABULARY, 0),
    # 1: infrastructure and engines that know no domain process
    "db": 1, "runtime": 1, "policy": 1, "environments": 1, "web": 1, "tools": 1,
    # 2: domain stores and the processes' pure parts
    "adapters": 2, "ingest": 2, "mining": 2, "producers": 2,
    # 3: the loop's roles, and the OpenAI endpoint
    "rollout": 3, "trainer": 3, "gate": 3, "serving": 3, "validation": 3,
    # 4: read models of the whole pipeline: status reads every role's tables
    "observe": 4,
    # 5: what operators and the HTTP process use, and the local stack's supervisor
    "api": 5, "demo": 5, "bench": 5, "cli": 5, "stack": 5,
    # 6: the service entry points; nothing imports them
    "consumers": 6,
}
SAME_LAYER_ALLOWED = {
    ("cli", "stack"), ("demo", "stack"), ("bench", "stack"),  # they start the local stack
    ("runtime", "db"),        # consuming parks dead letters in the database (db.deadletters)
    ("producers", "ingest"),  # the SDK and replay validate exactly as ingest decodes
    ("gate", "rollout"),      # the gate evaluates by running rollout groups
    ("validation", "gate"),   # the validation pass scores with the gate's round machinery
    ("cli", "demo"), ("cli", "bench"), ("bench", "demo"),
    ("trajectory", "formats"),   # the wire format converts what agents log (pure dict → dict)
    ("trajectory", "responses_log"),
    ("feedback", "trajectory"), ("feedback", "formats"),  # feedback carries items, corrections
    ("config", "toolsets"),    # toolsets may be declared in the settings
    ("toolsets", "tasks"),     # a toolset's replay rule is the tasks' `ReplayRule`
    ("environments", "tools"),  # the `toolset` environment runs episodes on toolset sessions
    ("tools", "db"),           # registrations are versions in Postgres and events (outbox)
}
"""Edges inside one layer that are the design, not an accident (every other is refused);
each must be used by the tree, so an allowance cannot outlive the edge it was made for."""
FORBIDDEN = {("rollout", "trainer"), ("trainer", "gate"), ("gate", "trainer"),
             ("trainer", "rollout"), ("rollout", "gate")}
"""Role edges refused whatever the layers say."""
CIRCLES_INSIDE_ALLOWED: set[frozenset[str]] = set()
# None today. A circle that must stay names the exact set of its modules here, with why; the
# unused-allowance rule fails once it is gone.
"""Circles between the modules of one package, each the exact set of modules in it."""


def unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] in ("consumers", "producers"):
        return parts[0]
    if parts[0] != "flywheel" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(root: Path) -> Iterator[Path]:
    for top in TOPS:
        yield from sorted((root / top).rglob("*.py"))


def imports(path: Path, root: Path) -> Iterator[tuple[str, int]]:
    """Every module name `path` imports (`from a import b` yields `a.b`: a module when
    `b` is one), lazy, `TYPE_CHECKING` and relative imports included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                kept = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(kept + ([base] if base else []))
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def resolve(target: str, modules: set[str]) -> str | None:
    """The module of ours a dotted import name lands in (`flywheel.a.b.Name` → `flywheel.a.b`)."""
    parts = target.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def edges(root: Path) -> dict[tuple[str, str], list[str]]:
    """Unit → unit import edges, each with where it is made."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sources(root):
        src = unit(module_name(path, root))
        if src is None:
            continue
        for target, line in imports(path, root):
            dst = unit(target)
            if dst is not None and dst != src:
                found.setdefault((src, dst), []).append(
                    f"{path.relative_to(root)}:{line} imports {target}")
    return found


def module_graph(root: Path) -> dict[str, set[str]]:
    """Module → the modules of its own unit it imports."""
    paths = list(sources(root))
    modules = {module_name(p, root) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        src = module_name(path, root)
        for target, _line in imports(path, root):
            dst = resolve(target, modules)
            if dst is not None and dst != src and unit(dst) == unit(src) is not None:
                graph.setdefault(src, set()).add(dst)
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected sets of two or more nodes: every node of one reaches every
    other, so each lies on a circle (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                top = stack.pop()
                members.append(top)
                if top == node:
                    break
            if len(members) > 1:
                found.append(frozenset(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found, key=sorted)


def layering_violations(found: dict[tuple[str, str], list[str]],
                        allowed: set[tuple[str, str]] = SAME_LAYER_ALLOWED) -> list[str]:
    """Upward, sideways-but-not-allowed, vocabulary-leaving and forbidden role edges."""
    bad = []
    for (src, dst), where in sorted(found.items()):
        reasons = []
        if LAYERS[dst] > LAYERS[src]:
            reasons.append("upward")
        if LAYERS[dst] == LAYERS[src] and (src, dst) not in allowed:
            reasons.append("same layer, not allowed")
        if LAYERS[src] == 0 and dst not in VOCABULARY:
            reasons.append("the vocabulary imports outside itself")
        if (src, dst) in FORBIDDEN:
            reasons.append("forbidden role edge")
        if reasons:
            bad.append(f"{src} -> {dst} ({', '.join(reasons)}): " + "; ".join(where[:3]))
    return bad


def package_circles(found: Iterable[tuple[str, str]]) -> list[frozenset[str]]:
    graph: dict[str, set[str]] = {}
    for src, dst in found:
        graph.setdefault(src, set()).add(dst)
    return circles(graph)


def circles_inside(root: Path,
                   allowed: set[frozenset[str]] = CIRCLES_INSIDE_ALLOWED) -> list[frozenset[str]]:
    return [c for c in circles(module_graph(root)) if c not in allowed]


def unused_allowances(root: Path, allowed: set[tuple[str, str]] = SAME_LAYER_ALLOWED,
                      circles_allowed: set[frozenset[str]] = CIRCLES_INSIDE_ALLOWED,
                      ) -> list[str]:
    used = edges(root)
    present = set(circles(module_graph(root)))
    return ([f"edge {src} -> {dst}" for src, dst in sorted(allowed) if (src, dst) not in used]
            + [f"circle {' <-> '.join(sorted(c))}" for c in sorted(circles_allowed, key=sorted)
               if c not in present])


def show(found: Iterable[frozenset[str]]) -> str:
    return "; ".join(" <-> ".join(sorted(c)) for c in found)


# --- the tree ------------------------------------------------------------------------------


def test_every_package_has_a_layer() -> None:
    units = {p.name for p in (ROOT / "flywheel").iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    units = {u.removesuffix(".py") for u in units} - {"__init__"}
    assert units <= set(LAYERS), f"give these a layer in LAYERS: {sorted(units - set(LAYERS))}"


def test_no_upward_or_forbidden_imports() -> None:
    bad = layering_violations(edges(ROOT))
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_circles_between_packages() -> None:
    found = package_circles(edges(ROOT))
    assert not found, f"import circles between packages: {show(found)}"


def test_no_import_circles_inside_a_package() -> None:
    found = circles_inside(ROOT)
    assert not found, f"import circles inside a package: {show(found)}"


def test_every_allowance_is_used() -> None:
    unused = unused_allowances(ROOT)
    assert not unused, ("allowances the tree no longer needs (delete them): "
                        + "; ".join(unused))


# --- the checker, on a fake tree ---------------------------------------------------------------


def plant(root: Path, files: dict[str, str]) -> Path:
    """A fake source tree: `files` maps a path under `root` to its text; every directory on
    the way gets an `__init__.py`."""
    for rel, text in files.items():
        path = root / rel
        for parent in path.relative_to(root).parents:
            if parent != Path("."):
                (root / parent).mkdir(exist_ok=True)
                (root / parent / "__init__.py").touch()
        path.write_text(text)
    return root


CLEAN = {
    "flywheel/config.py": "import os\n",
    "flywheel/db/engine.py": "from flywheel import config\n",
    "flywheel/rollout/loop.py": "from flywheel.db.engine import x\nfrom . import workers\n",
    "flywheel/rollout/workers.py": "from flywheel.config import Settings\n",
    "flywheel/trainer/engine.py": "from flywheel.db import engine\n",
    "flywheel/gate/candidate.py": "from flywheel.rollout.loop import run\n",
}


def test_a_clean_tree_passes_every_rule(tmp_path: Path) -> None:
    root = plant(tmp_path, CLEAN)
    assert ("rollout", "db") in edges(root)
    assert layering_violations(edges(root), {("gate", "rollout")}) == []
    assert package_circles(edges(root)) == []
    assert circles_inside(root, set()) == []
    assert unused_allowances(root, {("gate", "rollout")}, set()) == []


def test_an_upward_import_fails(tmp_path: Path) -> None:
    root = plant(tmp_path, {**CLEAN, "flywheel/db/models.py":
                            "def f():\n    from flywheel.gate.candidate import decide\n"})
    (bad,) = layering_violations(edges(root), {("gate", "rollout")})
    assert bad.startswith("db -> gate (upward)") and "flywheel/db/models.py:2" in bad


def test_a_forbidden_role_edge_fails_even_when_its_layer_allows_it(tmp_path: Path) -> None:
    root = plant(tmp_path, {**CLEAN, "flywheel/rollout/select.py":
                            "def f():\n    from flywheel.trainer.engine import LoRATrainer\n"})
    allowed = {("gate", "rollout"), ("rollout", "trainer")}
    (bad,) = layering_violations(edges(root), allowed)
    assert bad.startswith("rollout -> trainer (forbidden role edge)")


def test_the_vocabulary_importing_outside_itself_fails(tmp_path: Path) -> None:
    root = plant(tmp_path, {**CLEAN, "flywheel/config.py": "from flywheel.db import engine\n"})
    bad = layering_violations(edges(root), {("gate", "rollout")})
    assert [b.split(":")[0] for b in bad] == [
        "config -> db (upward, the vocabulary imports outside itself)"]


def test_a_circle_between_packages_fails(tmp_path: Path) -> None:
    root = plant(tmp_path, {**CLEAN, "flywheel/db/engine.py":
                            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from flywheel.trainer.engine import LoRATrainer\n"})
    assert package_circles(edges(root)) == [frozenset({"db", "trainer"})]


@pytest.mark.parametrize("back", [
    "def later():\n    from flywheel.rollout.loop import run\n",              # lazy
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .loop import run\n",
    "from . import loop\n",                                                   # relative
    "import flywheel.rollout.loop\n",
])
def test_a_circle_inside_a_package_fails(tmp_path: Path, back: str) -> None:
    root = plant(tmp_path, {**CLEAN, "flywheel/rollout/workers.py": back})
    circle = frozenset({"flywheel.rollout.loop", "flywheel.rollout.workers"})
    assert circles_inside(root, set()) == [circle]
    assert circles_inside(root, {circle}) == []


def test_a_longer_circle_inside_a_package_is_one_circle(tmp_path: Path) -> None:
    root = plant(tmp_path, {
        **CLEAN,
        "flywheel/rollout/workers.py": "from flywheel.rollout import select\n",
        "flywheel/rollout/select.py": "from flywheel.rollout.loop import run\n",
        "flywheel/rollout/other.py": "from flywheel.rollout.loop import run\n",
    })
    assert circles_inside(root, set()) == [frozenset(
        {"flywheel.rollout.loop", "flywheel.rollout.workers", "flywheel.rollout.select"})]


def test_an_unused_allowance_fails(tmp_path: Path) -> None:
    root = plant(tmp_path, CLEAN)
    gone = frozenset({"flywheel.rollout.loop", "flywheel.rollout.workers"})
    assert unused_allowances(root, {("gate", "rollout"), ("cli", "api")}, {gone}) == [
        "edge cli -> api", "circle flywheel.rollout.loop <-> flywheel.rollout.workers"]
