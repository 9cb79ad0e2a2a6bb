"""QLoRA fine-tuning of a Llama-architecture model with `composable.fully_shard`.

The base weights of every attention and MLP projection become torchao `NF4Tensor`s (4-bit
NormalFloat plus scalers, about 0.53 bytes a value), frozen; each projection gets trainable
LoRA adapters (`A`: rank x in, `B`: out x rank, B zero-initialised). `fully_shard` per decoder
layer and on the root shards the NF4 weights as NF4 (each rank keeps 1/world of the 4-bit data)
and all-gathers them as 4-bit data plus scalers through the tensor's own FSDP2 all-gather
extension, as torchtune's distributed QLoRA recipe does under FSDP2. Only the adapters train,
so the optimizer state is the adapters' alone.

The model is a `transformers` `LlamaForCausalLM` from a config (random init, no downloads);
the data is random tokens. Run it as it is (one CPU process, no launcher):

    python examples/qlora.py --steps 5

or on GPUs (bf16 compute):

    torchrun --nproc-per-node 8 examples/qlora.py --shape 1b --steps 20

`--no-nf4` trains the same model with bf16 (or `--dtype`) base weights: bf16 LoRA, the memory
baseline. Each run reports its losses, the weight bytes per rank and (on CUDA) the peak memory.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from trainer.launch import init_torchrun_rank

SHAPES: dict[str, dict[str, int]] = {
    # Small enough for a CPU: every projection's size a multiple of NF4's blocks on 2 ranks.
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
    ),
    # Llama 3.2 1B's shape (untied head).
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # torchao's (and torchtune's) defaults


def to_nf4(weight: torch.Tensor, block_size: int = NF4_BLOCK, scaler_block_size: int = NF4_SCALER_BLOCK) -> Any:
    """`weight` quantized to a torchao `NF4Tensor` (of `weight`'s dtype)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4 as quantize
    except ImportError:  # torchao before 0.16 kept it here
        from torchao.dtypes.nf4tensor import to_nf4 as quantize
    return quantize(weight.detach(), block_size=block_size, scaler_block_size=scaler_block_size)


class LoRALinear(nn.Module):
    """`linear`'s frozen base weight (NF4 with `nf4`) plus trainable adapters:
    y = x W^T + b + (alpha / rank) * x A^T B^T. The base weight keeps its name (`weight`), so
    the checkpoint keys of the base model stay as they were."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float, nf4: bool, **nf4_blocks: int) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.weight = nn.Parameter(to_nf4(weight, **nf4_blocks) if nf4 else weight, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.lora_a = nn.Linear(linear.in_features, rank, bias=False, device=weight.device, dtype=weight.dtype)
        self.lora_b = nn.Linear(rank, linear.out_features, bias=False, device=weight.device, dtype=weight.dtype)
        nn.init.zeros_(self.lora_b.weight)  # training starts from the base model's function
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NF4's F.linear dequantizes the weight to x's dtype for the matmul (and again in backward).
        return F.linear(x, self.weight, self.bias) + self.scale * self.lora_b(self.lora_a(x))


def add_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, nf4: bool = True, **nf4_blocks: int) -> nn.Module:
    """Freeze `model` and replace each projection named in `TARGETS` by a `LoRALinear` (NF4
    base weight with `nf4`), in place; returns `model`."""
    model.requires_grad_(False)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in TARGETS and isinstance(child, nn.Linear):
                setattr(parent, name, LoRALinear(child, rank, alpha, nf4, **nf4_blocks))
    return model


def build_llama(shape: str, dtype: torch.dtype, device: torch.device, nf4: bool, seed: int = 0) -> nn.Module:
    """A random-init `LlamaForCausalLM` of `shape` in `dtype` on `device`, with LoRA adapters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return add_lora(model, nf4=nf4)


def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor], device: torch.device) -> None:
    """Load unquantized full weights (`full`, e.g. a pretrained checkpoint) into `model`
    sharded by `shard`, built on the meta device, onto `device`: NF4 parameters are quantized from the full
    weight (with their own block sizes) and cut into this rank's shard by FSDP2's ops (dim-0
    chunk, `new_zeros`, `copy_`), the rest distributed as DTensors; all assigned (new
    parameter objects: build the optimizer afterwards). `to_empty` is not the way for NF4:
    torchao's NF4 `empty_like` leaves the lookup table on the meta device."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    loaded = {}
    for name, param in model.named_parameters():
        local = param.to_local()
        value = full[name].to(device=device, dtype=param.dtype)
        if hasattr(local, "quantized_data"):  # an NF4Tensor
            whole = to_nf4(value, local.block_size, local.scaler_block_size)
            mesh = param.device_mesh
            chunk = torch.chunk(whole, mesh.size(), dim=0)[mesh.get_local_rank()]
            shard = chunk.new_zeros(chunk.shape)
            shard.copy_(chunk)
            value = DTensor.from_local(
                shard, mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        else:
            value = distribute_tensor(value, param.device_mesh, param.placements)
        loaded[name] = nn.Parameter(value, requires_grad=param.requires_grad)
    model.load_state_dict(loaded, strict=False, assign=True)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters: local shards, and NF4's inner tensors (data + scalers)."""
    return sum(_local_bytes(p) for p in model.parameters())


