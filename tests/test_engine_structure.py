"""The package's shape: dependencies point one way (front ends -> engine -> collectives), no
import cycle between files nor between packages, and the engine's steps show by name in profiles;
the examples' packages likewise (models at the bottom, no cycle, every file named); every
`# type: ignore` says why.

The import graph is read from the source with `ast` (every `import`/`from ... import`,
including those under `if TYPE_CHECKING:`), so this runs without importing anything.
"""

from __future__ import annotations

import ast
import functools
import io
import os
import re
import tokenize
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import composable
from composable import fully_shard, replicate

ROOT = Path(composable.__file__).parent
FRONT_ENDS = ("composable.fsdp", "composable.replicate", "composable.checkpoint")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The composable modules `path` imports (a package import counts as its __init__)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("composable"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("composable"):
                continue
            for alias in node.names:  # `from . import collectives` imports a module
                candidate = f"{target}.{alias.name}"
                found.add(candidate if _exists(candidate) else target)
    return found - {name}


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


@functools.cache  # the source does not change during a run; read it once
def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}


def _package_of(module: str) -> str:
    """The innermost package (a directory with __init__.py) that holds `module`; a package's
    own __init__ belongs to it, and top-level modules (`composable.accumulate`) to `composable`."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if (ROOT.parent.joinpath(*parts[:end]) / "__init__.py").exists():
            return ".".join(parts[:end])
    raise AssertionError(f"{module} is in no package")


@functools.cache
def _package_graph() -> dict[str, set[str]]:
    """Package A -> package B when some module of A imports some module of B (A != B)."""
    graph: dict[str, set[str]] = {}
    for mod, deps in _graph().items():
        mine = _package_of(mod)
        graph.setdefault(mine, set()).update(p for p in map(_package_of, deps) if p != mine)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep, stack + [dep])) is not None:
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])) is not None:
            return cycle
    return None


def test_cycle_finder_finds_cycles() -> None:
    # The checks below pass by finding nothing: prove the finder finds what is there.
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"b"}}) == ["b", "b"]
    assert _package_of("composable") == "composable"
    assert _package_of("composable.accumulate") == "composable"
    assert _package_of("composable.fsdp") == "composable.fsdp"
    assert _package_of("composable.fsdp.api") == "composable.fsdp"
    assert _package_of("composable._engine") == "composable._engine"
    assert _package_of("composable._engine.module_state.state") == "composable._engine.module_state"


def test_import_graph_has_no_cycles() -> None:
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle between files: " + " -> ".join(cycle or ())


def test_packages_have_no_cycles() -> None:
    # `composable` (its __init__ and top-level modules) imports the front ends and the engine,
    # so neither may import a top-level module back, even one that imports only torch.
    cycle = _find_cycle(_package_graph())
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or ())


def test_engine_imports_nothing_above_it() -> None:
    # Not a top-level module of `composable`, not a front end: only the engine itself.
    bad = {
        (mod, dep)
        for mod, deps in _graph().items()
        if mod.startswith("composable._engine")
        for dep in deps
        if not dep.startswith("composable._engine")
    }
    assert not bad, f"the engine imports upward: {sorted(bad)}"


def test_front_ends_do_not_import_each_other() -> None:
    bad = set()
    for mod, deps in _graph().items():
        mine = next((f for f in FRONT_ENDS if mod == f or mod.startswith(f + ".")), None)
        if mine is None:
            continue
        for dep in deps:
            other = next((f for f in FRONT_ENDS if dep == f or dep.startswith(f + ".")), None)
            if other is not None and other != mine:
                bad.add((mod, dep))
    assert not bad, f"front ends import each other: {sorted(bad)}"


def test_collectives_know_nothing_of_modules() -> None:
    deps = _graph()["composable._engine.comm.collectives"]
    assert not deps, f"collectives import {sorted(deps)}"


# The engine's folders from the top floor down: each imports only folders after it in this list
# (composable/_engine/__init__.py draws the same map).
ENGINE_FLOORS = (
    "module_state",
    "groups",
    "unshard",
    "grads",
    "optimizer",
    "whole_model",
    "params",
    "dtypes",
    "hooks",
    "meshes",
    "comm",
)


def test_engine_folders_import_only_the_floors_below() -> None:
    floor = {f"composable._engine.{name}": i for i, name in enumerate(ENGINE_FLOORS)}
    graph = _package_graph()
    engine = {p for p in graph if p.startswith("composable._engine.")}
    assert engine == set(floor), f"engine folders not in ENGINE_FLOORS: {sorted(engine ^ set(floor))}"
    upward = {(pkg, dep) for pkg in engine for dep in graph[pkg] if dep in floor and floor[dep] <= floor[pkg]}
    assert not upward, f"engine folders importing a floor above (or beside) them: {sorted(upward)}"


def test_engine_files_live_in_its_folders() -> None:
    # A newcomer finds a file by its concern: nothing but the map stands in _engine/ itself.
    loose = sorted(p.name for p in (ROOT / "_engine").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"engine files outside a concern's folder: {loose}"
    unmapped = set()
    for pkg in (ROOT / "_engine").iterdir():
        if (pkg / "__init__.py").exists():
            mapped = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
            words = {line.split()[0] for line in mapped.splitlines() if line.strip()}
            unmapped |= {
                f"{pkg.name}/{p.name}" for p in pkg.glob("*.py") if p.name != "__init__.py" and p.stem not in words
            }
    assert not unmapped, f"files their folder's docstring does not map: {sorted(unmapped)}"


def test_no_file_over_420_lines() -> None:
    """A smell detector, not a rule to split by: a file this long usually holds two concerns. A
    class stays whole in one file even when that takes a few lines more."""
    files = [*ROOT.rglob("*.py"), *Path(__file__).resolve().parents[1].joinpath("examples").rglob("*.py")]
    long = {str(p.relative_to(ROOT.parent)): n for p in files if (n := len(p.read_text().splitlines())) > 420}
    assert not long, long


_TYPE_IGNORE = re.compile(r"#\s*type:\s*ignore\b(\[[^\]]*\])?")


def _bare_ignores(source: str) -> list[int]:
    """The lines of `source` whose `# type: ignore` lacks an error code or a reason after it
    (`# type: ignore[code]  # what torch's typing gets wrong`). Read from the comment tokens, so
    the words inside a string do not count."""
    bare = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        found = _TYPE_IGNORE.search(token.string) if token.type == tokenize.COMMENT else None
        if found is not None and (found.group(1) is None or not re.match(r"\s*#\s*\S", token.string[found.end() :])):
            bare.append(token.start[0])
    return bare


def test_type_ignores_give_their_reason() -> None:
    """An ignore stays only where torch's (or an extra's) typing is wrong or missing; its reason
    on the line is what lets a reader check that it still is."""
    assert _bare_ignores("x = f()  # type: ignore[attr-defined]  # torch's stub lacks it\n") == []
    assert _bare_ignores("x = f()  # type: ignore[attr-defined]\n") == [1]
    assert _bare_ignores("x = 1\ny = f()  # type: ignore  # no code\n") == [2]
    assert _bare_ignores('s = "# type: ignore"\n') == []
    bare = {
        f"{path.relative_to(ROOT.parent)}:{line}"
        for path in sorted(ROOT.rglob("*.py"))
        for line in _bare_ignores(path.read_text())
    }
    assert not bare, f"type: ignore without an error code or a reason after it: {sorted(bare)}"


def test_steps_show_by_name_in_profiles() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
        fully_shard(model[0])
        replicate(model[2])
        fully_shard(model)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        names = {e.name for e in prof.events() if e.name.startswith("composable::")}
    finally:
        dist.destroy_process_group()
    expected = {
        "pre_forward",
        "post_forward",
        "pre_backward",
        "post_backward",
        "final_callback",
        "unshard",
        "reshard",
        "reduce_grads",
        "finish_reduce",
        "flush_buckets",
    }
    assert {f"composable::{n}" for n in expected} <= names, sorted(names)


def test_architecture_page_names_every_file() -> None:
    """docs/architecture.md is where a newcomer looks a file up: each of the package's files is
    named there (by its name, or its stem in a folder's list)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    unnamed = sorted(
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*.py")
        if p.name != "__init__.py" and p.name not in page and not re.search(rf"\b{re.escape(p.stem)}\b", page)
    )
    assert not unnamed, f"files docs/architecture.md does not name: {unnamed}"


