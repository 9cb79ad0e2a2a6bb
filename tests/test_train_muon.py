"""The main job with `--optimizer muon` (examples/train.py, examples/trainer/muon_adamw.py): Muon on the
blocks' matrices and AdamW on the rest, as one optimizer.

- `MuonAdamW` steps each parameter exactly as its own optimizer would (Muon's matrices as
  `composable.optim.Muon` alone, the rest as `torch.optim.AdamW` alone), and its state dict
  round trips into a fresh one;
- the main job trains with it under `fully_shard` and `replicate` (the same losses), and a run
  stopped at a checkpoint resumes to the losses of the run that never stopped, also into another
  layout (the momentum resharded);
- `--cuda-graph on` captures the step (Muon's lr a tensor, as AdamW's: test_muon_graphed.py),
  except with `--mp fp16`, refused in one line naming the flags; `auto` runs it eagerly.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from _harness import assert_close_tensors
from test_train_example import SMALL, _losses, _run
from torch import nn

from composable.optim import Muon
from trainer import options
from trainer.muon_adamw import MuonAdamW, build_muon_adamw, is_hidden_matrix


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8)) for _ in range(2))
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.norm(h).sum()


def _grads(model: nn.Module, step: int) -> None:
    torch.manual_seed(100 + step)
    model.zero_grad()
    model(torch.randint(0, 11, (4, 5))).backward()


def test_muon_adamw_steps_each_parameter_as_its_own_optimizer_and_round_trips() -> None:
    torch.manual_seed(0)
    model = _Blocks()
    split = copy.deepcopy(model)
    opt = build_muon_adamw(model, lr=0.01, weight_decay=0.1)
    hidden = [p for n, p in split.named_parameters() if is_hidden_matrix(n, p)]
    assert len(hidden) == 4 and all(p.ndim == 2 for p in hidden)
    rest = [p for n, p in split.named_parameters() if not is_hidden_matrix(n, p)]
    muon = Muon(hidden, lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(
        [{"params": [p for p in rest if p.ndim >= 2]}, {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0}],
        lr=0.01,
        betas=(0.9, 0.95),
        weight_decay=0.1,
    )
    for step in range(3):
        for m in (model, split):
            _grads(m, step)
        opt.step()
        muon.step()
        adamw.step()
        for (name, a), b in zip(model.named_parameters(), split.parameters()):
            assert torch.equal(a, b), (step, name)
    # One state dict for both algorithms; a fresh optimizer loaded from it steps as this one.
    saved = opt.state_dict()
    assert {"momentum_buffer", "exp_avg", "exp_avg_sq"} <= {k for s in saved["state"].values() for k in s}
    twin = copy.deepcopy(model)
    fresh = build_muon_adamw(twin, lr=0.5, weight_decay=0.0)
    fresh.load_state_dict(copy.deepcopy(saved))
    assert fresh.param_groups[0]["lr"] == 0.01 and fresh.muon.param_groups[0] is fresh.param_groups[0]
    assert fresh.muon.state is fresh.state and fresh.adamw.state is fresh.state
    for m in (model, twin):
        _grads(m, 3)
    opt.step()
    fresh.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name
    assert isinstance(opt, MuonAdamW) and isinstance(opt, torch.optim.Optimizer)


MUON = SMALL + ["--optimizer", "muon", "--eval-every", "0"]


def test_the_main_job_trains_with_muon_and_resumes_as_the_run_that_never_stopped(tmp_path: Path) -> None:
    full = _losses(_run(MUON + ["--steps", "6", "--ckpt-every", "0", "--out", str(tmp_path / "full")]))
    assert all(torch.isfinite(torch.tensor(full))) and full[-1] < full[0], full
    # replicate: whole matrices on every rank, the same update (the gradients' sums in another order)
    whole = _losses(
        _run(MUON + ["--steps", "6", "--ckpt-every", "0", "--parallel", "replicate", "--out", str(tmp_path / "r")])
    )
    assert_close_tensors(torch.tensor(whole), torch.tensor(full), rtol=1e-5, atol=1e-5)
    for run_id, layout in (("same", []), ("other", ["--parallel", "replicate"])):
        argv = MUON + ["--steps", "6", "--ckpt-every", "3", "--out", str(tmp_path / "stopped"), "--run-id", run_id]
        assert _losses(_run(argv + ["--stop-after", "3"])) == full[:3]
        resumed = _run(argv + ["--resume", *layout])
        assert resumed["resumed_from"] == 3, resumed
        losses = _losses(resumed)  # the history of the whole run, the first 3 steps read back
        if layout:  # Muon's momentum, sharded by rows when saved, loads whole on every rank
            assert_close_tensors(torch.tensor(losses), torch.tensor(full), rtol=1e-5, atol=1e-5)
        else:
            assert losses == full, (losses, full)


def test_cuda_graph_on_takes_muon_and_auto_runs_it_eagerly(tmp_path: Path) -> None:
    args = options.parse_args(MUON + ["--steps", "2", "--out", str(tmp_path)])
    assert options.cuda_graph_unsupported(args, "cuda") is None
    assert options.cuda_graph_mode(args, "cuda") == (
        False,
        "--optimizer muon: not yet measured under a graph; --cuda-graph on to try",
    )
    args.cuda_graph = "on"
    assert options.cuda_graph_mode(args, "cuda") == (True, "--cuda-graph on")
    args.mp = "fp16"  # the scaler would read found_inf on the CPU before Muon's step
    assert options.cuda_graph_unsupported(args, "cuda") == (
        "--optimizer muon --mp fp16: the grad scaler reads on the CPU whether it found infs before Muon's step, "
        "which a CUDA graph cannot hold"
    )
    assert options.cuda_graph_unsupported(options.parse_args(SMALL + ["--out", str(tmp_path)]), "cuda") is None
