"""What train.py reports: memory strings, metrics.json / metrics.csv, loss.png, the summary.

Everything here runs on rank 0 only (or on every rank without communicating): no collectives.
"""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import torch

from trainer.checkpointing import CKPT_DIR, write_json


def memory_string(device: torch.device) -> tuple[float, str]:
    """(GiB, label): CUDA max allocated on a GPU, the process's resident set on the CPU."""
    if device.type == "cuda":
        gib = torch.cuda.max_memory_allocated(device) / 2**30
        return gib, f"{gib:.2f}GiB alloc"
    gib = _rss_bytes() / 2**30
    return gib, f"{gib * 1024:.0f}MiB rss"


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource  # peak, not current, but what the platform offers

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024


class ProgressBar:
    """The progress bar of the steps (rank 0; nothing when not `enabled`), on `file` (stderr).

    On a terminal it is tqdm's bar, redrawn in place below the messages tqdm.write prints.
    In a file (a log) a redraw cannot erase the bar it replaces: every message after a step
    would leave another copy of the bar behind it, and closing one more, each with another
    rate (tqdm's smoothed one, then the one over all steps). So in a file the bar is written
    once, as a line of its own, when it closes, with the rate over all steps."""

    def __init__(self, total: int, initial: int, enabled: bool, file: TextIO | None = None) -> None:
        from tqdm.auto import tqdm

        self.file = sys.stderr if file is None else file
        self.total, self.initial, self.n, self.postfix = total, initial, initial, ""
        self._start = time.perf_counter()
        self._open = enabled
        live = enabled and getattr(self.file, "isatty", lambda: False)()
        self._bar = (
            tqdm(total=total, initial=initial, file=self.file, unit="step", dynamic_ncols=True, leave=True)
            if live
            else None
        )

    def update(self, postfix: str) -> None:
        """One more step done; `postfix` (its loss, throughput, memory) is shown after the rate."""
        self.n += 1
        self.postfix = postfix
        if self._bar is not None:
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self._bar is not None:
            self._bar.close()
            return
        from tqdm import tqdm

        elapsed = time.perf_counter() - self._start
        # ascii: a log's encoding may not have tqdm's block characters
        line = tqdm.format_meter(
            self.n, self.total, elapsed, ascii=True, unit="step", postfix=self.postfix or None, initial=self.initial
        )
        print(line, file=self.file, flush=True)


FIELDS = ["step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mem_gib", "time_s"]


class MetricsLog:
    """metrics.csv written as the run goes (a line per step, flushed: a crash keeps every step
    done so far) and metrics.json rewritten atomically at every evaluation and checkpoint and
    at the end (then with the summary). Rank 0 only; a resumed run starts from the history in
    its checkpoint, dropping the lines of steps it is about to redo."""

    def __init__(self, run_dir: str, history: list[dict[str, Any]]) -> None:
        self.run_dir = run_dir
        self._csv = open(os.path.join(run_dir, "metrics.csv"), "w", newline="")  # noqa: SIM115 - open for the run
        self._writer = csv.DictWriter(self._csv, fieldnames=FIELDS, extrasaction="ignore")
        self._writer.writeheader()
        self._writer.writerows(history)
        self._csv.flush()

    def append(self, record: dict[str, Any]) -> None:
        self._writer.writerow(record)
        self._csv.flush()

    def write_json(self, history: list[dict[str, Any]], summary: dict[str, Any] | None = None) -> None:
        write_json(os.path.join(self.run_dir, "metrics.json"), {"summary": summary, "history": history})

    def close(self) -> None:
        self._csv.close()


# Steps at the start of a process that pay for compilation, autotuning, the allocator's growth
# and the optimizer's lazy state: at least the first 3, else the first 10% of the steps it ran.
WARMUP_STEPS, WARMUP_FRACTION = 3, 0.1


