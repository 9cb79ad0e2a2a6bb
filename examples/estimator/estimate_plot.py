"""`estimate.py --plot`: peak memory and bytes sent per rank against world size, per layout."""

from __future__ import annotations

import sys
from dataclasses import replace

from estimator.estimate_comm import estimate_comm
from estimator.estimate_memory import estimate_memory
from estimator.estimate_setup import PARALLEL, Setup, UsageError
from estimator.estimate_time import Links, estimate_time
from trainer.parallel import PARAMS_ON_HOST

GiB = 2**30


def _variant(base: Setup, parallel: str, world: int) -> Setup | None:
    """`base` as `parallel` at `world` ranks, or None where that layout cannot be laid out."""
    shard = base.hsdp_shard_size or 8  # hsdp: shard within a node unless told
    try:
        return replace(
            base,
            world_size=world,
            parallel=parallel,
            hsdp_shard_size=shard if parallel == "hsdp" else None,
            tp_size=(base.tp_size if base.tp_size > 1 else 8) if parallel == "tp" else 1,
            reshard_after_forward=None if parallel == "replicate" else base.reshard_after_forward,
            offload=base.offload if parallel != "replicate" or base.offload not in PARAMS_ON_HOST else None,
            wrap=base.wrap if parallel != "replicate" else "blocks",
        )
    except UsageError:
        return None


def plot_scaling(base: Setup, path: str, worlds: str, layouts: str, links: Links, tflops: float) -> None:
    """Write a PNG to `path` (three panels against world size, log2: peak GiB, GiB sent per rank
    per step, exposed communication in ms); prints a message instead when matplotlib is missing."""
    try:
        world_sizes = sorted({int(w) for w in worlds.split(",")})
    except ValueError:
        raise UsageError(f"--plot-worlds must be a comma list of integers, got {worlds!r}") from None
    names = [n.strip() for n in layouts.split(",") if n.strip()]
    bad = [n for n in names if n not in PARALLEL]
    if bad or not names or any(w < 1 for w in world_sizes):
        raise UsageError(f"--plot-layouts / --plot-worlds: bad value in {layouts!r} / {worlds!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return
    fig, (ax_mem, ax_comm, ax_exp) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in names:
        points = [(w, s) for w in world_sizes if (s := _variant(base, name, w)) is not None]
        if not points:
            continue
        mems, sent, exposed = [], [], []
        for _, s in points:
            comm = estimate_comm(s)
            mems.append(estimate_memory(s).peak / GiB)
            sent.append(comm.sent_bytes / GiB)
            exposed.append(estimate_time(s, comm, links, tflops).exposed_s)
        xs = [w for w, _ in points]
        ax_mem.plot(xs, mems, marker="o", label=name)
        ax_comm.plot(xs, sent, marker="o", label=name)
        ax_exp.plot(xs, [e * 1e3 for e in exposed], marker="o", label=name)
    titles = ("peak memory per rank (GiB)", "sent per rank per step (GiB)", "exposed communication (ms, assumed links)")
    for ax, title in zip((ax_mem, ax_comm, ax_exp), titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("world size")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
    c = base.cfg
    fig.suptitle(
        f"dim {c.dim}, {c.n_layers} layers, ffn {c.ffn_dim}, vocab {c.vocab_size}; local batch {base.batch_size} x "
        f"{base.seq_len}, --mp {base.mp}{', checkpointing' if base.activation_checkpointing else ''}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}", file=sys.stderr)
