"""torchao float8 training with float8 all-gather under `fully_shard`, as under FSDP2.

`convert_to_float8_training(..., Float8LinearConfig(enable_fsdp_float8_all_gather=True))` makes
each linear weight a `WeightWithDynamicFloat8CastTensor`, which all-gathers its float8 data
through FSDP2's all-gather extension (engine: _engine/unshard/extension.py). Checked:
- shapes on a fake 2-rank world: a model built on the meta device (`to_empty` after the call)
  gathers weights of their own size (it once gathered `world` whole weights and crashed);
- numerics on gloo against PyTorch's FSDP2 + torchao on the same model and data, step by step
  (exact: both run the same casts, the same bytes travel). Every FSDP2 group here mixes fp32
  parameters with float8 weights, so FSDP2 gathers bytes (gloo has no float8); composable
  gathers float8 as bytes itself. Eager, blocks compiled before the call, HSDP meshes, and
  `precompute_float8_dynamic_scale_for_fsdp` between steps;
- on 2 GPUs (NCCL, bf16 compute, inductor): the same against FSDP2 over 20 steps.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _harness import fake_process_group, requires_gpus, run_on_ranks, trace_collectives
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import composable
from composable import fully_shard

pytest.importorskip("torchao")

from torchao.float8 import (  # noqa: E402
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

DIM, HIDDEN, OUT, BATCH = 32, 64, 16, 16  # float8 matmuls want multiples of 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, OUT)  # stays high precision, as an LM head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _float8_net(device: str | torch.device, meta: bool = False, bare: bool = False) -> Net:
    """`Net` with float8 weights that all-gather in float8 (the head excepted); on the meta
    device when `meta` (materialise after sharding with `_materialise`). `bare`: blocks of
    float8 weights alone (no norm, no biases), so a block's group has no flat parameters."""
    torch.manual_seed(0)
    with torch.device("meta" if meta else device):
        net = Net()
    if bare:
        for block in net.blocks:
            block.norm = nn.Identity()
            block.up.bias = block.down.bias = None
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(net, config=config, module_filter_fn=lambda m, fqn: fqn != "head")
    return net


def _materialise(net: nn.Module, device: str) -> None:
    net.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (nn.Linear, nn.LayerNorm)):
                m.reset_parameters()


def _shard(net: Net, api: Any, mesh: DeviceMesh, compiled: str | None = None, **options: Any) -> Net:
    for block in net.blocks:
        if compiled is not None:
            block.compile(backend=compiled)
        api(block, mesh=mesh, **options)
    api(net, mesh=mesh, **options)
    return net


def _mesh(device: str, shape: tuple[int, ...]) -> DeviceMesh:
    names = ("replicate", "shard") if len(shape) == 2 else None
    return init_device_mesh(device, shape, mesh_dim_names=names)