def base_weight_bytes(model: nn.Module) -> int:
    """Bytes of this rank's shards of the LoRA layers' frozen base weights (the weights NF4
    quantizes; embeddings, head and norms stay in the model's dtype either way)."""
    return sum(_local_bytes(m.weight) for m in model.modules() if isinstance(m, LoRALinear))


def _local_bytes(param: torch.Tensor) -> int:
    local = param.to_local() if hasattr(param, "to_local") else param
    if hasattr(local, "__tensor_flatten__"):  # a subclass (NF4): its inner tensors
        names, _ = local.__tensor_flatten__()
        return sum(getattr(local, n).nbytes for n in names)
    return local.nbytes


def shard(model: nn.Module, api: str, mp_dtype: torch.dtype | None = None) -> nn.Module:
    """`fully_shard` (composable's, or FSDP2's with `api="fsdp2"`) per decoder layer and on the
    root; `mp_dtype`: compute dtype of a mixed-precision policy (fp32 gradient reduction)."""
    if api == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from composable import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy() if mp_dtype is None else MixedPrecisionPolicy(param_dtype=mp_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def make_step(
    model: nn.Module,
    device: torch.device,
    lr: float = 1e-3,
    graphed_warmup: int | None = None,
    capturable: bool | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """One AdamW step on the adapters for a batch of `tokens` (batch x seq + 1), returning the
    loss. With `graphed_warmup` (CUDA): the step through `composable.graphed_step`, eager for
    all but the last of `graphed_warmup` warm-up steps, captured in the last and replayed from
    then on: the NF4 dequantisation's many small kernels, the hooks and the collectives all
    replay from one graph, with no host work per step. `capturable` (default: graphed) builds
    AdamW as a graph needs it (capturable, its lr a tensor), which rounds its bias correction
    on the device: an eager step compared with a graphed one bit for bit needs it too."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    graphed = graphed_warmup is not None
    capturable = graphed if capturable is None else capturable
    opt = torch.optim.AdamW(trainable, lr=torch.tensor(lr, device=device) if capturable else lr, capturable=capturable)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if not graphed:
        return step
    from composable import graphed_step

    return graphed_step(step, warmup=max(1, graphed_warmup - 1))


def run_steps(
    step: Callable[[torch.Tensor], torch.Tensor], vocab: int, steps: int, batch: int, seq: int, device: torch.device
) -> list[float]:
    """`steps` calls of `step` (`make_step`) on random tokens (the same on every rank count:
    each rank draws its own rows); returns the losses (read each step: one sync per step)."""
    rank = dist.get_rank()
    losses = []
    for i in range(steps):
        gen = torch.Generator().manual_seed(1000 * i + rank)
        tokens = torch.randint(vocab, (batch, seq + 1), generator=gen).to(device)
        losses.append(step(tokens).item())
    return losses


def train(model: nn.Module, steps: int, batch: int, seq: int, device: torch.device, lr: float = 1e-3) -> list[float]:
    """`steps` eager AdamW steps on the adapters with random tokens; returns the losses."""
    return run_steps(make_step(model, device, lr), model.config.vocab_size, steps, batch, seq, device)


def init_distributed() -> torch.device:
    """The process group (NCCL under a launcher with CUDA, else gloo; one process without a
    launcher) and this rank's device."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29533")
        )
    return init_torchrun_rank()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--no-nf4", action="store_true", help="bf16 LoRA: base weights unquantized")
    parser.add_argument("--api", choices=["composable", "fsdp2"], default="composable")
    args = parser.parse_args()
    device = init_distributed()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[args.dtype]
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = shard(build_llama(args.shape, dtype, device, nf4=not args.no_nf4), args.api)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    losses = train(model, args.steps, args.batch, args.seq, device)
    elapsed = time.perf_counter() - start
    mine = weight_bytes(model)
    unquantized = sum(p.numel() for p in model.parameters()) * torch.finfo(dtype).bits // 8 // dist.get_world_size()
    if dist.get_rank() == 0:
        kind = f"{str(dtype)[6:]} LoRA" if args.no_nf4 else "QLoRA (NF4 base)"
        print(
            f"{kind} {args.api}, {args.shape}, {dist.get_world_size()} rank(s): losses {[round(x, 4) for x in losses]}"
        )
        print(
            f"weights per rank {mine / 2**20:.1f} MiB ({dtype} base weights: {unquantized / 2**20:.1f} MiB), "
            f"{args.steps * args.batch * args.seq * dist.get_world_size() / elapsed:.0f} tokens/s"
        )
        if device.type == "cuda":
            print(f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
    dist.destroy_process_group()
