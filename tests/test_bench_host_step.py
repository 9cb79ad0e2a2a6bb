"""examples/bench_host_step.py: every host operation of an offloaded, clipped step is timed."""

from __future__ import annotations

from benchmarks import bench_host_step


def test_times_every_operation_of_a_tiny_preset() -> None:
    times = bench_host_step.main(["--preset", "tiny", "--repeats", "1"])
    assert len(times) == 6 and all(t > 0 for t in times.values()), times
