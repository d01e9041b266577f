"""The package layering: no import circles between packages and no upward imports.

Every `import` in flywheel/, consumers/ and producers/ counts — at module level, inside
functions (lazy imports) and under `TYPE_CHECKING` — since each one is a dependency a reader
must follow. A unit is a subpackage of `flywheel` (`flywheel.gate`), a top-level module of
the vocabulary (`flywheel.config`, …), or the `consumers` / `producers` package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCABULARY = {"config", "errors", "events", "schemas", "tasks", "formats", "feedback",
              "responses_log"}
LAYERS: dict[str, int] = {
    # 0: the vocabulary, the ground floor: imports nothing else of ours
    **dict.fromkeys(VOCABULARY, 0),
    # 1: infrastructure and engines that know no domain process
    "db": 1, "runtime": 1, "policy": 1, "environments": 1,
    # 2: domain stores and the processes' pure parts
    "adapters": 2, "ingest": 2, "mining": 2, "producers": 2,
    # 3: the loop's roles
    "rollout": 3, "trainer": 3, "gate": 3,
    # 4: what operators and the HTTP process use
    "api": 4, "demo": 4, "bench": 4, "cli": 4,
    # 5: the service entry points; nothing imports them
    "consumers": 5,
}
SAME_LAYER_ALLOWED = {
    ("runtime", "db"),        # `flywheel up` migrates the database it starts
    ("producers", "ingest"),  # the SDK and replay validate exactly as ingest decodes
    ("gate", "rollout"),      # the gate evaluates by running rollout groups
    ("api", "gate"), ("cli", "api"), ("cli", "demo"), ("cli", "bench"), ("bench", "demo"),
    ("demo", "api"), ("api", "demo"),
    ("schemas", "formats"),   # the wire format converts what agents log (pure dict → dict)
    ("schemas", "responses_log"),
    ("feedback", "schemas"), ("feedback", "formats"),  # feedback carries items, corrections
}
"""Edges inside one layer that are the design, not an accident (every other is refused)."""
FORBIDDEN = {("rollout", "trainer"), ("trainer", "gate"), ("gate", "trainer"),
             ("trainer", "rollout"), ("rollout", "gate")}


def unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] in ("consumers", "producers"):
        return parts[0]
    if parts[0] != "flywheel" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else \
        module_name(path).rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:
                yield f"{base}.{alias.name}" if base in ("flywheel",) else base, node.lineno


def edges() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for top in ("flywheel", "consumers", "producers"):
        for path in sorted((ROOT / top).rglob("*.py")):
            src = unit(module_name(path))
            if src is None:
                continue
            for target, line in imports(path):
                dst = unit(target)
                if dst is not None and dst != src:
                    found.setdefault((src, dst), []).append(
                        f"{path.relative_to(ROOT)}:{line} imports {target}")
    return found


def test_every_package_has_a_layer() -> None:
    units = {p.name for p in (ROOT / "flywheel").iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    units = {u.removesuffix(".py") for u in units} - {"__init__"}
    assert units <= set(LAYERS), f"give these a layer in LAYERS: {sorted(units - set(LAYERS))}"


def test_no_upward_or_forbidden_imports() -> None:
    bad = []
    for (src, dst), where in sorted(edges().items()):
        upward = LAYERS[dst] > LAYERS[src]
        sideways = LAYERS[dst] == LAYERS[src] and (src, dst) not in SAME_LAYER_ALLOWED
        vocabulary = LAYERS[src] == 0 and dst not in VOCABULARY
        if upward or sideways or vocabulary or (src, dst) in FORBIDDEN:
            bad.append(f"{src} -> {dst}: " + "; ".join(where[:3]))
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_circles_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for src, dst in edges():
        graph.setdefault(src, set()).add(dst)
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif len(path) < len(LAYERS):
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, "import circles: " + "; ".join(sorted(set(cycles))[:10])


def test_the_checker_sees_a_forbidden_edge(tmp_path: Path) -> None:
    """The walk finds lazy imports inside functions (the kind that slip in unseen)."""
    path = ROOT / "flywheel" / "rollout" / "_probe_for_test.py"
    path.write_text("def f():\n    from flywheel.trainer.engine import LoRATrainer\n")
    try:
        assert ("rollout", "trainer") in edges()
    finally:
        path.unlink()
