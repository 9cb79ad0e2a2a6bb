"""Byte-level language-model data from text every machine has: the Python standard library.

The corpus is the `.py` files under `sysconfig.get_paths()["stdlib"]` (site-packages
excluded), in sorted order, each followed by a NUL separator. About one file in twenty —
chosen by a hash of its path, so the choice does not depend on which other files exist — is
held out for validation. Tokens are bytes (vocabulary 256).

Batches are random windows drawn by a generator seeded from (seed, split, step, rank): every
data-parallel rank sees different data, and any step's batch can be recomputed from those
four numbers alone, which is all the "data position" a checkpoint needs to record.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
import zlib
from dataclasses import dataclass

import torch

VOCAB_SIZE = 256
SEPARATOR = b"\0"


def corpus_files(root: str | None = None) -> list[str]:
    """Paths (relative to `root`) of the corpus files, sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in filenames:
            if name.endswith(".py"):
                files.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(files)


def is_validation(relpath: str, every: int = 20) -> bool:
    """Deterministic held-out choice: depends only on the file's own path."""
    return zlib.crc32(relpath.replace(os.sep, "/").encode()) % every == 0


@dataclass
class ByteCorpus:
    """The train and validation splits as flat uint8 tensors."""

    train: torch.Tensor  # 1D uint8
    val: torch.Tensor  # 1D uint8
    n_files: int

    @staticmethod
    def load(root: str | None = None, max_bytes: int | None = None) -> "ByteCorpus":
        """Read the corpus (cached per process: the tensors are only ever read). `max_bytes`
        caps each split (the first files in sorted order); None reads everything (~30 MB on
        CPython 3.11, a fraction of a second)."""
        return _load(root or sysconfig.get_paths()["stdlib"], max_bytes)


@functools.lru_cache(maxsize=2)
def _load(root: str, max_bytes: int | None) -> ByteCorpus:
    files = corpus_files(root)
    if not files:
        raise RuntimeError(f"no .py files found under {root!r}")
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    sizes = {False: 0, True: 0}
    for rel in files:
        split = is_validation(rel)
        if max_bytes is not None and sizes[split] >= max_bytes:
            continue
        try:
            with open(os.path.join(root, rel), "rb") as f:
                blob = f.read() + SEPARATOR
        except OSError:
            continue  # unreadable file: skip it (the list stays deterministic per machine)
        parts[split].append(blob)
        sizes[split] += len(blob)
    as_tensor = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)  # noqa: E731
    return ByteCorpus(train=as_tensor(parts[False]), val=as_tensor(parts[True]), n_files=len(files))


def get_batch(
    data: torch.Tensor,
    batch_size: int,
    seq_len: int,
    *,
    seed: int,
    step: int,
    rank: int,
    split_id: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` random windows of `seq_len + 1` bytes: (inputs, targets) int64 (B, T).

    Deterministic in (seed, split_id, step, rank) and independent of everything else, so a
    resumed run sees exactly the batches the uninterrupted run would have seen."""
    if data.numel() <= seq_len + 1:
        raise ValueError(f"split of {data.numel()} bytes is too short for windows of {seq_len + 1}")
    g = torch.Generator().manual_seed(hash_ints(seed, split_id, step, rank))
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=g)
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
    windows = windows.to(device, non_blocking=True)
    return windows[:, :-1], windows[:, 1:]


def hash_ints(*values: int) -> int:
    """A 63-bit seed from integers, stable across processes and Python versions."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
