"""examples/train.py's `--cuda-graph` and its step function (examples/trainer/train_step.py).

CPU only (a graph needs a GPU): `--cuda-graph on` without CUDA, or with a run graphs do not
support, is refused in one line; `auto` resolves as documented; on the CPU a run trains exactly
as the inline loop train.py had before the step moved out (every loss and gradient norm);
and what train.py does between two steps of a graphed run (the lr set in place, an
evaluation, a checkpoint save) leaves everything a captured graph depends on as it was,
checked with graphed_step's own pre-replay check (AdamW, and --optimizer muon's MuonAdamW).
Checkpoints of graphed and eager runs load into each other.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import run_on_ranks
from torch.distributed.tensor import DTensor

from composable import ShardedGradScaler, clip_grad_norm_, fully_shard, no_sync
from composable._graphed_checks import Recorder as _Recorder
from composable._graphed_checks import Snapshot as _Snapshot
from models.model import Transformer, lm_loss
from trainer import main_job as train_script
from trainer.checkpointing import load_checkpoint, save_checkpoint
from trainer.data import ByteCorpus, get_batch
from trainer.options import cuda_graph_mode, model_config, parse_args
from trainer.parallel import UsageError, build_mesh, parallelize
from trainer.schedule import build_optimizer, evaluate, lr_at, world_mean
from trainer.train_step import build_graph_optimizer, checkpoint_ready, make_train_step, set_lr

# test_train_example.py's small model: a few steps take a fraction of a second per rank.
SMALL = (
    "--preset tiny --dim 32 --n-layers 2 --n-heads 2 --ffn-dim 64 --seq-len 32 --batch-size 4 --lr 1e-2 "
    "--warmup-steps 2 --eval-batches 1 --eval-every 0 --ckpt-every 0 --quiet"
).split()
STEPS = 3

# ------------------------------------------------------------------------- the flag's rules

NO_CUDA = "--cuda-graph on: CUDA graphs need a CUDA device, and torch.cuda.is_available() is False"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_on_without_cuda_is_one_line_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*SMALL, "--cuda-graph", "on", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"train.py: error: {NO_CUDA}\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_main_on_without_cuda_fails_before_spawning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RANK", "WORLD_SIZE"):  # no launcher: main() would spawn its own ranks
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(train_script, "spawn_local", lambda *a: pytest.fail("spawned ranks"))
    with pytest.raises(SystemExit) as exit_info:
        train_script.main([*SMALL, "--cuda-graph", "on", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr() == ("", f"train.py: error: {NO_CUDA}\n")
    assert not any(tmp_path.iterdir())  # no run directory either


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (
            ["--parallel", "replicate", "--pp", "2"],
            "--pp: a pipeline schedule's step (its sends and receives) is not captured",
        ),
        (["--cpu-offload"], "--cpu-offload steps the optimizer on the CPU, which a CUDA graph cannot hold"),
        (
            ["--cpu-offload", "optimizer-state"],
            "--cpu-offload optimizer-state streams the optimizer state through host memory, which a CUDA graph cannot hold",
        ),
    ],
)
def test_on_with_an_unsupported_option_is_refused_with_cuda(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, flags: list[str], reason: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        parse_args([*SMALL, *flags, "--cuda-graph", "on", "--out", str(tmp_path)])
    assert capsys.readouterr().err == f"train.py: error: --cuda-graph on: {reason}\n"
    args = parse_args([*SMALL, *flags, "--out", str(tmp_path)])  # auto: accepted, and off
    assert cuda_graph_mode(args, "cuda") == (False, reason)


def _args(*flags: str) -> argparse.Namespace:
    """The flags cuda_graph_mode reads: auto, fsdp, bf16, no offload, changed by "name=value"."""
    settings = {"cuda_graph": "auto", "parallel": "fsdp", "cpu_offload": False, "mp": "bf16"}
    return argparse.Namespace(**settings | dict(f.split("=", 1) for f in flags))


@pytest.mark.parametrize(
    ("flags", "device", "expected"),
    [
        ((), "cuda", (True, "auto")),
        (("parallel=hsdp",), "cuda", (True, "auto")),
        (("parallel=tp",), "cuda", (True, "auto")),
        (("parallel=tp", "async_tp=True"), "cuda", (True, "auto")),
        (("parallel=replicate", "mp=fp32"), "cuda", (True, "auto")),
        (("mp=fp16",), "cuda", (False, "--mp fp16: not yet proven under a graph; --cuda-graph on to try")),
        (("mp=fp16", "cuda_graph=on"), "cuda", (True, "--cuda-graph on")),
        (("cuda_graph=off",), "cuda", (False, "--cuda-graph off")),
        ((), "cpu", (False, "CUDA graphs need a CUDA device, and this rank trains on the cpu")),
        (("cuda_graph=off",), "cpu", (False, "--cuda-graph off")),
        (
            ("parallel=hsdp", "fault_tolerant=True"),
            "cuda",
            (False, "--fault-tolerant: each step's quorum and vote to commit run on the host, between the GPU's work"),
        ),
    ],
)
def test_mode_resolves_as_documented(flags: tuple[str, ...], device: str, expected: tuple[bool, str]) -> None:
    assert cuda_graph_mode(_args(*flags), device) == expected


def test_on_is_refused_at_setup_when_the_rank_trains_on_the_cpu() -> None:
    """A machine with fewer GPUs than local ranks trains on gloo: known only on the rank."""
    with pytest.raises(UsageError, match=r"^--cuda-graph on: CUDA graphs need a CUDA device, and this rank trains"):
        cuda_graph_mode(_args("cuda_graph=on"), "cpu")


def test_set_lr_fills_a_tensor_in_place_and_replaces_a_number() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    lr = torch.tensor(1.0)
    tensor_opt, plain_opt = torch.optim.AdamW([p], lr=lr, fused=True), torch.optim.AdamW([p], lr=1.0)
    set_lr(tensor_opt, 0.25)
    set_lr(plain_opt, 0.25)
    assert tensor_opt.param_groups[0]["lr"] is lr and lr.item() == 0.25
    assert plain_opt.param_groups[0]["lr"] == 0.25


# ------------------------------------------------------------ on the CPU: training as before


def _build(args: argparse.Namespace, graph_optimizer: bool = False) -> tuple[Any, ...]:
    """What train.py builds on the CPU: the model (whole, then parallelized), optimizer, scaler."""
    mesh, dp_mesh, dp_rank, _ = build_mesh(args, "cpu")
    torch.manual_seed(args.seed)
    model = Transformer(model_config(args))
    parallelize(model, args, mesh, dp_mesh)
    build = build_graph_optimizer if graph_optimizer else (lambda m, a, _d: build_optimizer(m, a))
    optimizer = build(model, args, torch.device("cpu"))
    return model, optimizer, ShardedGradScaler(enabled=args.mp == "fp16"), dp_rank


def _inline_step(model: Any, optimizer: Any, scaler: Any, args: argparse.Namespace, xs: Any, ys: Any) -> Any:
    """The step as train.py ran it inline before train_step.py (copied, .item() included)."""
    hsdp_accum = args.parallel == "hsdp" and args.grad_accum > 1
    loss_sum = torch.zeros(())
    for micro, (x, y) in enumerate(zip(xs.chunk(args.grad_accum), ys.chunk(args.grad_accum))):
        last = micro == args.grad_accum - 1
        if hsdp_accum:
            fully_shard.state(model).set_requires_all_reduce(last)
            ctx: Any = contextlib.nullcontext()
        else:
            ctx = contextlib.nullcontext() if last else no_sync(model)
        with ctx:
            loss = lm_loss(model(x), y) / args.grad_accum
            scaler.scale(loss).backward()
        loss_sum += loss.detach()
    grad_norm = None
    if args.max_norm > 0:
        scaler.unscale_(optimizer)
        grad_norm = clip_grad_norm_(model.parameters(), args.max_norm).item()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


def _three_ways(rank: int, world: int, argv: list[str]) -> dict[str, list[tuple[Any, ...]]]:
    """(loss, grad norm, lr) per step: the inline loop, make_train_step, and train.py itself."""
    args = parse_args(argv)
    args.mp, args.compile = "fp32", False  # what train() settles on the CPU
    corpus, histories = ByteCorpus.load(), {}
    for way in ("inline", "factory"):
        model, optimizer, scaler, dp_rank = _build(args)
        hsdp_accum = args.parallel == "hsdp" and args.grad_accum > 1
        step_fn = make_train_step(model, optimizer, scaler, args, hsdp_accum)
        model.train()
        history = []
        for step in range(1, STEPS + 1):
            lr = lr_at(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = args.batch_size * args.grad_accum
            xs, ys = get_batch(corpus.train, batch, args.seq_len, seed=args.seed, step=step, rank=dp_rank)
            if way == "inline":
                loss_sum, grad_norm = _inline_step(model, optimizer, scaler, args, xs, ys)
            else:
                loss_sum, norm = step_fn(xs, ys)
                assert isinstance(loss_sum, torch.Tensor) and (norm is None or isinstance(norm, torch.Tensor))
                grad_norm = None if norm is None else norm.item()
            history.append((world_mean(loss_sum), grad_norm, lr))
        histories[way] = history
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # train.py's messages (tqdm.write) go to sys.stdout
        result = train_script.train(parse_args([a for a in argv if a != "--quiet"]))
    assert result["cuda_graph"] is False
    histories["train.py"] = [(h["loss"], h["grad_norm"], h["lr"]) for h in result["history"]]
    if rank == 0:
        assert "cuda graph: off (CUDA graphs need a CUDA device, and this rank trains on the cpu)" in out.getvalue()
    return histories


@pytest.mark.parametrize(
    "flags",
    [
        ["--grad-accum", "2"],  # no_sync on the first micro-batch, clipping
        ["--parallel", "hsdp", "--grad-accum", "2"],  # the all-reduce across replicas deferred
        ["--parallel", "replicate", "--max-norm", "0"],  # no clipping: grad_norm None
    ],
    ids=["fsdp-accum", "hsdp-accum", "replicate-noclip"],
)
def test_auto_on_cpu_trains_as_the_inline_loop_did(tmp_path: Path, flags: list[str]) -> None:
    argv = [*SMALL, "--steps", str(STEPS), "--cuda-graph", "auto", "--out", str(tmp_path), *flags]
    for histories in run_on_ranks(_three_ways, 2, argv):
        inline = histories["inline"]
        assert len(inline) == STEPS and all(loss > 0 for loss, _, _ in inline)
        assert all((norm is None) == ("--max-norm" in flags) for _, norm, _ in inline)
        assert histories["factory"] == inline  # exactly: the same operations in the same order
        assert histories["train.py"] == inline


# -------------------------------------------- between two steps: what a captured graph needs


def _saved_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone().float().cpu()

    state = optimizer.state
    return [local(state[p][k]) for g in optimizer.param_groups for p in g["params"] for k in sorted(state[p])]


def _between_steps(rank: int, world: int, argv: list[str], out: str) -> None:
    args = parse_args(argv)
    args.mp, args.compile = "fp32", False
    corpus = ByteCorpus.load()
    # The graphed run's optimizer (fused and capturable work on the CPU too); train.py's step.
    model, optimizer, scaler, dp_rank = _build(args, graph_optimizer=True)
    lr_tensor = optimizer.param_groups[0]["lr"]
    assert isinstance(lr_tensor, torch.Tensor) and all(g["lr"] is lr_tensor for g in optimizer.param_groups)
    adamw_groups = [g for g in optimizer.param_groups if "capturable" in g]  # --optimizer muon: Muon's have none
    assert adamw_groups and all(g["capturable"] and g["fused"] for g in adamw_groups)
    step_fn = make_train_step(model, optimizer, scaler, args, hsdp_accum=False)
    model.train()

    def run(step: int) -> None:
        set_lr(optimizer, lr_at(step, args))
        step_fn(*get_batch(corpus.train, args.batch_size, args.seq_len, seed=0, step=step, rank=dp_rank))

    run(1)
    recorder = _Recorder()
    with recorder:  # the last warm-up step: what graphed_step records and then checks
        run(2)
    snapshot = _Snapshot(recorder)
    assert len(snapshot.modules) > 3 and snapshot.optimizers[0] is optimizer  # then MuonAdamW's own two
    # What train.py does between two replays.
    set_lr(optimizer, lr_at(3, args))
    evaluate(model, corpus, args, args.seq_len, dp_rank, torch.device("cpu"))
    with checkpoint_ready(optimizer):
        path = save_checkpoint(out, 2, model, optimizer, {"step": 2}, keep=1)
    snapshot.check()  # raises naming what changed, as graphed_step would before a replay
    assert all(g["lr"] is lr_tensor for g in optimizer.param_groups)
    assert lr_tensor.item() == pytest.approx(lr_at(3, args))
    model.eval()  # the check can fail: an evaluation that left eval mode on would be caught
    with pytest.raises(RuntimeError, match=r"graphed_step: Transformer changed since capture: training was True"):
        snapshot.check()
    model.train()

    # The checkpoint (its lr a plain number) loads into an eager run and into a graphed one;
    # each keeps its own lr and optimizer flags, and gets the saved state.
    saved = _saved_state(optimizer)
    for graphed in (False, True):
        model2, optimizer2, _, _ = _build(args, graph_optimizer=graphed)
        own = [{k: g[k] for k in ("lr", "capturable", "fused", "foreach") if k in g} for g in optimizer2.param_groups]
        with checkpoint_ready(optimizer2):
            load_checkpoint(path, model2, optimizer2)
        assert [{k: g[k] for k in kept} for g, kept in zip(optimizer2.param_groups, own)] == own
        got = _saved_state(optimizer2)
        assert len(got) == len(saved) and all(torch.equal(a, b) for a, b in zip(got, saved))
        set_lr(optimizer2, lr_at(3, args))
        optimizer2.step()  # steps with the run's own settings (no grads: a no-op, but it runs)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_between_steps_nothing_a_graph_depends_on_changes(tmp_path: Path, optimizer: str) -> None:
    """With --optimizer muon the graphed run's MuonAdamW: its Muon groups read AdamW's lr tensor."""
    argv = [*SMALL, "--optimizer", optimizer, "--out", str(tmp_path)]
    run_on_ranks(_between_steps, 2, argv, str(tmp_path / "run"))
