"""Every ```python block of README.md and docs/*.md runs, so the documentation cannot rot.

A page's unmarked blocks run in order in one namespace (as a reader runs them one after the
other), on a harness worker whose default process group is a gloo world of one rank, inside a
temporary working directory. A block is marked by an HTML comment on the line directly above its
fence:

- `<!-- gpu -->`: runs only in the GPU suite (`pytest -m gpu`): a page's gpu blocks run in order
  in one namespace, in a fresh process on one GPU with a `cpu:gloo,cuda:nccl` world of one
  already set up; they do not see the page's CPU blocks, so each gpu block sequence is whole.
- `<!-- ranks N -->` (N >= 2), `<!-- needs MODULE ... -->` or both (`<!-- ranks 2 needs
  accelerate transformers -->`): the block is a whole script, as `torchrun --nproc-per-node N`
  runs it: alone, in a fresh namespace with `__name__ == "__main__"`, on N gloo ranks (one without
  `ranks`) that share one temporary working directory, with the launcher's variables (`RANK`,
  `WORLD_SIZE`, `LOCAL_RANK`, ...) set and the default process group made. It is skipped, with
  the module named, when a module it needs does not import. Under `needs accelerate` the harness
  does what only CPU runs need (and a user on GPUs does not write): `ACCELERATE_USE_CPU`, as
  `accelerate launch --cpu` sets it, and every `Accelerator` built with an FSDP plugin takes
  accelerate's FSDP path on CPU (`_hf.force_fsdp_on_cpu`); the test checks that each such
  `Accelerator` spans the N ranks and prepares its model with composable. After the block the
  worker is put back: `use_fsdp2()`, accelerate's shared state, the environment.

Any other comment directly above a fence is refused, so that no block is silently left out.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import requires_gpus, run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKERS = ("gpu", "ranks N", "needs MODULE ...", "ranks N needs MODULE ...")
_FENCE = re.compile(r"^```python[ \t]*$")
_COMMENT = re.compile(r"^<!--(.*)-->$")
_SCRIPT = re.compile(r"^(?:ranks (\d+))?(?:(?:^| )needs((?: [\w.]+)+))?$")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    marker: str | None  # the comment's text ("gpu", "ranks 2 needs peft"), None when unmarked
    code: str
    ranks: int = 1  # a script block's world size
    needs: tuple[str, ...] = ()  # modules a script block needs

    @property
    def script(self) -> bool:
        """A whole script of its own (`ranks` or `needs`), not part of the page's sequence."""
        return self.marker not in (None, "gpu")


def _parse_marker(text: str) -> tuple[int, tuple[str, ...]]:
    """(ranks, needs) of a marker's text; ValueError for anything but the known markers."""
    if text == "gpu":
        return 1, ()
    script = _SCRIPT.match(text) if text else None
    needs = tuple((script.group(2) or "").split()) if script else ()
    if script is None or int(script.group(1) or 2) < 2 or {"ranks", "needs"} & set(needs):
        raise ValueError(f"unknown marker <!-- {text} -->, expected one of {MARKERS} (N >= 2)")
    return int(script.group(1) or 1), needs