# ----------------------------------------------------------------------------- the examples' packages

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE_PACKAGES = ("models", "trainer", "benchmarks", "estimator")


def _example_packages_imported(path: Path) -> set[str]:
    """The examples' packages that `path` imports (by the first part of each imported name)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found & set(EXAMPLE_PACKAGES)


def _example_files() -> list[Path]:
    return sorted(p for pkg in EXAMPLE_PACKAGES for p in (EXAMPLES / pkg).rglob("*.py"))


def test_examples_packages_have_no_cycles() -> None:
    """models is the floor the main job, the benchmark and the estimator share: it imports none of
    them, and no two of the packages import each other both ways."""
    graph: dict[str, set[str]] = {pkg: set() for pkg in EXAMPLE_PACKAGES}
    for path in _example_files():
        mine = path.relative_to(EXAMPLES).parts[0]
        graph[mine] |= _example_packages_imported(path) - {mine}
    assert not graph["models"], f"models imports {sorted(graph['models'])}"
    assert _find_cycle(graph) is None, _find_cycle(graph)


def test_examples_packages_map_their_files() -> None:
    """Each example package's __init__.py docstring names each of its files, and
    docs/architecture.md names every one of them too."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    unmapped, unnamed = [], []
    for path in _example_files():
        if path.name == "__init__.py":
            continue
        if path.name not in (ast.get_docstring(ast.parse((path.parent / "__init__.py").read_text())) or ""):
            unmapped.append(str(path.relative_to(EXAMPLES)))
        if path.name not in page:
            unnamed.append(str(path.relative_to(EXAMPLES)))
    assert not unmapped, f"files their package's __init__.py does not name: {unmapped}"
    assert not unnamed, f"files docs/architecture.md does not name: {unnamed}"
