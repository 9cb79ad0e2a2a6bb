"""The measuring tools of examples/: the benchmark's report (ratios over interleaved rounds)
and trace_overlap.py (compute / exposed communication / idle from a Chrome trace), checked on
made-up inputs since their numbers go into BENCHMARKS.md; how the benchmark builds its
contenders (same groups for ours and FSDP2, compiled blocks, HuggingFace's Llama), a 2-rank
gloo smoke run of the whole GPU path on the CPU, and the crash handling of --cpu-overhead."""

from __future__ import annotations

import contextlib
import gzip
import json
from pathlib import Path

import _crashing
import pytest

from benchmarks import bench_args, bench_build, bench_float8, bench_overhead
from benchmarks import side_by_side as benchmark
from benchmarks import trace_overlap as overlap
from benchmarks.trace_overlap import Interval


def _result(run: str, step_s: float, peak: float) -> dict:
    return {
        "run": run,
        "step_s": step_s,
        "tok_s_gpu": 0.0,
        "mfu_per_tok_s": 1e-6,
        "peak_alloc_gib": peak,
        "peak_reserved_gib": peak + 1,
        "left_before_gib": 0.0,
        "loss": 1.0,
    }


def test_report_ratios_are_medians_of_per_round_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Round 2 is slow for everyone (a drifting host): per-round ratios cancel it, a ratio of
    # medians over all runs would not.
    steps = {"fully_shard": [1.0, 2.0, 1.0], "fsdp2": [1.1, 2.2, 1.2], "floor": [0.9, 1.8, 0.95]}
    peaks = {"fully_shard": [5.0, 5.0, 5.5], "fsdp2": [6.0, 6.0, 6.0], "floor": [8.0, 8.0, 8.0]}
    rounds = [{run: _result(run, steps[run][r], peaks[run][r]) for run in steps} for r in range(3)]
    out = tmp_path / "b.json"
    args = benchmark.parse_args(["--batch-size", "2", "--seq-len", "8", "--rounds", "3", "--out", str(out)])
    benchmark.report(rounds, args, 2, "GPU")
    ratios = json.loads(out.read_text())["ratios"]
    fs = ratios["fully_shard/fsdp2"]
    assert fs["throughput"] == pytest.approx(1.1)  # per round: 1.1, 1.1, 1.2
    assert fs["throughput_range"] == pytest.approx([1.1, 1.2])
    assert fs["peak_alloc"] == pytest.approx(5.5 / 6.0)  # largest peaks
    assert ratios["fully_shard/floor"]["throughput"] == pytest.approx(0.9)
    assert "replicate/ddp" not in ratios  # only pairs that ran
    printed = capsys.readouterr().out
    assert "fully_shard/fsdp2: throughput 1.100x (rounds 1.100-1.200), peak allocated 0.917x" in printed


def test_each_contender_starts_with_dtensor_caches_cleared() -> None:
    """An earlier contender's sharding decisions must not stay in DTensor's cache (a later
    contender's hits would compare specs field by field): `forget_dtensor_caches` empties it."""
    import torch
    from _harness import fake_process_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    def cached() -> int:  # the Python cache, plus the C++ fast path's where torch has one
        python = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_info().currsize
        native = getattr(torch._C, "_get_DTensor_sharding_propagator_cache_stats", None)
        return python + (native()[1] if native is not None else 0)

    with fake_process_group(2):
        t = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (2,)), [Replicate()])
        for _ in range(2):
            t = t * 2 + 1
        assert cached() > 0
        benchmark.forget_dtensor_caches()
        assert cached() == 0


