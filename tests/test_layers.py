"""Layers import one way (ARCHITECTURE.md, docs/layout.md): ops <- attention <- models <- tasks <- engine <- apps <-
entry points, tools and benchmarks/; analysis and data never import engine; the package never imports benchmarks/
(they stand beside it);
no import circle, lazy imports inside functions included."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set

REPO = Path(__file__).resolve().parents[1]

# What each sub-package may import from the others (besides itself and the base below).
ALLOWED = {
    "ops": set(),  # each op's reference and kernels: imports no model code
    "attention": {"ops"},
    "diffusion": set(),
    "data": set(),
    "models": {"attention", "ops"},
    "analysis": {"attention", "models", "ops", "data", "diffusion"},
    "tasks": {"attention", "models", "ops", "data", "diffusion", "analysis", "config"},
    "config": {"attention", "models", "ops"},  # the schema; it names data and task classes by import path only
    "engine": {"attention", "models", "ops", "data", "diffusion", "analysis", "tasks", "config"},
    "apps": {"attention", "models", "ops", "data", "diffusion", "analysis", "tasks", "config", "engine"},
}
BASE = {"errors", "cli", "checkpoints"}  # the bottom: imported by anyone, importing no other layer
# command-line applications outside apps/: tools/convert_checkpoint.py's and tools/extract_latents.py's logic
APPLICATIONS = {"moh_vision.models.conversion", "moh_vision.data.extract_latents"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path) -> Set[str]:
    """Every module name a file imports, anywhere in it (absolute imports; relative ones are the package's own)."""
    names: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module or "")
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def module_imports() -> Dict[str, Set[str]]:
    """moh_vision module -> moh_vision modules it imports anywhere in its file (functions included)."""
    graph: Dict[str, Set[str]] = {}
    modules = {_module_name(p) for p in (REPO / "moh_vision").rglob("*.py")}
    for path in (REPO / "moh_vision").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        deps: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                submodules = [f"{name}.{alias.name}" for alias in node.names if f"{name}.{alias.name}" in modules]
                # ``from pkg import submodule`` imports the submodule (and runs pkg/__init__, the package's own)
                names = submodules if len(submodules) == len(node.names) else [name] + submodules
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            deps.update(n for n in names if n.startswith("moh_vision"))
        graph[module] = deps
    known = set(graph)
    return {m: {d for d in deps if d in known and d != m} for m, deps in graph.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "root"


def test_layers_import_one_way():
    wrong: List[str] = []
    for module, deps in module_imports().items():
        here = layer(module)
        for dep in deps:
            there = layer(dep)
            if here == "root" or there == here:
                continue
            if here in BASE and there not in BASE:
                wrong.append(f"{module} -> {dep} (the base imports no layer)")
            elif here in ALLOWED and there not in BASE and there not in ALLOWED[here]:
                wrong.append(f"{module} -> {dep} ({here} may import {sorted(ALLOWED[here]) or 'no other layer'})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circle():
    graph = {m: {d for d in deps if not (m.startswith(d + ".") or d == m)} for m, deps in module_imports().items()}
    # a package's __init__ importing its own submodules is not a circle; a submodule importing back is
    order: List[str] = []
    state: Dict[str, int] = {}
    cycles: List[List[str]] = []

    def visit(node: str, path: List[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2
        order.append(node)

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_package_never_imports_the_benchmarks():
    """benchmarks/ imports moh_vision, not the other way: no module of the package names a benchmark module (the
    scripts and their siblings, imported by plain name from beside them, or as ``benchmarks.*``)."""
    bench = {p.stem for p in (REPO / "benchmarks").glob("*.py")} | {"benchmarks"}
    wrong = [f"{path.relative_to(REPO)} -> {name}" for path in sorted((REPO / "moh_vision").rglob("*.py"))
             for name in _imported_names(path) if name.split(".")[0] in bench]
    assert not wrong, "\n".join(wrong)
    uses = [name for path in (REPO / "benchmarks").glob("*.py") for name in _imported_names(path)]
    assert any(name.startswith("moh_vision") for name in uses)  # the check above looks at real imports


def test_every_library_module_serves_the_library():
    """moh_vision holds no module that only tools/ or benchmarks/ import (issue 60): each module outside apps/ (the
    applications that train.py, eval.py and tools/ call) is imported by another module of the package, is a
    package's face (``__init__``), an attention variant (the registry imports every module of its package) or one of
    the two command-line applications that live with what they convert (APPLICATIONS)."""
    graph = module_imports()
    imported = {dep for deps in graph.values() for dep in deps}
    imported |= {dep.rsplit(".", 1)[0] for dep in imported}
    lonely = [m for m in graph if layer(m) not in ("apps", "attention") and m not in imported
              and m not in APPLICATIONS and not (REPO / m.replace(".", "/") / "__init__.py").exists()]
    assert not lonely, f"only tools, benchmarks or tests import {sorted(lonely)}: move them beside the package"


def test_the_layout_page_draws_every_room_and_module():
    """docs/layout.md draws each layer of ALLOWED in its diagram and names every module of the package in its listing,
    so that a new room or file cannot land without the page saying where it sits."""
    page = (REPO / "docs" / "layout.md").read_text()
    diagram, listing = page.split("```")[1], page.split("```")[3]
    missing = [name for name in ALLOWED if f"moh_vision/{name}" not in diagram]
    assert not missing, f"docs/layout.md's diagram has no room for {missing}"
    words = set(re.findall(r"[\w.]+", listing))
    unnamed = [str(path.relative_to(REPO)) for path in sorted((REPO / "moh_vision").rglob("*.py"))
               if path.stem != "__init__" and path.stem not in words and path.name not in words]
    assert not unnamed, f"docs/layout.md's listing does not name {unnamed}"


def test_the_engine_holds_the_loop_and_its_parts_only():
    """engine/ is the trainer and its components (issue 60: at most 12 files, none a fragment under 80 lines but the
    package's face); the applications that drive it are apps/ (which the engine may not import: ALLOWED)."""
    files = sorted((REPO / "moh_vision" / "engine").glob("*.py"))
    assert len(files) <= 12, [p.name for p in files]
    small = [p.name for p in files if p.name != "__init__.py" and len(p.read_text().splitlines()) < 80]
    assert not small, f"fold these into the module whose job they are part of: {small}"