def blocks_of(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown page, each with the marker directly above its fence."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        if not _FENCE.match(lines[i]):
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        if i == len(lines):
            raise ValueError(f"{path.name}:{start + 1}: a ```python block is never closed")
        above = _COMMENT.match(lines[start - 1].strip()) if start > 0 else None
        marker = " ".join(above.group(1).split()) if above else None
        ranks, needs = 1, ()
        if marker is not None:
            try:
                ranks, needs = _parse_marker(marker)
            except ValueError as e:
                raise ValueError(f"{path.name}:{start + 1}: {e}") from None
        code = "\n".join(lines[start + 1 : i])
        name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
        found.append(Block(name, start + 1, marker, code, ranks, needs))
        i += 1
    return found


def _program(blocks: list[Block]) -> list[tuple[str, str]]:
    """(code, filename) per block; the filename names the page and line in tracebacks."""
    return [(b.code, f"{b.path}:{b.line}") for b in blocks]


def _run_page(rank: int, world_size: int, program: list[tuple[str, str]], root: str) -> int:
    """Harness worker: run the blocks in order in one namespace, in a temporary directory."""
    cwd = os.getcwd()
    sys.path.insert(0, root)  # `examples/...` imports as from the repository root
    namespace: dict = {"__name__": "__docs__"}
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            for code, filename in program:
                exec(compile(code, filename, "exec"), namespace)
        finally:
            os.chdir(cwd)
            sys.path.remove(root)
            torch._dynamo.reset()  # the next test in this worker compiles from a clean cache
    return len(program)


def _pages_with(select) -> list:  # noqa: ANN001 - a predicate on a block
    return [pytest.param(p, id=str(p.relative_to(ROOT))) for p in PAGES if any(select(b) for b in blocks_of(p))]


def test_markers_parse() -> None:
    """Every page parses: closed fences, known markers; the pages that must have code do."""
    counts = {str(p.relative_to(ROOT)): len(blocks_of(p)) for p in PAGES}
    assert counts["README.md"] >= 1, counts
    assert counts.get("docs/getting-started.md", 0) >= 1, counts


def test_block_markers(tmp_path: Path) -> None:
    """The comment directly above a fence marks it; other fences and languages are not blocks."""
    page = tmp_path / "page.md"
    page.write_text(
        "text\n```python\na = 1\n```\n<!-- ranks 4 -->\n```python\nb = 2\n```\n\n<!-- gpu -->\n```python\n"
        "c = 3\nd = 4\n```\n```bash\nls\n```\n<!-- gpu -->\n\n```python\ne = 5\n```\n"
        "<!--  needs  peft -->\n```python\nf = 6\n```\n<!-- ranks 2 needs accelerate transformers -->\n```python\ng\n```\n"
    )
    found = [(b.line, b.marker, b.code, b.ranks, b.needs, b.script) for b in blocks_of(page)]
    assert found == [
        (2, None, "a = 1", 1, (), False),
        (6, "ranks 4", "b = 2", 4, (), True),
        (11, "gpu", "c = 3\nd = 4", 1, (), False),
        (20, None, "e = 5", 1, (), False),
        (24, "needs peft", "f = 6", 1, ("peft",), True),
        (28, "ranks 2 needs accelerate transformers", "g", 2, ("accelerate", "transformers"), True),
    ]
    for unknown in ("no-run", "skip", "ranks 1", "ranks two", "needs", "gpu needs torchao", "needs peft ranks 2", ""):
        page.write_text(f"<!-- {unknown} -->\n```python\npass\n```\n")
        with pytest.raises(ValueError, match=r"page.md:2: unknown marker"):
            blocks_of(page)
    page.write_text("```python\npass\n")
    with pytest.raises(ValueError, match="never closed"):
        blocks_of(page)


def _imported_modules(code: str) -> list[str]:
    """The top-level modules a block's `import` / `from ... import` statements name, in order."""
    found: list[str] = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module.split(".")[0])
    return list(dict.fromkeys(found))


@pytest.mark.parametrize("page", _pages_with(lambda b: b.marker is None))
def test_page_runs_on_cpu(page: Path) -> None:
    """The page's unmarked blocks run, in order, on a gloo world of one rank; skipped, naming the
    module, where a block imports an optional package (transformers, torchao, ...) that is not
    installed, as the tests of that package skip."""
    blocks = [b for b in blocks_of(page) if b.marker is None]
    _skip_unless_installed(tuple(m for b in blocks for m in _imported_modules(b.code)))
    program = _program(blocks)
    assert run_on_ranks(_run_page, 1, program, str(ROOT), timeout=120.0) == [len(program)]


# The group's store is a file, not a port: a free port probed here could be taken by a process of
# another test before the script listens on it (the GPU suite runs its shards side by side).
_GPU_PRELUDE = """
import os, torch, torch.distributed as dist
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
torch.cuda.set_device(0)
dist.init_process_group("cpu:gloo,cuda:nccl", init_method="file://" + os.path.abspath("store"), rank=0, world_size=1)
"""