def test_each_contender_starts_without_cublas_stream_workspaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuBLAS keeps a workspace per stream: the first contender to use a stream was charged with it."""
    cleared: list[bool] = []
    monkeypatch.setattr(benchmark.torch._C, "_cuda_clearCublasWorkspaces", lambda: cleared.append(True), raising=False)
    benchmark.release_stream_workspaces()
    monkeypatch.delattr(benchmark.torch._C, "_cuda_clearCublasWorkspaces")
    benchmark.release_stream_workspaces()  # a CPU build has no such call: nothing to free
    assert cleared == [True]


def test_rounds_alternate_the_order_of_the_contenders() -> None:
    runs = ["fully_shard", "fsdp2", "floor"]
    orders = [benchmark.round_order(runs, r) for r in range(4)]
    assert orders[0] == orders[2] == runs and orders[1] == orders[3] == runs[::-1]
    for run in runs:  # over two rounds every contender is as often early as late
        assert sum(order.index(run) for order in orders[:2]) == len(runs) - 1


def test_interval_arithmetic() -> None:
    a = overlap.union([Interval(5, 7), Interval(0, 2), Interval(1, 3)])
    assert a == [Interval(0, 3), Interval(5, 7)]
    assert overlap.total(a) == 5
    assert overlap.subtract(a, [Interval(1, 2), Interval(6, 10)]) == [Interval(0, 1), Interval(2, 3), Interval(5, 6)]
    assert overlap.subtract(a, []) == a
    assert overlap.subtract([], a) == []


def _kernel(name: str, ts: float, dur: float) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def test_trace_overlap_splits_compute_exposed_and_idle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = [
        _kernel("sm90_gemm", 0, 100),  # compute 0-100
        _kernel("ncclDevKernel_AllGather", 50, 100),  # comm 50-150: 50 exposed (100-150)
        _kernel("elementwise", 200, 50),  # idle 150-200, compute 200-250
        {"cat": "cpu_op", "name": "aten::_foreach_add_", "ts": 140, "dur": 30, "pid": 0, "tid": 1},
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    overlap.analyse(str(path), top=2)
    printed = capsys.readouterr().out
    assert "span 0.2 ms; compute 0.1 ms (60.0%), exposed communication 0.1 ms (20.0%), idle 0.1 ms (20.0%)" in printed
    assert "idle                     0.050 ms at +    0.1 ms  cpu: aten::_foreach_add_" in printed


needs_hf = pytest.mark.skipif(
    not bench_build.hf_available(), reason="transformers is not installed (pip install transformers)"
)
MODELS = ["own", pytest.param("hf-llama", marks=needs_hf)]


@pytest.mark.filterwarnings("ignore:DTensor random operators")  # init on a CPU mesh: expected
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("wrap", bench_build.WRAPS)
def test_both_fsdp_implementations_get_the_same_groups(wrap: str, model: str) -> None:
    """`--wrap` must shard ours and FSDP2 alike, or the comparison is not like for like."""
    import torch
    from _harness import fake_process_group
    from torch.distributed.fsdp import FSDPModule

    from composable import fully_shard

    cfg = benchmark.get_config("tiny")
    with fake_process_group(2):
        ours = bench_build.build("fully_shard", cfg, torch.device("cpu"), wrap, model).model
        theirs = bench_build.build("fsdp2", cfg, torch.device("cpu"), wrap, model).model
        ours_units = [name for name, m in ours.named_modules() if fully_shard.state(m) is not None]
        theirs_units = [name for name, m in theirs.named_modules() if isinstance(m, FSDPModule)]
    assert ours_units == theirs_units
    if model == "own":
        ends, layers = (["tok_embeddings", "output"] if wrap == "separate-ends" else []), "layers"
    else:
        ends, layers = (["model.embed_tokens", "lm_head"] if wrap == "separate-ends" else []), "model.layers"
    assert sorted(ours_units) == sorted(["", *ends, *(f"{layers}.{i}" for i in range(cfg.n_layers))])


def test_separate_ends_is_the_default_wrap() -> None:
    """Faster and leaner than 'blocks' for both us and FSDP2 on 2 x H200."""
    assert benchmark.parse_args([]).wrap == "separate-ends"


def test_hf_llama_without_transformers_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench_args, "hf_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        benchmark.parse_args(["--model", "hf-llama"])
    assert exc.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith(
            "error: --model hf-llama needs HuggingFace transformers, which is not installed: pip install transformers"
        )
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--runs", "floor,fsdp3"], "--runs: unknown run(s) ['fsdp3']"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--model", "gpt"], "argument --model: invalid choice: 'gpt'"),
        (["--dim", "4096", "--n-heads", "3"], "--dim/--n-heads: ModelConfig: dim 4096 must be divisible by n_heads 3"),
        (["--n-layers", "0"], "--n-layers must be >= 1, got 0"),
    ],
)
def test_bad_flags_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        benchmark.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:DTensor random operators")
@pytest.mark.parametrize("model", MODELS)
def test_compile_compiles_every_block_of_every_contender_before_the_apis(model: str) -> None:
    import torch
    from _harness import fake_process_group

    cfg = benchmark.get_config("tiny")
    with fake_process_group(2):
        for run in bench_build.RUNS:
            if run == "ddp":
                continue  # DDP needs real collectives at construction: the smoke run covers it
            net = bench_build.build(run, cfg, torch.device("cpu"), model=model, compile_backend="aot_eager").model
            blocks = bench_build.blocks(net)
            assert len(blocks) == cfg.n_layers
            assert all(b._compiled_call_impl is not None for b in blocks), run
            assert net._compiled_call_impl is None  # blocks only, as torchtitan does
            eager = bench_build.build(run, cfg, torch.device("cpu"), model=model).model
            assert all(b._compiled_call_impl is None for b in bench_build.blocks(eager))


def _smoke(rank: int, world_size: int, argv: list[str]) -> dict:
    """The whole GPU path (build, train, time, report) on 2 gloo ranks on the CPU."""
    import torch
    from _harness import smoke_argv

    args = benchmark.parse_args(smoke_argv(*argv))
    rounds = benchmark.run_rounds(args, torch.device("cpu"))
    for res in rounds[0].values():  # the timed steps' spread, around the median
        lo, hi = res["step_range_s"]
        assert 0 < lo <= hi, res
    return {run: res["loss"] for run, res in rounds[0].items()}


@needs_hf
@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_smoke_run_of_hf_llama_on_two_gloo_ranks() -> None:
    import math

    from _harness import run_on_ranks

    losses = run_on_ranks(_smoke, 2, ["--model", "hf-llama"], timeout=300)[0]
    assert list(losses) == list(bench_build.RUNS)
    assert all(math.isfinite(v) and 4.0 < v < 7.0 for v in losses.values()), losses  # about log(256) = 5.5


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_smoke_run_with_compiled_blocks() -> None:
    """Every contender with compiled blocks, fully_shard included, on our model."""
    import math

    from _harness import run_on_ranks

    losses = run_on_ranks(_smoke, 2, ["--compile", "--compile-backend", "aot_eager"], timeout=300)[0]
    assert list(losses) == list(bench_build.RUNS)
    assert all(math.isfinite(v) and 4.0 < v < 7.0 for v in losses.values()), losses


# --- --float8 (torchao) and the width flags ---

needs_torchao = pytest.mark.skipif(not bench_float8.float8_available(), reason="torchao is not installed")


def test_float8_without_torchao_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench_args, "float8_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        benchmark.parse_args(["--float8"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("error: --float8 needs torchao (float8 training), which is not installed: pip install torchao")


def test_only_linears_with_dims_divisible_by_16_convert_and_never_the_head() -> None:
    import torch.nn as nn

    head = nn.Linear(32, 48)
    assert bench_float8.convertible(nn.Linear(32, 48), head)
    assert not bench_float8.convertible(head, head)
    assert not bench_float8.convertible(nn.Linear(32, 40), head)  # out 40
    assert not bench_float8.convertible(nn.Linear(24, 48), head)  # in 24
    assert not bench_float8.convertible(nn.LayerNorm(32), head)


@pytest.mark.parametrize(
    "argv,shape",
    [
        ([], (2048, 16, 16, 5632)),
        (["--dim", "2048"], (2048, 16, 16, 5632)),  # Llama's rule gives the preset back
        (["--dim", "4096", "--n-layers", "8"], (4096, 8, 32, 11008)),  # Llama-7B's width
        (["--dim", "4096", "--n-heads", "16", "--ffn-dim", "8192"], (4096, 16, 16, 8192)),
    ],
)
def test_width_flags_override_the_preset(argv: list[str], shape: tuple[int, ...]) -> None:
    args = benchmark.parse_args(["--preset", "1b", *argv])
    cfg = benchmark.model_config(args)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.ffn_dim) == shape
    assert cfg.max_seq_len == args.seq_len


def test_width_flags_and_float8_are_named_in_the_table_header(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.bench_report import describe

    monkeypatch.setattr(bench_args, "float8_available", lambda: True)
    args = benchmark.parse_args(["--preset", "1b", "--dim", "4096", "--float8"])
    assert "preset 1b (dim=4096 n_heads=32 ffn_dim=11008), float8 (torchao)," in describe(args)
    assert "float8" not in describe(benchmark.parse_args([]))


@needs_torchao
@pytest.mark.filterwarnings("ignore:DTensor random operators")
@pytest.mark.parametrize("model", MODELS)
def test_float8_converts_every_block_linear_of_every_contender_but_the_head(model: str) -> None:
    """Every block's 7 linears become `Float8Linear`s, the head does not; the FSDP-style runs
    gather their weights in float8 (torchao's weight tensor inside the DTensor) and compute
    the next scales after each step; the others keep plain weights and do nothing after it."""
    import torch
    from _harness import fake_process_group
    from torchao.float8.float8_linear import Float8Linear

    cfg = benchmark.get_config("tiny")
    with fake_process_group(2):
        for run in bench_build.RUNS:
            if run == "ddp":
                continue  # DDP needs real collectives at construction: the smoke run covers it
            c = bench_build.build(run, cfg, torch.device("cpu"), model=model, compile_backend="aot_eager", float8=True)
            converted = [name for name, m in c.model.named_modules() if isinstance(m, Float8Linear)]
            assert len(converted) == 7 * cfg.n_layers, (run, converted)
            assert not isinstance(bench_build.head(c.model), Float8Linear)
            assert all(b._compiled_call_impl is not None for b in bench_build.blocks(c.model))
            weight = c.model.get_submodule(converted[0]).weight
            local = type(getattr(weight, "_local_tensor", weight)).__name__
            if run in ("fully_shard", "fsdp2"):
                assert local == "WeightWithDynamicFloat8CastTensor", run
                # each library's own scale precompute: composable's (in place) for fully_shard
                ours = run == "fully_shard"
                assert c.after_step is (bench_float8.after_step_in_place if ours else bench_float8.after_step)
            else:
                assert local in ("Parameter", "Tensor"), (run, local)
                assert c.after_step is bench_build.Contender._field_defaults["after_step"]
        graphed = bench_build.build("fully_shard_graphed", cfg, torch.device("cpu"), model=model, float8=True)
        assert graphed.after_step is bench_float8.after_step_in_place  # a graph captures it
        plain = bench_build.build("fully_shard", cfg, torch.device("cpu"), model=model).model
        assert not any(isinstance(m, Float8Linear) for m in plain.modules())


def test_train_step_calls_after_step_once_after_the_optimizer_step() -> None:
    """Where `precompute_float8_dynamic_scale_for_fsdp` runs: after the weights moved."""
    import torch

    net = torch.nn.Embedding(8, 8)
    before = net.weight.detach().clone()
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    seen = []

    def after(model: torch.nn.Module) -> None:
        seen.append((model, net.weight.grad, torch.equal(net.weight, before)))

    c = bench_build.Contender(net, contextlib.nullcontext, lambda m, t: m(t), after)
    benchmark.train_step(c, opt, torch.randint(0, 8, (2, 5)))
    assert seen == [(net, None, False)]  # once, the step taken and the gradients dropped


@needs_torchao
@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_smoke_run_with_float8_on_two_gloo_ranks() -> None:
    """Every contender trains a step in float8 on the CPU (gloo gathers float8 as bytes), the
    FSDP-style ones recomputing their scales after each step."""
    import math

    from _harness import run_on_ranks

    losses = run_on_ranks(_smoke, 2, ["--float8"], timeout=300)[0]
    assert list(losses) == list(bench_build.RUNS)
    assert all(math.isfinite(v) and 4.0 < v < 7.0 for v in losses.values()), losses


# --- --cpu-overhead: a crash at teardown costs no result, one before reporting is retried ---


def test_overhead_keeps_a_result_reported_before_a_crash_at_teardown() -> None:
    result, notes = bench_overhead.run_isolated(_crashing.abort_at_exit, (), world=8, fake=True, what="t", retries=0)
    assert result == "measured"
    assert notes == ["t: rank 0 killed by SIGABRT at teardown, after reporting (result kept)"]


def test_overhead_retries_a_crash_before_reporting_then_records_it() -> None:
    result, notes = bench_overhead.run_isolated(_crashing.abort_now, (), world=8, fake=True, what="t", retries=1)
    assert result is None
    assert notes == [f"t, attempt {i}: no result (rank 0 killed by SIGABRT)" for i in (1, 2)]


def test_optimizer_dispatch_cost_times_plain_and_dtensor_parameters() -> None:
    """The `--cpu-overhead` line that bounds replicate against DDP: the same SGD step over the
    tiny model's parameters, plain and as replicated DTensors (no hooks involved)."""
    from _harness import fake_process_group

    with fake_process_group(8):
        cost = bench_overhead.optimizer_dispatch_cost(3)
    assert cost["params"] == 128
    assert cost["plain"] > 0 and cost["dtensor"] > 0  # which is larger is for the benchmark to show
