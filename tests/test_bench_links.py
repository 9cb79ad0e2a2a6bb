"""examples/bench_links.py (each group of a 2D mesh timed alone): the groups and their ranks
on 4 gloo ranks, and a --tp-size that does not divide the world refused in one line."""

from __future__ import annotations

import pytest
from _harness import run_on_ranks

from benchmarks import bench_links


def _measure(rank: int, world: int) -> list[dict[str, object]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    return bench_links.measure(mesh, mib=0.25, iters=2)


def test_every_group_of_the_mesh_is_timed_alone() -> None:
    rows = run_on_ranks(_measure, 4)
    assert [(r["group"], r["ranks"]) for r in rows[0]] == [("tp", [0, 1]), ("dp", [0, 2]), ("world", [0, 1, 2, 3])]
    assert [(r["group"], r["ranks"]) for r in rows[3]] == [("tp", [2, 3]), ("dp", [1, 3]), ("world", [0, 1, 2, 3])]
    for row in rows[0]:
        assert row["all_gather_ms"] > 0 and row["reduce_scatter_ms"] > 0, row
        assert row["all_gather_busbw_gbs"] > 0 and row["reduce_scatter_busbw_gbs"] > 0, row


def test_a_tp_size_that_does_not_divide_the_world_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit, match=r"^bench_links.py: --tp-size 3 must divide the world size 4$"):
        bench_links.main(["--tp-size", "3"])