def steady_throughput(
    history: list[dict[str, Any]], first_step: int, tokens_per_step: int, busy_steps: set[int]
) -> dict[str, Any]:
    """The steady-state throughput of the steps this process ran (`first_step` on; earlier
    records come from the checkpoint a resumed run started from, and had a warm-up of their own).

    Counted: the steps after the warm-up (the first max(WARMUP_STEPS, ceil(WARMUP_FRACTION *
    steps run)) of this process), less those in `busy_steps` (they ran an evaluation or saved
    a checkpoint). The figure is their tokens over their time (each step's `time_s` covers its
    forward, backward and optimizer step only): `tokens_per_step` / their mean step time. None
    when no step is left to count.
    """
    ran = [h for h in history if h["step"] >= first_step]
    warmup = min(len(ran), max(WARMUP_STEPS, math.ceil(WARMUP_FRACTION * len(ran))))
    after = ran[warmup:]
    counted = [h for h in after if h["step"] not in busy_steps]
    seconds = sum(h["time_s"] for h in counted)
    return {
        "tokens_per_s": tokens_per_step * len(counted) / seconds if seconds > 0 else None,
        "steps": {
            "run": len(ran),
            "warmup": warmup,
            "first": after[0]["step"] if after else None,
            "last": after[-1]["step"] if after else None,
            "excluded": [h["step"] for h in after if h["step"] in busy_steps],
            "counted": len(counted),
        },
    }


def _describe_steps(steps: dict[str, Any]) -> str:
    """Which steps the steady-state throughput counts, in words (see steady_throughput)."""
    if not steps["counted"]:
        return f"n/a: of the {steps['run']} steps run, the first {steps['warmup']} are warm-up (run more steps)"
    excluded = len(steps["excluded"])
    return (
        f"steady state: steps {steps['first']}-{steps['last']}"
        + (f" less {excluded} evaluating/checkpointing" if excluded else "")
        + f" ({steps['counted']} steps)"
    )


def write_plot(out: str, history: list[dict[str, Any]], title: str, say: Callable[[str], Any]) -> None:
    """loss.png under `out` (rank 0): train and validation curves."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: skipping loss.png (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["loss"] for h in history], lw=0.8, alpha=0.5, label="train (per step)")
    if len(history) >= 10:
        k = max(2, len(history) // 25)
        smooth = [
            sum(h["loss"] for h in history[max(0, i - k + 1) : i + 1]) / len(history[max(0, i - k + 1) : i + 1])
            for i in range(len(history))
        ]
        ax.plot(steps, smooth, lw=1.6, label=f"train ({k}-step mean)")
    val = [(h["step"], h["val_loss"]) for h in history if h.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", lw=1.6, label="validation (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=120)
    plt.close(fig)


def print_summary(s: dict[str, Any], out: str) -> None:
    """The end-of-run summary on stdout (rank 0, unless --quiet)."""
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    lines = [
        "",
        "summary",
        f"  model         {s['preset']}, {s['params'] / 1e6:.2f}M parameters",
        f"  parallelism   --parallel {s['parallel']}, --mp {s['mp']}, {s['world_size']} ranks on {s['device']}",
        f"  steps         {s['steps']}" + (f" (resumed from {s['resumed_from']})" if s["resumed_from"] else ""),
        f"  train loss    {fmt(s['first_train_loss'], '.4f')} -> {fmt(s['final_train_loss'], '.4f')}",
        f"  val loss      {fmt(s['final_val_loss'], '.4f')}",
        f"  throughput    {fmt(s['tokens_per_s'], ',.0f')} tokens/s ({fmt(s['tokens_per_s_per_rank'], ',.0f')} per rank), "
        + _describe_steps(s["throughput_steps"]),
        f"  warm-up       time to first step {fmt(s['time_to_first_step_s'], '.1f')} s; "
        f"{fmt(s['tokens_per_s_all_steps'], ',.0f')} tokens/s over all steps",
        f"  memory        {fmt(s['peak_mem_gib'], '.2f')} GiB peak (rank 0)",
        f"  time          {s['train_time_s']:.1f} s training, {s['wall_time_s']:.1f} s in all",
        f"  outputs       {os.path.join(out, 'metrics.json')}, metrics.csv, loss.png"
        + (f", {CKPT_DIR}/" if s["checkpoints"] else ""),
    ]
    print("\n".join(lines), flush=True)
