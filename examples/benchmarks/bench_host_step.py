"""What an offloaded, clipped step costs on the host: each operation on a preset's fp32 shards.

CPU offload leaves the gradient norm, the clip, the optimizer step and (for `step_in_backward`'s
`speculate=True`) a copy aside of the parameters and state to the host's cores and memory. This
times each of them alone on gradients the size of a preset's (one rank's shards: `--ranks`), so
that a benchmark's offloaded step can be read against them:
`python examples/bench_host_step.py --preset 1b`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time
from collections.abc import Callable

import torch

import composable
from models.model import PRESETS, Transformer, get_config


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Print each operation's median time (ms) over `--repeats` after one warm-up, and return them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--ranks", type=int, default=1, help="the shards of one rank of this many")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with torch.device("meta"):
        shapes = [p.shape for p in Transformer(get_config(args.preset)).parameters()]
    shards = [torch.randn(-(-s.numel() // args.ranks)) for s in shapes]
    params = [torch.nn.Parameter(torch.randn_like(t)) for t in shards]
    for p, g in zip(params, shards):
        p.grad = g
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    optimizer.step()  # the moments exist: the copy aside below copies them too
    state = [v for p in params for v in optimizer.state[p].values() if v.ndim]
    aside = [torch.empty_like(t) for t in params + state]
    pool = concurrent.futures.ThreadPoolExecutor(torch.get_num_threads())
    coef = torch.tensor(1.0)
    ops: dict[str, Callable[[], object]] = {
        # Both multiply every gradient by the clamped coefficient, 1.0 here, as on any step.
        "torch.nn.utils.clip_grad_norm_ (norms on one core each)": lambda: torch.nn.utils.clip_grad_norm_(params, 1e9),
        "composable.clip_grad_norm_ (norms on all cores)": lambda: composable.clip_grad_norm_(params, 1e9),
        "the clip alone, _foreach_mul_ by the coefficient": lambda: torch._foreach_mul_(shards, coef),
        "fused AdamW step": optimizer.step,
        "copy aside of parameters and state": lambda: [a.copy_(t) for a, t in zip(aside, params + state)],
        "copy aside on a pool of threads": lambda: list(
            pool.map(lambda at: at[0].copy_(at[1]), zip(aside, params + state))
        ),
    }
    n = sum(t.numel() for t in shards)
    print(f"{args.preset}, 1 of {args.ranks} ranks: {n / 1e6:.0f} M fp32 elements, {torch.get_num_threads()} threads")
    times = {}
    for name, op in ops.items():
        op()
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            op()
            runs.append(time.perf_counter() - start)
        times[name] = sorted(runs)[len(runs) // 2] * 1e3
        print(f"  {name:58s} {times[name]:8.1f} ms")
    pool.shutdown()
    return times


if __name__ == "__main__":
    main()