@requires_gpus(1)
@pytest.mark.parametrize("page", _pages_with(lambda b: b.marker == "gpu"))
def test_page_runs_on_gpu(page: Path, tmp_path: Path) -> None:
    """The page's gpu blocks, in order, in a fresh process on one GPU."""
    blocks = [b for b in blocks_of(page) if b.marker == "gpu"]
    script = _GPU_PRELUDE + "".join(f"exec(compile({b.code!r}, {f'{b.path}:{b.line}'!r}, 'exec'))\n" for b in blocks)
    (tmp_path / "page.py").write_text(script)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "page.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{page.name} failed on the GPU:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"


# ----------------------------------------------------------------------------- script blocks


@contextlib.contextmanager
def _accelerate_fsdp_on_cpu() -> Iterator[dict[str, int]]:
    """Every `Accelerator` built with an FSDP plugin takes accelerate's FSDP path on CPU (gloo),
    as on GPUs (`_hf.force_fsdp_on_cpu`); Trainer builds its `Accelerator` the same way. Yields
    the counts of such accelerators, of models composable's `fsdp2_prepare_model` prepared, and
    the accelerators' world size."""
    from _hf import force_fsdp_on_cpu
    from accelerate import Accelerator

    import composable.integrations.accelerate as integration

    counts = {"accelerators": 0, "prepared": 0}
    os.environ["ACCELERATE_USE_CPU"] = "true"  # as `accelerate launch --cpu` sets it (accelerate and Trainer read it)
    init, prepare = Accelerator.__init__, integration.fsdp2_prepare_model

    def init_on_fsdp(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003 - accelerate's signature
        init(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None:
            if self.mixed_precision != "no":  # what accelerate does for its own FSDP path
                plugin.set_mixed_precision(self.mixed_precision)
            force_fsdp_on_cpu(self, plugin)
            counts["accelerators"] += 1
            counts["processes"] = self.num_processes

    def counted_prepare(accelerator, model):  # noqa: ANN001, ANN202 - use_composable_in_accelerate() installs it
        counts["prepared"] += 1
        return prepare(accelerator, model)

    Accelerator.__init__, integration.fsdp2_prepare_model = init_on_fsdp, counted_prepare
    try:
        yield counts
    finally:
        Accelerator.__init__, integration.fsdp2_prepare_model = init, prepare


def _run_script(
    rank: int, world_size: int, code: str, filename: str, root: str, workdir: str, needs: tuple
) -> dict[str, Any]:
    """Harness worker: run one script block as torchrun would start it, then put the worker back.
    Returns `_accelerate_fsdp_on_cpu`'s counts under `needs accelerate`, else {}; or
    {"skipped": why} where a module the block needs does not import here (importing is the
    test: a package can be found yet fail to import, torchtitan without triton for one)."""
    from _hf import accelerate_env

    if any(module.split(".")[0] == "torchtitan" for module in needs):
        from _torchtitan import stub_moe_kernels_without_triton

        stub_moe_kernels_without_triton()  # llama3 never calls the Triton MoE kernels
    for module in needs:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - any import failure means the block cannot run here
            return {"skipped": f"the block needs {module}, which does not import ({type(error).__name__}: {error})"}

    environ, cwd = dict(os.environ), os.getcwd()
    accelerate_env(rank, world_size)  # RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_*
    sys.path.insert(0, root)
    os.chdir(workdir)
    try:
        with _accelerate_fsdp_on_cpu() if "accelerate" in needs else contextlib.nullcontext({}) as counts:
            exec(compile(code, filename, "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(cwd)
        sys.path.remove(root)
        if "composable.integrations.accelerate" in sys.modules:  # a use_composable_in_accelerate() ends with its script
            sys.modules["composable.integrations.accelerate"].use_fsdp2()
        if "accelerate" in sys.modules:
            from _hf import reset_accelerate

            reset_accelerate()
        os.environ.clear()
        os.environ.update(environ)
        torch._dynamo.reset()
    return dict(counts)


def _skip_unless_installed(needs: tuple[str, ...]) -> None:
    """pytest.skip naming the first of `needs` whose package is not installed. Only found, not
    imported, here: the worker that runs the block imports them (and skips if that fails),
    so a failing import cannot leave this process half-imported."""
    for module in needs:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip(f"the block needs {module}, which is not installed")


def _script_blocks() -> list:
    return [pytest.param(b, id=f"{b.path}:{b.line}") for p in PAGES for b in blocks_of(p) if b.script]


@pytest.mark.parametrize("block", _script_blocks())
def test_script_block_runs(block: Block) -> None:
    """A `ranks` / `needs` block runs alone, as a script, on its ranks (skipped without its modules)."""
    _skip_unless_installed(block.needs)
    with tempfile.TemporaryDirectory() as workdir:
        done = run_on_ranks(
            _run_script,
            block.ranks,
            block.code,
            f"{block.path}:{block.line}",
            str(ROOT),
            workdir,
            block.needs,
            timeout=180.0,
        )
    assert len(done) == block.ranks
    skipped = [d["skipped"] for d in done if "skipped" in d]
    if skipped:
        pytest.skip(skipped[0])
    for counts in done:  # each Accelerator on FSDP the block made is distributed and prepares with composable
        assert counts.get("prepared", 0) >= counts.get("accelerators", 0), counts
        assert counts.get("processes", block.ranks) == block.ranks, counts


def test_script_block_is_a_launched_script() -> None:
    """A `ranks 2` block runs as `__main__` on both ranks of a gloo world, with the launcher's
    variables, in one working directory."""
    code = (
        "import os, torch.distributed as dist\n"
        "assert __name__ == '__main__' and dist.get_world_size() == 2\n"
        "assert (os.environ['RANK'], os.environ['WORLD_SIZE']) == (str(dist.get_rank()), '2')\n"
        "open(f'rank{dist.get_rank()}', 'w').close()\n"
        "dist.barrier()\n"
        "assert os.path.exists('rank0') and os.path.exists('rank1')\n"
    )
    with tempfile.TemporaryDirectory() as workdir:
        assert run_on_ranks(_run_script, 2, code, "block", str(ROOT), workdir, ()) == [{}, {}]
        assert sorted(os.listdir(workdir)) == ["rank0", "rank1"]


def test_missing_module_skips() -> None:
    """A block that needs a module that does not import is skipped, naming it."""
    with pytest.raises(pytest.skip.Exception, match="needs composable_no_such_module"):
        _skip_unless_installed(("torch", "composable_no_such_module"))


def test_unmarked_blocks_name_their_imports() -> None:
    """An unmarked block's imports are found (so a page needing a missing package skips, naming it)."""
    code = "import os, torch.distributed as dist\nfrom transformers import X\nfrom . import y\nif 1:\n    import peft.tuners\n"
    assert _imported_modules(code) == ["os", "torch", "transformers", "peft"]
    with pytest.raises(pytest.skip.Exception, match="needs composable_no_such_module"):
        _skip_unless_installed(tuple(_imported_modules("import composable_no_such_module")))


def _accelerate_is_pytorch_fsdp2(rank: int, world_size: int) -> bool:
    import accelerate.accelerator as accelerator_module
    import accelerate.utils.fsdp_utils as fsdp_utils

    return accelerator_module.fsdp2_prepare_model is fsdp_utils.fsdp2_prepare_model


def _environ(rank: int, world_size: int) -> dict:
    return dict(os.environ)


def test_script_block_leaves_the_worker_as_it_found_it() -> None:
    """`use_composable_in_accelerate()` in a block does not outlive it: the next call on the same worker sees
    accelerate's own FSDP2 path, and the launcher's variables are gone."""
    pytest.importorskip("accelerate")
    code = (
        "from composable.integrations.accelerate import use_composable_in_accelerate\nuse_composable_in_accelerate()\n"
    )
    code += "import accelerate.accelerator as a, composable.integrations.accelerate as c\n"
    code += "assert a.fsdp2_prepare_model is c.fsdp2_prepare_model"
    environ = run_on_ranks(_environ, 1)
    with tempfile.TemporaryDirectory() as workdir:
        assert run_on_ranks(_run_script, 1, code, "block", str(ROOT), workdir, ("accelerate",)) == [
            {"accelerators": 0, "prepared": 0}
        ]
    assert run_on_ranks(_accelerate_is_pytorch_fsdp2, 1) == [True]
    assert run_on_ranks(_environ, 1) == environ
