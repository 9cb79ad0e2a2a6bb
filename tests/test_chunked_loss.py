"""The chunked language-model loss (examples/models/chunked_loss.py, `--loss-chunk`): the model's
head computes the mean next-token cross entropy a chunk of tokens at a time, each chunk
checkpointed. It is `lm_loss(model(x), y)` with the same gradients, for any chunk size; it
trains as the plain loss does under composable's and PyTorch's fully_shard (the head a group of
its own), replicate and DDP, gathering the head once per forward; its recompute in backward sees
the head's weight unsharded again by the pre-backward hook; the benchmark and the main job take
`--loss-chunk` and refuse the combinations it does not serve in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from _harness import count_collectives, run_on_ranks, smoke_argv
from test_train_example import SMALL, _run  # its ranks and its small model
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor

import composable
from benchmarks import side_by_side as benchmark
from models import chunked_loss
from models.model import ModelConfig, Transformer, lm_loss, model_loss
from trainer import options

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16)
BATCH, SEQ = 2, 12  # 24 tokens per rank and step


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize("chunk", [8, 10, 24, 1000], ids=["divides", "does-not-divide", "all-tokens", "more"])
def test_chunked_loss_is_lm_loss_with_the_same_gradients(chunk: int) -> None:
    torch.manual_seed(0)
    model = Transformer(CFG)
    x, y = _batch(0)
    plain = lm_loss(model(x), y)
    plain.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    chunked = model(x, y, chunk)
    chunked.backward()
    assert chunked.dtype == torch.float32 and chunked.shape == ()
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad():  # evaluation: nothing checkpointed, the same value
        torch.testing.assert_close(model(x, y, chunk), plain.detach(), rtol=1e-5, atol=0)


def test_the_head_is_still_a_linear_with_the_same_state_dict_and_logits() -> None:
    """Checkpoints, tensor-parallel styles and float8 filters see the nn.Linear they saw."""
    torch.manual_seed(0)
    model = Transformer(CFG)
    assert isinstance(model.output, nn.Linear) and "output.weight" in model.state_dict()
    x, y = _batch(1)
    torch.testing.assert_close(model(x), nn.functional.linear(model.norm(_hidden(model, x)), model.output.weight))
    assert model_loss(model, x, y) == lm_loss(model(x), y)
    torch.testing.assert_close(model_loss(model, x, y, 5), lm_loss(model(x), y), rtol=1e-5, atol=0)


def _hidden(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    h = model.tok_embeddings(x)
    for block in model.layers:
        h = block(h, model.rope)
    return h


def test_bad_chunks_and_shapes_are_refused() -> None:
    head = chunked_loss.LMHead(4, 8, bias=False)
    h, t = torch.randn(2, 3, 4), torch.randint(0, 8, (2, 3))
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0"):
        head(h, t, 0)
    with pytest.raises(ValueError, match="targets given without chunk_tokens"):
        head(h, t)
    with pytest.raises(ValueError, match=r"hidden \(2, 3, 4\) and targets \(3, 2\)"):
        head(h, t.T, 2)


# ----------------------------------------------------------------------------- 2 gloo ranks

SHARDED = ("composable", "fsdp2")


def _parallelize(model: Transformer, api: str) -> nn.Module:
    """`api` applied as the jobs apply it: fully_shard on the embeddings, the head (a group of
    its own: `--wrap separate-ends`), every block and the root; or replicate / DDP on the root."""
    if api in SHARDED:
        shard = composable.fully_shard if api == "composable" else fsdp2_fully_shard
        for module in (model.tok_embeddings, model.output, *model.layers, model):
            shard(module)
        return model
    if api == "replicate":
        composable.replicate(model)
        return model
    return nn.parallel.DistributedDataParallel(model)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def _train_three_steps(rank: int, world_size: int, api: str, loss_chunk: int) -> dict[str, Any]:
    """Three AdamW steps of the model under `api` with the plain loss and with the chunked
    one: both runs' losses and final parameters, and the all-gathers of each one's steps
    (forward alone, and whole steps)."""
    out: dict[str, Any] = {}
    for chunk in (0, loss_chunk):
        torch.manual_seed(0)
        model = _parallelize(Transformer(CFG), api)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        with count_collectives() as steps:
            for step in range(3):
                x, y = _batch(100 * rank + step)
                with count_collectives() as forward:
                    loss = model_loss(model, x, y, chunk)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        names = [n.removeprefix("module.") for n, _ in model.named_parameters()]
        out[str(chunk)] = {
            "losses": losses,
            "params": dict(zip(names, (_full(p) for p in model.parameters()))),
            "gathers": (forward.counts["all_gather"], steps.counts["all_gather"]),
        }
    return out


@pytest.mark.parametrize("api", [*SHARDED, "replicate", "ddp"])
def test_chunked_loss_trains_as_the_plain_loss_on_two_ranks(api: str) -> None:
    for res in run_on_ranks(_train_three_steps, 2, api, 10):
        plain, chunked = res["0"], res["10"]
        torch.testing.assert_close(chunked["losses"], plain["losses"], rtol=1e-4, atol=0)
        for name, p in plain["params"].items():
            torch.testing.assert_close(chunked["params"][name], p, rtol=1e-4, atol=1e-5, msg=f"{api} {name}")
        # The head is gathered by its one forward call, not once per chunk (3 chunks here).
        assert chunked["gathers"] == plain["gathers"], (chunked["gathers"], plain["gathers"])
        if api in SHARDED:
            assert chunked["gathers"][0] > 0


def _head_weight_in_recompute(rank: int, world_size: int, api: str) -> dict[str, Any]:
    """What each call of a chunk's loss sees as the head's weight, in forward and in backward's
    recompute, under `api`'s fully_shard; and the weight's storage between the two."""
    torch.manual_seed(0)
    model = _parallelize(Transformer(CFG), api)
    full = _full(model.output.weight)
    seen: list[dict[str, Any]] = []
    phase = ["forward"]
    real = chunked_loss._chunk_loss_sum

    def recording(hidden: torch.Tensor, weight: torch.Tensor, bias: Any, targets: torch.Tensor) -> torch.Tensor:
        nbytes = weight.untyped_storage().nbytes()
        seen.append(
            {
                "phase": phase[0],
                "weight": weight,
                "unsharded": nbytes == full.numel() * full.element_size() and torch.equal(weight.detach(), full),
            }
        )
        return real(hidden, weight, bias, targets)

    chunked_loss._chunk_loss_sum = recording
    try:
        x, y = _batch(rank)
        loss = model(x, y, 10)
        phase[0] = "backward"
        between = seen[0]["weight"].untyped_storage().nbytes()
        loss.backward()
    finally:
        chunked_loss._chunk_loss_sum = real
    return {
        "phases": [s["phase"] for s in seen],
        "unsharded": [s["unsharded"] for s in seen],
        "one_tensor": all(s["weight"] is seen[0]["weight"] for s in seen),
        "bytes_between": between,
        "grad": model.output.weight.grad is not None,
    }


@pytest.mark.parametrize("api", SHARDED)
def test_recompute_sees_the_head_unsharded_again_by_its_pre_backward_hook(api: str) -> None:
    """The checkpoint recomputes each chunk with the tensor forward handed it: fully_shard freed
    that tensor's storage after forward (the head is resharded) and the head's pre-backward hook
    gathered the weight into it again before autograd reached the first recompute."""
    for res in run_on_ranks(_head_weight_in_recompute, 2, api):
        assert res["phases"] == ["forward"] * 3 + ["backward"] * 3, res  # 24 tokens, chunks of 10
        assert all(res["unsharded"]), res
        assert res["one_tensor"] and res["grad"], res
        assert res["bytes_between"] == 0, res  # freed between forward and backward


# ----------------------------------------------------------------------------- the benchmark


def _bench_losses(rank: int, world_size: int, extra: list[str]) -> dict[str, float]:
    args = benchmark.parse_args(smoke_argv(*extra))
    return {run: res["loss"] for run, res in benchmark.run_rounds(args, torch.device("cpu"))[0].items()}


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_benchmark_gives_every_contender_the_chunked_loss() -> None:
    """The smoke run (16 tokens a rank, chunks of 5): every contender's loss after a step is the
    one it has with the plain loss, to the rounding of its bf16 compute (the head's gradient,
    summed chunk by chunk, rounds otherwise)."""
    plain, chunked = (run_on_ranks(_bench_losses, 2, extra, timeout=300) for extra in ([], ["--loss-chunk", "5"]))
    for want, got in zip(plain, chunked):
        assert list(got) == list(want) == ["floor", "fully_shard", "fsdp2", "replicate", "ddp"], got
        for run, loss in got.items():
            assert loss == pytest.approx(want[run], rel=1e-4), (run, got, want)


BENCH_ERRORS = [
    (["--loss-chunk", "-1"], "--loss-chunk must be >= 0 (0: the plain loss), got -1"),
    (["--loss-chunk", "8", "--model", "hf-llama"], "--loss-chunk 8 needs --model own (the chunked loss is its head's)"),
    (["--loss-chunk", "8", "--mesh", "tp"], "--loss-chunk 8 with a tensor-parallel mesh (--mesh tp)"),
    (["--loss-chunk", "8", "--mesh", "hsdp", "--tp-size", "2"], "(--mesh hsdp --tp-size): its vocabulary-sharded"),
]


@pytest.mark.parametrize("argv,message", BENCH_ERRORS, ids=["negative", "hf-llama", "tp", "hsdp-tp"])
def test_benchmark_refuses_loss_chunk_where_it_does_not_apply(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        benchmark.parse_args(smoke_argv(*argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in err[-1] and message in err[-1] and "Traceback" not in "".join(err), err


# ----------------------------------------------------------------------------- the main job


def test_main_job_trains_with_the_chunked_loss_as_with_the_plain_one(tmp_path: Path) -> None:
    """Four steps and an evaluation of train.py's fsdp run (128 tokens a rank, chunks of 48):
    the training and held-out losses of the plain loss, to fp32 rounding."""
    argv = [*SMALL, "--steps", "4", "--eval-every", "0", "--ckpt-every", "0"]
    runs = [
        _run([*argv, "--out", str(tmp_path / name), *extra])
        for name, extra in (("plain", []), ("chunked", ["--loss-chunk", "48"]))
    ]
    plain, chunked = ([h["loss"] for h in run["history"]] + [run["history"][-1]["val_loss"]] for run in runs)
    assert len(chunked) == len(plain) == 5
    torch.testing.assert_close(chunked, plain, rtol=1e-4, atol=0)


TRAIN_ERRORS = [
    (["--loss-chunk", "-2"], "--loss-chunk must be >= 0 (0: the plain loss), got -2"),
    (["--loss-chunk", "8", "--parallel", "tp"], "--loss-chunk 8 with --parallel tp: the tensor-parallel head's"),
    (["--loss-chunk", "8", "--parallel", "hsdp", "--tp-size", "2"], "--loss-chunk 8 with --parallel hsdp --tp-size:"),
    (
        ["--loss-chunk", "8", "--pp", "2"],
        "--loss-chunk 8 with --pp 2: the pipeline's last stage computes the plain loss",
    ),
]


@pytest.mark.parametrize("argv,line", TRAIN_ERRORS, ids=["negative", "tp", "hsdp-tp", "pp"])
def test_main_job_refuses_loss_chunk_in_one_line(
    argv: list[str], line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        options.parse_args(["--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("train.py: error: ") and line in err, err
