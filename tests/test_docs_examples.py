"""Every ```python block of README.md and docs/*.md runs, so the documentation cannot rot.

A page's blocks run in order in one namespace (as a reader runs them one after the other), on
a harness worker whose default process group is a gloo world of one rank, inside a temporary
working directory. A block is marked by an HTML comment on the line directly above its fence:
`<!-- no-run -->` is not run (it needs several processes, a launcher or a framework's own
setup), `<!-- gpu -->` runs only in the GPU suite (`pytest -m gpu`): a page's gpu blocks run in
order in one namespace, in a fresh process on one GPU with a `cpu:gloo,cuda:nccl` world of one
already set up; they do not see the page's CPU blocks, so each gpu block sequence is whole.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _harness import requires_gpus, run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKERS = ("no-run", "gpu")
_FENCE = re.compile(r"^```python[ \t]*$")
_MARKER = re.compile(r"^<!--\s*([a-z-]+)\s*-->$")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    marker: str | None  # None, "no-run" or "gpu"
    code: str


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
        above = _MARKER.match(lines[start - 1].strip()) if start > 0 else None
        marker = above.group(1) if above else None
        if marker is not None and marker not in MARKERS:
            raise ValueError(f"{path.name}:{start + 1}: unknown marker <!-- {marker} -->, expected one of {MARKERS}")
        code = "\n".join(lines[start + 1 : i])
        name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
        found.append(Block(name, start + 1, marker, code))
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
        "text\n```python\na = 1\n```\n<!-- no-run -->\n```python\nb = 2\n```\n\n<!-- gpu -->\n```python\n"
        "c = 3\nd = 4\n```\n```bash\nls\n```\n<!-- gpu -->\n\n```python\ne = 5\n```\n"
    )
    found = [(b.line, b.marker, b.code) for b in blocks_of(page)]
    assert found == [(2, None, "a = 1"), (6, "no-run", "b = 2"), (11, "gpu", "c = 3\nd = 4"), (20, None, "e = 5")]
    page.write_text("<!-- skip -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="unknown marker"):
        blocks_of(page)
    page.write_text("```python\npass\n")
    with pytest.raises(ValueError, match="never closed"):
        blocks_of(page)


@pytest.mark.parametrize("page", _pages_with(lambda b: b.marker is None))
def test_page_runs_on_cpu(page: Path) -> None:
    """The page's unmarked blocks run, in order, on a gloo world of one rank."""
    program = _program([b for b in blocks_of(page) if b.marker is None])
    assert run_on_ranks(_run_page, 1, program, str(ROOT), timeout=120.0) == [len(program)]


_GPU_PRELUDE = """
import os, torch, torch.distributed as dist
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["DOCS_PORT"])
torch.cuda.set_device(0)
dist.init_process_group("cpu:gloo,cuda:nccl")
"""


@requires_gpus(1)
@pytest.mark.parametrize("page", _pages_with(lambda b: b.marker == "gpu"))
def test_page_runs_on_gpu(page: Path, tmp_path: Path) -> None:
    """The page's gpu blocks, in order, in a fresh process on one GPU."""
    blocks = [b for b in blocks_of(page) if b.marker == "gpu"]
    script = _GPU_PRELUDE + "".join(f"exec(compile({b.code!r}, {f'{b.path}:{b.line}'!r}, 'exec'))\n" for b in blocks)
    (tmp_path / "page.py").write_text(script)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "DOCS_PORT": str(port),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "page.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{page.name} failed on the GPU:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