def _local(param: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard as a plain tensor (a multiply leaves torchao's weight kind)."""
    return param.to_local().detach() * 1


# ----------------------------------------------------------------------------- shapes (fake world)


# torch warns that DTensor random ops on a CPU mesh may be incomplete; the test checks shapes, not values.
@pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support:UserWarning")
def test_meta_init_gathers_weights_of_their_own_size() -> None:
    """Built on meta, sharded, then `to_empty`: the local shards are this rank's rows and the
    unsharded float8 weights the parameters' own shapes (they were `world` times too tall:
    "mat_a and mat_b shapes cannot be multiplied"). The float8 data travels as its bytes, in
    its group's one all-gather."""
    seen: dict[str, tuple[str, torch.Size]] = {}

    def note(module: nn.Module, args: Any) -> None:
        seen[module.fqn] = (type(module.weight).__name__, module.weight.shape)

    with fake_process_group(2):
        net = _float8_net("cpu", meta=True)
        _shard(net, fully_shard, _mesh("cpu", (2,)))
        _materialise(net, "cpu")
        for fqn, m in net.named_modules():
            if fqn.endswith(("up", "down")):
                m.fqn = fqn  # type: ignore[assignment]
                m.register_forward_pre_hook(note)
        for name, p in net.named_parameters():
            assert p.to_local().shape[0] == p.shape[0] // 2, name
        group = fully_shard.state(net.blocks[0]).groups[0]  # type: ignore[union-attr]
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        flats = []
        for step in range(3):
            with trace_collectives() as t:
                out = net(torch.randn(BATCH, DIM))
            assert out.shape == (BATCH, OUT)
            out.sum().backward()
            opt.step()
            opt.zero_grad()
            precompute_float8_dynamic_scale_for_fsdp(net)
            # One all-gather per group (root, two blocks); a block's carries its float8 weights as
            # bytes (one per element) after its fp32 parameters.
            gathers = [r.numel for r in t.records if r.kind == "all_gather"]
            block = net.blocks[0]
            weights = block.up.weight.numel() + block.down.weight.numel()
            flat = sum(p.numel() for p in block.parameters()) - weights
            assert sorted(gathers)[1:] == [flat + weights // 4] * 2, t.render()
            flats.append(group.flat_shard)
        # The swapped (to_empty) local shards were adopted once, not again at every forward.
        assert all(f is flats[0] for f in flats), "the flat shard was rebuilt at a later forward"
    for fqn in ("blocks.0.up", "blocks.1.down"):
        kind, shape = seen[fqn]
        assert kind == "Float8TrainingTensor", seen
        assert shape == net.get_submodule(fqn).weight.shape, seen


def test_pre_all_gather_gets_what_fsdp2_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fsdp_pre_all_gather` (the 5-argument form) receives the shard mesh (the mesh's last
    dim under HSDP), the global size and contiguous stride, the owning module and the policy."""
    calls: list[tuple] = []
    original = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    def spy(self, mesh, outer_size, outer_stride, module, mp_policy):  # type: ignore[no-untyped-def]
        calls.append((mesh, outer_size, outer_stride, module, mp_policy))
        return original(self, mesh)

    monkeypatch.setattr(WeightWithDynamicFloat8CastTensor, "fsdp_pre_all_gather", spy)
    with fake_process_group(4):
        mesh = _mesh("cpu", (2, 2))
        net = _float8_net("cpu")
        policy = composable.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        _shard(net, fully_shard, mesh, mp_policy=policy)
        net(torch.randn(BATCH, DIM)).sum().backward()
        shard_mesh, size, stride, module, mp_policy = calls[0]
        assert shard_mesh == mesh["shard"] and shard_mesh.ndim == 1
    assert (size, stride) == (torch.Size((HIDDEN, DIM)), (DIM, 1))
    assert module is net.blocks[0].up
    assert mp_policy.param_dtype == torch.bfloat16


def _deepcopy_after_a_step(rank: int, world: int) -> None:
    net = _shard(_float8_net("cpu"), fully_shard, _mesh("cpu", (world,)))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.randn(BATCH, DIM)).sum().backward()
    opt.step()
    precompute_float8_dynamic_scale_for_fsdp(net)
    twin = copy.deepcopy(net)
    x = torch.randn(BATCH, DIM)
    assert torch.equal(twin(x), net(x))


def test_deepcopy_after_a_step() -> None:
    """`copy.deepcopy` of a trained model: the copy gathers afresh (its all-gather outputs
    and float8 weights are freed between uses; copying them read freed storage: a crash) and
    computes what the original does."""
    run_on_ranks(_deepcopy_after_a_step, 2)


# ----------------------------------------------------------------------------- numerics (gloo)


def _train(
    rank: int,
    world: int,
    device: str,
    mesh_shape: tuple[int, ...],
    compiled: str | None,
    precompute: bool | str,
    steps: int,
    bf16: bool,
    bare: bool = False,
) -> dict[str, Any]:
    """Train composable's and FSDP2's copies of one float8 model side by side on the same
    data; return both sides' losses and final local shards, the graphs compiled for
    composable's model after its first step (recompiles) and torchao's per-weight
    pre- and post-all-gathers it ran after its first step. `precompute="in_place"`: composable's
    side takes `composable.integrations.float8`'s precompute (scales written in place), FSDP2's
    torchao's."""
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from composable.integrations.float8 import precompute_float8_dynamic_scale_for_fsdp as precompute_in_place

    if device == "cuda":
        torch.cuda.set_device(rank)
    mesh = _mesh(device, mesh_shape)
    sides = {}
    for name, api, policy in (
        ("ours", fully_shard, composable.MixedPrecisionPolicy),
        ("fsdp2", torch_fully_shard, TorchPolicy),
    ):
        options = {"mp_policy": policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
        net = _shard(_float8_net(device, bare=bare), api, mesh, compiled, **options)
        sides[name] = (net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    losses: dict[str, list[float]] = {name: [] for name in sides}
    graphs = counters["stats"]
    late_graphs = late_casts = late_posts = 0
    g = torch.Generator().manual_seed(rank)  # one batch per rank, fitted step by step
    x, y = torch.randn(BATCH, DIM, generator=g).to(device), torch.randn(BATCH, OUT, generator=g).to(device)
    cls = WeightWithDynamicFloat8CastTensor
    with _count_calls(cls, "fsdp_pre_all_gather") as casts, _count_calls(cls, "fsdp_post_all_gather") as posts:
        for step in range(steps):
            for name, (net, opt) in sides.items():
                graphs_before, casts_before, posts_before = _model_graphs(graphs), casts[0], posts[0]
                loss = F.mse_loss(net(x).float(), y)
                loss.backward()
                if name == "ours" and step > 0:
                    late_graphs += _model_graphs(graphs) - graphs_before
                    late_casts += casts[0] - casts_before
                    late_posts += posts[0] - posts_before
                opt.step()
                opt.zero_grad()
                if precompute == "in_place" and name == "ours":
                    precompute_in_place(net)
                elif precompute:
                    precompute_float8_dynamic_scale_for_fsdp(net)
                losses[name].append(loss.item())
    params = {name: {n: _local(p).cpu() for n, p in net.named_parameters()} for name, (net, _) in sides.items()}
    kinds = {n: type(p.to_local()).__name__ for n, p in sides["ours"][0].named_parameters()}
    late = {"late_graphs": late_graphs, "late_casts": late_casts, "late_posts": late_posts}
    return {"losses": losses, "params": params, "kinds": kinds, **late}


def _model_graphs(stats: Any) -> int:
    """Graphs dynamo compiled, less those of the engine's fused float8 cast (compiled on CUDA
    at the first batched gather, once per group layout: not a recompile of the model)."""
    from composable._engine.dtypes import float8_cast

    cast = torch._dynamo.eval_frame._debug_get_cache_entry_list(float8_cast._cast_each.__code__)
    return stats["unique_graphs"] - len(cast)


@contextlib.contextmanager
def _count_calls(cls: type, name: str) -> Iterator[list[int]]:
    """Count calls of `cls.name` inside the block (a one-element list); restored after, since
    test workers live on."""
    count = [0]
    original = cls.__dict__[name]

    @functools.wraps(original)  # the engine reads the signature (FSDP2's older one here)
    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    setattr(cls, name, counted)
    try:
        yield count
    finally:
        setattr(cls, name, original)


def _check(results: list[dict[str, Any]], tol: dict[str, float] | None = None, batched: bool = True) -> None:
    """Both sides' losses and parameters agree: exactly, or (`tol`) losses within `tol` and
    each parameter within `tol["rtol"]` in relative norm (a float8 cast can turn a last-bit
    difference into a step of the float8 grid in a few elements). `batched`: after the first
    step composable cast every weight in its group's batch, never through torchao's
    per-weight pre-all-gather (precomputed scales); otherwise always through it."""
    for rank, r in enumerate(results):
        assert r["kinds"]["blocks.0.up.weight"] == "WeightWithDynamicFloat8CastTensor"
        assert r["late_graphs"] == 0, f"rank {rank}: {r['late_graphs']} recompiles after the first step"
        assert (r["late_casts"] == 0) == batched, f"rank {rank}: {r['late_casts']} per-weight casts after step 0"
        ours, theirs = r["losses"]["ours"], r["losses"]["fsdp2"]
        assert all(math.isfinite(v) for v in ours), ours
        assert ours[-1] < ours[0], f"rank {rank} did not train: {ours}"
        exact = dict(rtol=0.0, atol=0.0)
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), **(tol or exact))
        for name, a in r["params"]["ours"].items():
            b = r["params"]["fsdp2"][name]
            if tol is None:
                assert torch.equal(a, b), f"rank {rank} {name}: {(a - b).abs().max()}"
            else:
                error = (a - b).norm() / b.norm().clamp_min(1e-12)
                assert error <= tol["rtol"], f"rank {rank} {name}: relative error {error:.3g}"


@pytest.mark.parametrize("precompute, bf16", [(False, False), (True, False), (True, True)])
def test_matches_fsdp2_eager(precompute: bool, bf16: bool) -> None:
    """Exact: the same casts on both sides, the same bytes gathered (bf16: compute in bf16);
    with precomputed scales composable casts a group's weights in one batch."""
    _check(run_on_ranks(_train, 2, "cpu", (2,), None, precompute, 4, bf16), batched=precompute)


def test_in_place_scales_skip_the_per_weight_post_all_gather() -> None:
    """Scales precomputed in place (composable.integrations.float8): the unsharded weights
    already hold them and the gathered bytes, so once the scale tensors exist no per-weight
    `fsdp_post_all_gather` runs at all, and training equals FSDP2 + torchao's precompute."""
    results = run_on_ranks(_train, 2, "cpu", (2,), None, "in_place", 4, False)
    _check(results)
    for r in results:  # step 1 only: the first in-place precompute makes the scale tensors
        weights = sum(kind == "WeightWithDynamicFloat8CastTensor" for kind in r["kinds"].values())
        assert r["late_posts"] == weights, (r["late_posts"], weights)


def test_new_scale_tensors_reach_the_unsharded_weights() -> None:
    """torchao's precompute hands each weight a new scale tensor every step: the batched path
    passes each one on through `fsdp_post_all_gather(out=)`, once per weight and gather."""
    results = run_on_ranks(_train, 2, "cpu", (2,), None, True, 3, False)
    _check(results)
    assert all(r["late_posts"] > 0 for r in results), [r["late_posts"] for r in results]


def test_fused_cast_gives_up_one_way_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile failure of the combo-kernel cast moves to one kernel per weight, quietly; a
    failure of that moves to the eager kernels, with one warning that names the error."""
    import warnings

    from composable._engine.dtypes import float8_cast

    monkeypatch.setattr(float8_cast, "_FUSED", {})
    first = float8_cast._fused_cast()
    assert first is float8_cast._fused_cast()  # made once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        float8_cast._disable_fused(RuntimeError("no combo kernels here"))
    second = float8_cast._fused_cast()
    assert second is not None and second is not first
    with pytest.warns(UserWarning, match=r"fused float8 cast failed to compile \(RuntimeError: no kernels\)"):
        float8_cast._disable_fused(RuntimeError("no kernels"))
    assert float8_cast._fused_cast() is None


@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 1)])
def test_matches_fsdp2_hsdp(mesh_shape: tuple[int, int]) -> None:
    _check(run_on_ranks(_train, 2, "cpu", mesh_shape, None, True, 3, False))


def test_matches_fsdp2_compiled_blocks() -> None:
    """Blocks compiled (`block.compile()`) before the call; aot_eager runs eager's aten ops.
    No recompile after the first step."""
    _check(run_on_ranks(_train, 2, "cpu", (2,), "aot_eager", True, 3, False))


# ----------------------------------------------------------------------------- GPUs (NCCL)

# bf16 compute; inductor where compiled. Both sides run the same kernels, so this is
# expected to be exact, but a reduction ordered differently would be within float8's grid.
GPU_TOL = dict(rtol=2e-2, atol=2e-3)
GPU_STEPS = 20


@requires_gpus(2)
@pytest.mark.parametrize("compiled", [None, "inductor"])
@pytest.mark.parametrize("precompute", [False, True])
def test_gpu_matches_fsdp2(compiled: str | None, precompute: bool) -> None:
    results = run_on_ranks(_train, 2, "cuda", (2,), compiled, precompute, GPU_STEPS, True, backend="nccl", timeout=600)
    _check(results, GPU_TOL, batched=precompute)


@requires_gpus(1)
@pytest.mark.parametrize("compiled, bare", [(None, False), ("inductor", False), (None, True)])
def test_gpu_one_rank_matches_fsdp2(compiled: str | None, bare: bool) -> None:
    """World 1 on NCCL: the batched cast and the coalesced all-gather of a group's weights
    (`bare`: a block's group holds float8 weights alone)."""
    results = run_on_ranks(_train, 1, "cuda", (1,), compiled, True, GPU_STEPS, True, bare, backend="nccl", timeout=600)
    _check(results, GPU_TOL)


def _gathers_of_a_step(rank: int, world: int, bare: bool) -> list[str]:
    """The all-gathers of one forward and backward, after two steps with precomputed scales."""
    torch.cuda.set_device(rank)
    net = _shard(_float8_net("cuda", bare=bare), fully_shard, _mesh("cuda", (world,)))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x = torch.randn(BATCH, DIM, device="cuda")
    for _ in range(2):
        net(x).sum().backward()
        opt.step()
        opt.zero_grad()
        precompute_float8_dynamic_scale_for_fsdp(net)
    with trace_collectives() as tracer:
        net(x).sum().backward()
    return [r.op for r in tracer.records if r.kind == "all_gather"]


@requires_gpus(2)
@pytest.mark.parametrize("bare", [False, True])
def test_gpu_group_gathers_float8_and_flat_parameters_in_one_collective(bare: bool) -> None:
    """On CUDA a block's float8 weights ride in the coalesced all-gather of its other
    parameters (norm, biases): one collective per unshard, also where the group has no others."""
    ops = run_on_ranks(_gathers_of_a_step, 2, bare, backend="nccl")[0]
    # each block in forward and again in backward; the root (kept for backward) once
    assert len(ops) == 2 * 2 + 1 and all("coalesced" in op for op in ops), ops


@requires_gpus(1)
def test_gpu_one_rank_gathers_nothing() -> None:
    """A world of one has nothing to gather, float8 weights included (as FSDP2)."""
    assert run_on_ranks(_gathers_of_a_step, 1, False, backend="nccl")[0] == []


@requires_gpus(2)
@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 1)])
def test_gpu_hsdp_matches_fsdp2(mesh_shape: tuple[int, int]) -> None:
    results = run_on_ranks(_train, 2, "cuda", mesh_shape, None, True, GPU_STEPS, True, backend="nccl", timeout=600)
    _check(results, GPU_TOL)
