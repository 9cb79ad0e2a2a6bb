"""`composable.optim.Muon` with a tensor learning rate, and stepped inside `graphed_step`.

CPU (gloo): under `fully_shard` at 2 ranks, Muon with a one-element tensor lr, changed in place
every step (a schedule), steps every parameter and momentum buffer bit for bit as Muon given the
float the tensor holds, with weight decay and both `adjust_lr_fn` scalings; its step reads no
tensor on the host (no `.item()`, `float()`, `bool()`, `.tolist()` of a value, no data-dependent
shape) at 1 and 2 ranks and on dp x tp; fp64 parameters are bitwise too, bf16 ones within
rounding on the CPU. `graphed_step`'s checks name a replaced tensor lr; a tensor lr of several
elements is refused in one line. The main job no longer refuses `--cuda-graph on --optimizer muon`.

GPUs (NCCL, 1 and 2): the tensor-lr kernels give the float lr's bits on CUDA (fp32 and bf16
parameters); a fully_shard model with Muon (tensor lr) and capturable AdamW trained through
`graphed_step`, its lr changed in place every step, equals the same training run eagerly, and
Muon given the float lr, bit for bit (losses, parameters, momenta); a CPU tensor lr is refused
before the capture; the main job trains with `--optimizer muon --cuda-graph on`.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import gpu_worlds, run_on_ranks
from _models import TinyTransformer, lm_loss
from test_muon import _model, _shard, _whole
from test_train_muon import MUON
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.optim._muon import _adjust_lr
from torch.utils._python_dispatch import TorchDispatchMode

from composable import GraphedStep, MixedPrecisionPolicy, fully_shard, graphed_step
from composable._graphed_checks import Recorder, Snapshot
from composable.optim import Muon
from composable.optim.muon import _apply_tensor_lr
from trainer import main_job as train_script
from trainer.options import cuda_graph_mode, cuda_graph_unsupported, parse_args

SCHEDULE = [0.02, 0.013, 0.031, 0.0071, 0.017]  # a new lr at every step


def _hidden(model: nn.Module) -> list[nn.Parameter]:
    """test_muon's split: the blocks' trainable matrices (not the head)."""
    return [p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2 and not n.startswith("2.")]


# -------------------------------------------------------------- CPU: the tensor lr's bits


def _tensor_vs_float(
    rank: int, world: int, adjust_lr_fn: str | None, lr_dtype: torch.dtype, lr_shape: tuple[int, ...], nesterov: bool
) -> None:
    models = {"tensor": _model(), "float": _model()}
    for model in models.values():
        _shard(model, "fully_shard", world)
    lr = torch.full(lr_shape, SCHEDULE[0], dtype=lr_dtype)
    opts = {
        "tensor": Muon(
            _hidden(models["tensor"]), lr=lr, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn
        ),
        "float": Muon(_hidden(models["float"]), lr=0.5, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn),
    }
    for step, value in enumerate(SCHEDULE):
        lr.fill_(value)  # in place: the optimizer holds this tensor
        opts["float"].param_groups[0]["lr"] = float(lr)  # the float the tensor holds
        for name, model in models.items():
            torch.manual_seed(100 * step + rank)
            model(torch.randn(4, 8)).square().mean().backward()
            opts[name].step()
            opts[name].zero_grad()
        assert opts["tensor"].param_groups[0]["lr"] is lr
        for (name, p), q in zip(models["tensor"].named_parameters(), models["float"].parameters()):
            assert torch.equal(_whole(p), _whole(q)), f"{name} differs from the float lr's after step {step}"
        for p, q in zip(_hidden(models["tensor"]), _hidden(models["float"])):
            mine, theirs = opts["tensor"].state[p]["momentum_buffer"], opts["float"].state[q]["momentum_buffer"]
            assert torch.equal(_whole(mine), _whole(theirs)), f"momentum differs after step {step}"


@pytest.mark.parametrize(
    "adjust_lr_fn, lr_dtype, lr_shape, nesterov",
    [("original", torch.float32, (), True), ("match_rms_adamw", torch.float64, (1,), False)],
    ids=["original-fp32-nesterov", "match_rms_adamw-fp64-shape1"],
)
def test_tensor_lr_steps_as_the_float_it_holds(
    adjust_lr_fn: str, lr_dtype: torch.dtype, lr_shape: tuple[int, ...], nesterov: bool
) -> None:
    """Uneven rows (a rank holding one row, one holding none), tall and wide matrices, weight
    decay: the owners' path, then the update with the tensor lr, every step a new lr. A lr of
    shape (1,) too (as a 0-dim one, it takes no part in type promotion)."""
    run_on_ranks(_tensor_vs_float, 2, adjust_lr_fn, lr_dtype, lr_shape, nesterov)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_parameter_dtypes(dtype: torch.dtype) -> None:
    """Plain tensors (whole here): fp64 bit for bit; bf16 within one bf16 rounding a step on the
    CPU, whose bf16 `add_` rounds its alpha to bf16 (on CUDA bit for bit: the GPU test below)."""
    torch.manual_seed(0)
    params = {k: [nn.Parameter(torch.randn(12, 7, dtype=dtype)) for _ in range(2)] for k in ("tensor", "float")}
    for a, b in zip(params["tensor"], params["float"]):
        b.data.copy_(a.data)
    lr = torch.tensor(SCHEDULE[0])
    opts = {
        "tensor": Muon(params["tensor"], lr=lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
        "float": Muon(params["float"], lr=0.5, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
    }
    for step, value in enumerate(SCHEDULE):
        lr.fill_(value)
        opts["float"].param_groups[0]["lr"] = float(lr)
        torch.manual_seed(step)
        grads = [torch.randn(12, 7, dtype=dtype) for _ in range(2)]
        for name, opt in opts.items():
            for p, g in zip(params[name], grads):
                p.grad = g.clone()
            opt.step()
        for a, b in zip(params["tensor"], params["float"]):
            if dtype == torch.float64:
                assert torch.equal(a, b), step
            else:  # at most one bf16 step apart; then the same again, for the next step's comparison
                torch.testing.assert_close(a, b, rtol=2**-7, atol=0)
                b.data.copy_(a.data)


def test_a_tensor_lr_of_several_elements_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^Muon: a tensor 'lr' must have one element, got 2$"):
        Muon([nn.Parameter(torch.zeros(2, 2))], lr=torch.tensor([0.1, 0.2]))


# ---------------------------------------------------------- CPU: nothing read on the host


_READS_VALUES = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}


class _HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's value on the host: `.item()`, `float()`, `bool()`
    (`_local_scalar_dense`), `nonzero`, `equal` and the like (data-dependent outputs), and
    `.tolist()`; but for reads of a device mesh's rank lists, which always live on the host (the
    mesh's slicing and flattening, and `_rows_group`'s ranks in row order)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        reads = func is torch.ops.aten._local_scalar_dense.default or bool(_READS_VALUES & set(func.tags))
        if reads and not _in_device_mesh():
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def watching(self) -> Any:
        tolist = torch.Tensor.tolist

        def recorded(t: torch.Tensor) -> Any:
            if not _in_device_mesh():
                self.found.append("tolist")
            return tolist(t)

        torch.Tensor.tolist = recorded  # type: ignore[method-assign]  # restored below
        try:
            with self:
                yield
        finally:
            torch.Tensor.tolist = tolist  # type: ignore[method-assign]  # restoring the original


def _in_device_mesh() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(os.path.join("distributed", "device_mesh.py")) or code.co_name == "_rows_group":
            return True
        frame = frame.f_back
    return False


def _host_reads(rank: int, world: int, layout: str) -> list[str]:
    model = _model(layout)
    _shard(model, layout, world)
    lr = torch.tensor(0.02)
    opt = Muon(_hidden(model), lr=lr, weight_decay=0.1)
    found = []
    for step in range(2):  # the first step makes the momentum buffers
        torch.manual_seed(step + rank)
        model(torch.randn(4, 8)).square().mean().backward()
        lr.fill_(SCHEDULE[step])
        watch = _HostReads()
        with watch.watching():
            opt.step()
        found += watch.found
        opt.zero_grad()
    watch = _HostReads()
    with watch.watching():  # the watch itself sees what the float path did, and a branch on a value
        float(lr), lr.tolist(), bool(lr > 0), lr.nonzero()
    assert watch.found == ["aten._local_scalar_dense.default", "tolist", *watch.found[2:]], watch.found
    assert len(watch.found) == 4, watch.found
    return found


@pytest.mark.parametrize("layout, world", [("fully_shard", 1), ("fully_shard", 2), ("tp", 4)], ids=str)
def test_the_tensor_lr_step_reads_nothing_on_the_host(layout: str, world: int) -> None:
    """At one rank (the owners' all-to-alls over one) and several, and on dp x tp (row-parallel
    matrices laid out by rows and back, by DTensor): what a captured step must not do."""
    for found in run_on_ranks(_host_reads, world, layout):
        assert found == [], found


# --------------------------------------------------------------- CPU: graphed_step's checks


def test_a_tensor_lr_may_change_in_place_but_not_be_replaced() -> None:
    weight = nn.Parameter(torch.ones(4, 3))
    opt = Muon([weight], lr=torch.tensor(0.02))
    weight.grad = torch.ones(4, 3)
    recorder = Recorder()
    with recorder:
        opt.step()
    snapshot = Snapshot(recorder)
    opt.param_groups[0]["lr"].fill_(0.01)  # read at every replay
    snapshot.check()
    opt.param_groups[0]["lr"] = torch.tensor(0.01)
    with pytest.raises(
        RuntimeError,
        match=r"^graphed_step: Muon changed since capture: lr replaced by another tensor \(a graph reads the "
        r"captured one at every replay: change it in place\)$",
    ):
        snapshot.check()
    opt.param_groups[0]["lr"] = 0.01
    with pytest.raises(RuntimeError, match=r"lr was a tensor, is 0.01 .*give lr as a tensor and change it in place"):
        snapshot.check()


# ------------------------------------------------------------------------- the main job


def test_the_main_job_takes_muon_with_cuda_graph_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = parse_args([*MUON, "--cuda-graph", "on", "--out", str(tmp_path)])
    assert cuda_graph_unsupported(args, "cuda") is None
    assert cuda_graph_mode(args, "cuda") == (True, "--cuda-graph on")


# ----------------------------------------------------------------------------- GPUs (NCCL)


def _kernel_bits(rank: int, world: int) -> None:
    """The float lr's `mul_` and `add_(alpha=)` against the tensor lr's kernels, on CUDA, over
    sizes that take the vectorized kernels and their tails."""
    torch.cuda.set_device(rank)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, cols in ((1, 3), (7, 33), (96, 32), (1024, 1031)):
            for lr_value, wd, fn in ((0.02, 0.1, "original"), (3.7e-4, 0.01, "match_rms_adamw"), (0.013, 0.0, None)):
                param = (torch.randn(rows, cols, device="cuda", generator=gen) * 0.05).to(dtype)
                update = torch.randn(rows, cols, device="cuda", generator=gen).bfloat16()
                lr = torch.tensor(lr_value, device="cuda")
                want, got = param.clone(), param.clone()
                as_float = float(lr)
                want.mul_(1 - as_float * wd)
                want.add_(update, alpha=-_adjust_lr(as_float, fn, want.shape))
                _apply_tensor_lr([got], [update], lr, wd, fn)
                differ = (want != got).sum().item()
                assert differ == 0, f"{dtype} ({rows}, {cols}) lr {lr_value} wd {wd} {fn}: {differ} elements differ"


@pytest.mark.parametrize("world", gpu_worlds(1))
def test_gpu_tensor_lr_kernels_give_the_float_lr_bits(world: int) -> None:
    run_on_ranks(_kernel_bits, world, backend="nccl", timeout=300)


STEPS = 6  # two warm-up steps, the capture, three replays


def _build(world: int, muon_lr: float | torch.Tensor) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, dim=32, heads=4, layers=3, seq=16).cuda()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cuda", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    hidden = [p for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2]
    rest = [p for n, p in model.named_parameters() if not (n.startswith("layers.") and p.ndim == 2)]
    adamw_lr = torch.tensor(1e-2, device="cuda")
    return model, [
        Muon(hidden, lr=muon_lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=adamw_lr, fused=True, capturable=True),
    ]


def _step_fn(model: nn.Module, opts: list[torch.optim.Optimizer]) -> Any:
    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model, tokens)
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _graphed_vs_eager(rank: int, world: int) -> None:
    torch.cuda.set_device(rank)
    results = {}
    for mode in ("graphed", "eager", "eager, float lr"):
        muon_lr: float | torch.Tensor = 0.5 if mode == "eager, float lr" else torch.tensor(0.5, device="cuda")
        model, opts = _build(world, muon_lr)
        step = _step_fn(model, opts)
        run = graphed_step(step, warmup=2) if mode == "graphed" else step
        gen = torch.Generator(device="cuda").manual_seed(100 + rank)
        losses = []
        for i in range(STEPS):
            value = 0.02 * (1 - i / STEPS)  # a schedule: every step a new lr, set in place
            if isinstance(muon_lr, torch.Tensor):
                muon_lr.fill_(value)
            else:
                opts[0].param_groups[0]["lr"] = float(torch.tensor(value))  # the float an fp32 tensor holds
            opts[1].param_groups[0]["lr"].fill_(value / 2)
            losses.append(run(torch.randint(0, 64, (4, 16), device="cuda", generator=gen)).item())
        if mode == "graphed":
            assert isinstance(run, GraphedStep) and run.graph is not None, "the step was never captured"
        params = [_whole(p).detach().cpu() for p in model.parameters()]
        momenta = [_whole(opts[0].state[p]["momentum_buffer"]).cpu() for p in opts[0].param_groups[0]["params"]]
        results[mode] = (losses, params, momenta)
    want_losses, want_params, want_momenta = results["graphed"]
    for mode in ("eager", "eager, float lr"):
        losses, params, momenta = results[mode]
        assert losses == want_losses, f"{mode}: losses {losses}, graphed {want_losses}"
        assert all(torch.equal(a, b) for a, b in zip(params, want_params)), f"{mode}: parameters differ"
        assert all(torch.equal(a, b) for a, b in zip(momenta, want_momenta)), f"{mode}: momenta differ"
    dist.barrier()


@pytest.mark.parametrize("world", gpu_worlds(1, 2))
def test_gpu_muon_with_a_schedule_trains_in_a_graph_as_eagerly(world: int) -> None:
    """The owners' all-to-alls, Newton-Schulz and the tensor-lr update captured with the
    forward, backward and AdamW's step: the graph replays them with each step's lr."""
    run_on_ranks(_graphed_vs_eager, world, backend="nccl", timeout=600)


def _cpu_lr_refused(rank: int, world: int) -> str:
    torch.cuda.set_device(rank)
    model, opts = _build(world, torch.tensor(0.02))  # on the CPU: a kernel would take it as a scalar
    step = graphed_step(_step_fn(model, opts), warmup=1)
    tokens = torch.randint(0, 64, (4, 16), device="cuda")
    step(tokens)  # eager: the CPU tensor is copied to the GPU at every step
    with pytest.raises(ValueError) as caught:
        step(tokens)
    dist.barrier()
    return str(caught.value)


@pytest.mark.parametrize("world", gpu_worlds(1))
def test_gpu_a_cpu_tensor_lr_is_refused_before_the_capture(world: int) -> None:
    message = run_on_ranks(_cpu_lr_refused, world, backend="nccl", timeout=300)[0]
    assert message.startswith("graphed_step: Muon's param_groups[0] has its lr tensor on cpu: kernels would take")


def _main_job_graphed(rank: int, world: int, out: str) -> None:
    torch.cuda.set_device(rank)
    histories = {}
    for graph in ("on", "off"):
        with contextlib.redirect_stdout(io.StringIO()):
            result = train_script.train(
                parse_args([*MUON, "--steps", "6", "--cuda-graph", graph, "--out", f"{out}/{graph}"])
            )
        assert result["cuda_graph"] is (graph == "on"), result["cuda_graph"]
        histories[graph] = [h["loss"] for h in result["history"]]
    graphed, eager = histories["on"], histories["off"]
    assert len(graphed) == 6 and all(math.isfinite(v) for v in graphed) and graphed[-1] < graphed[0], graphed
    # Not bit for bit: a graphed run's AdamW is fused and capturable and its lr an fp32 tensor.
    assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(graphed, eager)), (graphed, eager)


@pytest.mark.parametrize("world", gpu_worlds(1, 2))
def test_gpu_the_main_job_trains_muon_in_a_graph(world: int, tmp_path: Path) -> None:
    run_on_ranks(_main_job_graphed, world, str(tmp_path), backend="nccl", timeout=600, fresh=True)
