"""Muon's floor on one GPU: Newton-Schulz (torch's own) on every hidden matrix of a preset, timed.

Divided by the number of ranks it is the least time Muon can add to a step (the orthogonalization's
FLOPs spread evenly, at the rate this GPU reaches); `benchmark.py --optimizer muon` measures what it
does add. `python examples/bench_muon_floor.py --preset 1b`.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _zeropower_via_newtonschulz

from models.model import PRESETS, Transformer, get_config
from trainer.muon_adamw import is_hidden_matrix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device("meta"):
        model = Transformer(get_config(args.preset))
    # A 3D weight (experts) is a stack of matrices, each orthogonalized on its own.
    stacks = [p.shape if p.ndim == 3 else (1, *p.shape) for n, p in model.named_parameters() if is_hidden_matrix(n, p)]
    shapes = [torch.Size(s[1:]) for s in stacks for _ in range(s[0])]
    matrices = [torch.randn(s, device=device) for s in shapes]
    coefficients = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    times = []
    for _ in range(args.repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for m in matrices:
            _zeropower_via_newtonschulz(m, coefficients, DEFAULT_NS_STEPS, EPS)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    best = sorted(times[2:])[len(times[2:]) // 2]
    flops = sum(
        2 * DEFAULT_NS_STEPS * (2 * min(s) ** 2 * max(s) + 2 * min(s) ** 3 + min(s) ** 2 * max(s)) for s in shapes
    )
    print(
        f"{len(shapes)} hidden matrices of {args.preset}: Newton-Schulz {best * 1e3:.1f} ms a step on one "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'} ({flops / best / 1e12:.0f} TFLOP/s)"
    )
