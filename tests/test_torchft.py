"""torchft integration (`composable.integrations.torchft`): HSDP whose replicate dimension runs
through a torchft Manager, on CPU (gloo, torchft's ProcessGroupGloo, a lighthouse in the test).

- 2 replica groups x 2 ranks train; group 1 kills itself at a given step; group 0 keeps
  committing steps; group 1 is restarted, heals from group 0 and from then on its parameters and
  optimizer state equal group 0's bit for bit at every step.
- Before the kill (both groups live) every rank's shards equal plain HSDP's on a 2x2 mesh of one
  world, bit for bit, at every step.
- The user's mistakes: no lighthouse reachable, a model without a replicate dimension, a group of
  another size.
- The two private APIs the integration reads (torchft's `Manager._quorum_id`, torch's
  `_get_default_store`) are there, and their loss would be one line naming the version.
- The main job (`train.py --fault-tolerant`): two launches train as one plain HSDP launch, with a
  lighthouse started apart or one that group 0 starts (`--lighthouse start:PORT`); its flags that
  do not fit and a lighthouse port in use are one line.

Replica groups are separate torch.distributed worlds (one TCPStore each) that must die and restart
on their own, which `run_on_ranks`' single world cannot give: the groups here are plain
subprocesses running `_group_main` from this file, with files in `tmp_path` for results.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft", exc_type=ImportError)  # also one installed that fails to import

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from _harness import fake_process_group, run_on_ranks  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from composable import fully_shard, replicate  # noqa: E402

GROUP = 2  # ranks per replica group
KILL_STEP = 4  # group 1 dies in this step's backward (after committing steps 1..KILL_STEP-1)
HEALED_STEPS = 3  # steps the restarted group commits after healing
DEADLINE_S = 240.0  # a bound on each scenario: ~20 s on 2 idle cores, 60 s on 2 cores under a load of 11


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- the model and data


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _shard(model: nn.Module, mesh: Any) -> nn.Module:
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _batch(step: int, replica: int, shard_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * replica + shard_rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _loss(model: nn.Module, step: int, replica: int, shard_rank: int) -> torch.Tensor:
    x, y = _batch(step, replica, shard_rank)
    return ((model(x) - y) ** 2).mean()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of the parameters and the optimizer state, by name."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"param.{n}": local(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            out[f"optim.{n}.{k}"] = local(v)
    return out


# ----------------------------------------------------------------------------- a replica group's rank


def _group_main(cfg: dict[str, Any]) -> None:
    """One rank of one replica group: train under the Manager, recording each committed step's
    loss and shards in `cfg["out"]`. Group 0 runs until `cfg["stop"]` exists; a group with
    `kill_at` kills itself (SIGKILL) in that step's backward, between its two cross-group
    gradient all-reduces (the other groups are left waiting in the second); a group started with `until` stops after that
    many committed steps past the one it healed at."""
    from composable.integrations.torchft import create_manager, fault_tolerant

    group, rank = cfg["group"], cfg["rank"]
    dist.init_process_group("gloo", rank=rank, world_size=cfg["world"], timeout=timedelta(seconds=30))
    if cfg.get("layout") == "replicate":  # each group data-parallel over its own ranks
        model = replicate(_model())
    else:
        mesh = init_device_mesh("cpu", (1, cfg["world"]), mesh_dim_names=("replicate", "shard"))
        model = _shard(_model(), mesh)
    manager = create_manager(
        replica_id=f"group_{group}",
        lighthouse=cfg["lighthouse"],
        timeout=timedelta(seconds=cfg.get("timeout", 10)),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=5),
        init_sync=False,  # every group builds the same weights from the same seed
    )
    opt = fault_tolerant(model, _optimizer(model), manager)
    if cfg.get("kill_at") is not None:
        all_reduce, calls = manager.allreduce, []

        def dying_all_reduce(tensor: torch.Tensor, **kwargs: Any) -> Any:
            if manager.current_step() == cfg["kill_at"] and tensor.numel() > 3:  # a gradient, not the size check
                calls.append(tensor.numel())
                if len(calls) == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
            return all_reduce(tensor, **kwargs)

        manager.allreduce = dying_all_reduce
    Path(cfg["out"] + ".ready").touch()
    for other in cfg["wait_for"]:  # both groups in the first quorum: the parity run
        while not Path(other).exists():
            time.sleep(0.02)
    record: dict[str, Any] = {"steps": {}, "uncommitted": 0, "healed_at": None}
    start = time.monotonic()
    while True:
        step = manager.current_step()
        # Rank 0 decides for the group: ranks that stopped at different steps would leave the
        # others waiting in a collective.
        stop = torch.tensor(
            [time.monotonic() - start > DEADLINE_S or bool(cfg.get("stop") and Path(cfg["stop"]).exists())]
        )
        dist.broadcast(stop, src=0)
        if stop.item():
            break
        opt.zero_grad()
        loss = _loss(model, step, group, rank)
        loss.backward()
        if not opt.step():
            record["uncommitted"] += 1
            continue
        done = manager.current_step()
        if record["healed_at"] is None:
            record["healed_at"] = done - 1  # the step whose start state this group took (or began with)
        record["steps"][done] = {"loss": loss.item(), "state": _snapshot(model, opt.optimizer)}
        if rank == 0:
            Path(cfg["out"] + ".progress").write_text(str(done))
        time.sleep(cfg.get("pace", 0.0))  # a group stepping alone leaves the 2 cores to a restart
        if cfg.get("until") is not None and done >= record["healed_at"] + cfg["until"]:
            break
    torch.save(record, cfg["out"])
    manager.shutdown(wait=False)
    dist.destroy_process_group()


class _Groups:
    """The replica groups' processes of one test, each rank a subprocess of its own."""

    def __init__(self, tmp: Path, lighthouse: str) -> None:
        self.tmp, self.lighthouse = tmp, lighthouse
        self.procs: dict[tuple[int, int], subprocess.Popen] = {}

    def start(self, group: int, life: int, world: int = GROUP, **cfg: Any) -> list[str]:
        port = _free_port()
        outs = []
        for rank in range(world):
            out = str(self.tmp / f"g{group}_l{life}_r{rank}.pt")
            outs.append(out)
            spec = {"group": group, "rank": rank, "world": world, "lighthouse": self.lighthouse, "out": out, **cfg}
            spec.setdefault("wait_for", [])
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            code = (
                f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"from test_torchft import _group_main; _group_main(json.loads({json.dumps(spec)!r}))"
            )
            log = open(self.tmp / f"g{group}_l{life}_r{rank}.log", "w")
            self.procs[(group, life, rank)] = subprocess.Popen(
                [sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd(), env=env
            )
        return outs

    def wait(self, group: int, life: int, timeout: float = DEADLINE_S) -> list[int]:
        end = time.monotonic() + timeout
        codes = []
        for (g, lf, r), p in self.procs.items():
            if (g, lf) != (group, life):
                continue
            try:
                codes.append(p.wait(max(1.0, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                raise AssertionError(f"group {g} (life {lf}) rank {r} did not finish:\n{self.logs(g, lf)}") from None
        return codes

    def logs(self, group: int, life: int) -> str:
        return "\n".join(
            f"--- rank {p.name}\n" + p.read_text()[-3000:] for p in sorted(self.tmp.glob(f"g{group}_l{life}_r*.log"))
        )

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def lighthouse() -> Any:
    from torchft.coordination import LighthouseServer

    # A group that heartbeats is waited for (up to 30 s) before a quorum forms without it, so
    # both groups meet in the first quorum however loaded the cores; a dead one stops
    # heartbeating and is left out after 1 s.
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=30000, heartbeat_timeout_ms=1000)
    yield server.address()
    server.shutdown()


def _wait_for(path: Path, pred: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and pred(path.read_text() or "0"):
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# ----------------------------------------------------------------------------- one world, no torchft


def _one_world(rank: int, world_size: int, steps: int, layout: str) -> dict[int, dict[str, torch.Tensor]]:
    """The groups' training in one world of all their ranks: HSDP on a (groups, group size) mesh,
    or `replicate` over every rank; each rank fed its group's batch."""
    if layout == "replicate":
        model = replicate(_model())
    else:
        model = _shard(_model(), init_device_mesh("cpu", (2, GROUP), mesh_dim_names=("replicate", "shard")))
    opt = _optimizer(model)
    replica, group_rank = divmod(rank, GROUP)
    out = {}
    for step in range(steps):
        opt.zero_grad()
        _loss(model, step, replica, group_rank).backward()
        opt.step()
        out[step + 1] = _snapshot(model, opt)
    return out


def _assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs (max {(a[k] - b[k]).abs().max().item()})"


# ----------------------------------------------------------------------------- tests


def test_group_dies_others_step_restarted_group_heals(tmp_path: Path, lighthouse: str) -> None:
    groups = _Groups(tmp_path, lighthouse)
    stop = str(tmp_path / "stop")
    try:
        ready = [str(tmp_path / f"g{g}_l0_r0.pt.ready") for g in (0, 1)]
        live = groups.start(0, 0, stop=stop, wait_for=ready, pace=0.02)
        groups.start(1, 0, kill_at=KILL_STEP, wait_for=ready)
        assert all(c == -signal.SIGKILL for c in groups.wait(1, 0)), groups.logs(1, 0)
        # Group 0 commits steps alone before group 1 comes back.
        _wait_for(Path(live[0] + ".progress"), lambda s: int(s) >= KILL_STEP + 2, DEADLINE_S, "group 0 alone")
        healed = groups.start(1, 1, until=HEALED_STEPS)
        assert groups.wait(1, 1) == [0] * GROUP, groups.logs(1, 1)
        Path(stop).touch()
        assert groups.wait(0, 0) == [0] * GROUP, groups.logs(0, 0)
    finally:
        groups.kill_all()
    reference = run_on_ranks(_one_world, 2 * GROUP, KILL_STEP - 1, "hsdp")
    for rank in range(GROUP):
        g0, g1 = torch.load(live[rank], weights_only=False), torch.load(healed[rank], weights_only=False)
        steps = sorted(g0["steps"])
        # Group 0 committed every step in order, through the death and the rejoin: the step the
        # peer died in was not committed (its gradients were incomplete) but taken again.
        assert steps == list(range(1, steps[-1] + 1)), steps
        assert g0["uncommitted"] >= 1
        assert steps[-1] >= KILL_STEP + 2 + HEALED_STEPS
        assert all(torch.isfinite(torch.tensor(r["loss"])) for r in g0["steps"].values())
        # While both groups lived, HSDP through the Manager is plain HSDP, bit for bit.
        for step in range(1, KILL_STEP):
            _assert_same_bits(g0["steps"][step]["state"], reference[rank][step], f"rank {rank} step {step}")
        # The restarted group healed from group 0 at a later step, then matched it at every step.
        assert g1["healed_at"] > KILL_STEP, g1["healed_at"]
        assert sorted(g1["steps"]) == list(range(g1["healed_at"] + 1, g1["healed_at"] + HEALED_STEPS + 1))
        for step, rec in g1["steps"].items():
            _assert_same_bits(rec["state"], g0["steps"][step]["state"], f"healed rank {rank} step {step}")


def test_replicate_groups_train_as_one_replicate(tmp_path: Path, lighthouse: str) -> None:
    """Two replica groups of 2 ranks, each under `replicate`, their buckets averaged over the
    groups by the Manager: the training of `replicate` over the 4 ranks (to rounding: the sums
    run in another order), every step committed."""
    steps = 3
    groups = _Groups(tmp_path, lighthouse)
    try:
        ready = [str(tmp_path / f"g{g}_l0_r0.pt.ready") for g in (0, 1)]
        outs = [groups.start(g, 0, layout="replicate", until=steps, wait_for=ready) for g in (0, 1)]
        for g in (0, 1):
            assert groups.wait(g, 0) == [0] * GROUP, groups.logs(g, 0)
    finally:
        groups.kill_all()
    reference = run_on_ranks(_one_world, 2 * GROUP, steps, "replicate")
    for g in (0, 1):
        for rank in range(GROUP):
            record = torch.load(outs[g][rank], weights_only=False)
            assert sorted(record["steps"]) == list(range(1, steps + 1)) and record["uncommitted"] == 0, record
            for step in range(1, steps + 1):
                got, want = record["steps"][step]["state"], reference[g * GROUP + rank][step]
                assert got.keys() == want.keys()
                for key in got:
                    torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=f"group {g} {key}")


def test_group_of_another_size_is_one_line(tmp_path: Path, lighthouse: str) -> None:
    groups = _Groups(tmp_path, lighthouse)
    ready = [str(tmp_path / f"g{g}_l0_r0.pt.ready") for g in (0, 1)]
    try:
        groups.start(0, 0, world=2, wait_for=ready, timeout=3)
        groups.start(1, 0, world=1, wait_for=ready, timeout=3)
        codes = groups.wait(0, 0) + groups.wait(1, 0)
    finally:
        groups.kill_all()
    logs = groups.logs(0, 0) + groups.logs(1, 0)
    assert codes == [1, 1, 1], logs
    for group, ranks in ((0, 2), (1, 1)):
        for rank in range(ranks):
            text = (tmp_path / f"g{group}_l0_r{rank}.log").read_text()
            line = f"ValueError: fault_tolerant: replica groups of different sizes in one quorum: this group has {ranks} ranks"
            assert line in text, text[-3000:]


def _no_lighthouse(rank: int, world_size: int, address: str) -> str:
    from composable.integrations.torchft import create_manager

    with pytest.raises(ConnectionError) as e:
        create_manager(replica_id="group_0", lighthouse=address, connect_timeout=timedelta(seconds=1))
    return str(e.value)


def test_no_lighthouse_is_one_line() -> None:
    address = f"http://127.0.0.1:{_free_port()}"
    messages = run_on_ranks(_no_lighthouse, 2, address)
    assert messages[0] == messages[1]  # every rank of the group, not only rank 0
    assert "\n" not in messages[0]
    assert messages[0].startswith(f"create_manager: no torchft lighthouse reachable at 'lighthouse'={address!r}")


def test_mesh_without_replicate_dimension_is_one_line() -> None:
    from composable.integrations.torchft import fault_tolerant

    with fake_process_group(2):
        model = _shard(_model(), init_device_mesh("cpu", (2,), mesh_dim_names=("shard",)))
        with pytest.raises(ValueError) as e:
            fault_tolerant(model, _optimizer(model), manager=None)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("fault_tolerant: 'model' is sharded on a mesh without a replicate dimension (shape (2,)")


def test_wrong_arguments_are_one_line() -> None:
    from composable.integrations.torchft import fault_tolerant

    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
        model = _shard(_model(), mesh)
        with pytest.raises(TypeError, match=r"^fault_tolerant: 'manager' must be a torchft.Manager, got NoneType$"):
            fault_tolerant(model, _optimizer(model), manager=None)
        with pytest.raises(TypeError, match=r"^fault_tolerant: 'optimizer' must be a torch.optim.Optimizer, got list$"):
            fault_tolerant(model, [], manager=None)
        with pytest.raises(
            ValueError,
            match=r"^fault_tolerant: 'model' has no module sharded by composable's fully_shard or replicated by replicate$",
        ):
            fault_tolerant(_model(), _optimizer(model), manager=None)
        # A Manager without its servers: only its registry of state-dict functions is used here.
        from torchft.manager import Manager

        manager = Manager.__new__(Manager)
        manager._load_state_dict_fns, manager._user_state_dicts = {}, {}
        fault_tolerant(model, _optimizer(model), manager)
        with pytest.raises(ValueError, match=r"^fault_tolerant: 'manager' already serves a model's state \(fault"):
            fault_tolerant(model, _optimizer(model), manager)


# ----------------------------------------------------------------------------- the private APIs read


def _group_store(rank: int, world_size: int) -> tuple[tuple[str, int] | None, bool]:
    """The group store `create_manager` gives the Manager, on a world whose store the harness
    made and passed to `init_process_group`, and whether it is the default group's."""
    from composable.integrations.torchft_manager import _group_store

    address = _group_store()
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return address, isinstance(store, dist.TCPStore) and address == (store.host, store.port)


def test_group_store_is_the_default_groups() -> None:
    """torch's `_get_default_store`, one of the two private APIs the integration reads (each in
    one helper), still exists and gives the default group's TCPStore. The other, torchft's
    `Manager._quorum_id`, is read at every step of every replica-group test above."""
    for address, is_default in run_on_ranks(_group_store, 2, fresh=True):
        assert address is not None and is_default


def test_private_apis_gone_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Were torchft's Manager to lose `_quorum_id`, or torch its `_get_default_store`, the helper
    raises one line naming the installed version, the private name, and what to do."""
    import importlib.metadata

    from torchft.manager import Manager

    from composable.integrations.torchft import _quorum_id
    from composable.integrations.torchft_manager import _default_store

    manager = Manager.__new__(Manager)  # not initialized: no `_quorum_id`, as if torchft dropped it
    version = importlib.metadata.version("torchft")
    with pytest.raises(RuntimeError) as e:
        _quorum_id(manager)
    assert str(e.value) == (
        f"fault_tolerant: torchft {version}'s Manager has no '_quorum_id', the private attribute composable "
        "reads to tell a new quorum (torchft 0.2.0 has it); install torchft 0.2.0"
    )
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    with pytest.raises(RuntimeError) as e:
        _default_store()
    assert str(e.value) == (
        f"create_manager: torch {torch.__version__} has no torch.distributed.distributed_c10d._get_default_store, "
        "the private function composable reads the group's store with; pass store_addr= and store_port= "
        "(the group's TCPStore)"
    )


# ----------------------------------------------------------------------------- the main job's --fault-tolerant

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MAIN_JOB = [
    *("--preset", "tiny", "--dim", "32", "--n-layers", "2", "--n-heads", "2", "--ffn-dim", "64", "--seq-len", "32"),
    *("--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "2", "--eval-batches", "1", "--quiet"),
    *("--steps", "3", "--eval-every", "0", "--ckpt-every", "0"),
]


def _main_job_losses(out: Path) -> list[float]:
    (metrics,) = out.glob("*/metrics.json")
    return [h["loss"] for h in json.loads(metrics.read_text())["history"]]


def _main_job_groups(tmp_path: Path, lighthouse_flags: dict[int, list[str]]) -> list[list[float]]:
    """Launch `train.py --fault-tolerant` (2 ranks each) once per replica group, in the order of
    `lighthouse_flags` (group -> its lighthouse flags), and wait for all; each group's losses,
    by group index."""
    from _harness import env_without_launcher

    flags = [*MAIN_JOB, "--parallel", "hsdp", "--nproc", "2", "--fault-tolerant"]
    procs, logs = [], []
    try:
        for g, lighthouse in lighthouse_flags.items():
            logs.append(tmp_path / f"g{g}.log")
            cmd = [sys.executable, str(EXAMPLES / "train.py"), *flags, *lighthouse]
            cmd += ["--replica-group", str(g), "--out", str(tmp_path / f"g{g}")]
            procs.append(
                subprocess.Popen(cmd, env=env_without_launcher(), stdout=logs[-1].open("w"), stderr=subprocess.STDOUT)
            )
        codes = [p.wait(DEADLINE_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * len(procs), "\n".join(log.read_text()[-3000:] for log in logs)
    return [_main_job_losses(tmp_path / f"g{g}") for g in sorted(lighthouse_flags)]


@functools.cache
def _plain_hsdp_losses() -> tuple[float, ...]:
    """The losses of one `--parallel hsdp` launch of 4 ranks (`--hsdp-shard-size 2`), which two
    fault-tolerant launches of 2 ranks match; run once for the tests that compare with it."""
    from test_train_example import _losses, _run  # the main job on the harness's ranks

    with tempfile.TemporaryDirectory(prefix="torchft-plain-hsdp-") as out:
        return tuple(_losses(_run([*MAIN_JOB, "--parallel", "hsdp", "--hsdp-shard-size", "2", "--out", out], 4)))


def _assert_trained_as_plain_hsdp(groups: list[list[float]]) -> None:
    """The same models: a group's loss is the mean over its 2 ranks, plain HSDP's over all 4 (one
    float32 rounding apart)."""
    mean = [(a + b) / 2 for a, b in zip(*groups)]
    assert mean == pytest.approx(_plain_hsdp_losses(), rel=1e-6, abs=0)
    assert groups[0] != groups[1]  # the groups trained on different data


def test_main_job_groups_train_as_plain_hsdp(tmp_path: Path) -> None:
    """Two launches of `train.py --fault-tolerant` (2 ranks each) train as one `--parallel hsdp`
    launch of 4 ranks: each step's loss (a group's mean over its ranks) averages to plain HSDP's."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=2)  # both groups in every step's quorum
    try:
        groups = _main_job_groups(tmp_path, {g: ["--lighthouse", server.address()] for g in (0, 1)})
    finally:
        server.shutdown()
    _assert_trained_as_plain_hsdp(groups)


def test_main_job_group_0_starts_the_lighthouse(tmp_path: Path) -> None:
    """No lighthouse of the test's own: group 0's `--lighthouse start:PORT --min-replicas 2`
    serves one, group 1 is given `localhost:PORT` (no scheme) and is launched first, so it waits
    for the lighthouse to come up. They train as plain HSDP, as with a lighthouse started apart."""
    port = _free_port()
    groups = _main_job_groups(
        tmp_path,
        {1: ["--lighthouse", f"localhost:{port}"], 0: ["--lighthouse", f"start:{port}", "--min-replicas", "2"]},
    )
    _assert_trained_as_plain_hsdp(groups)


def test_main_job_lighthouse_port_in_use_is_one_line(tmp_path: Path) -> None:
    from _harness import env_without_launcher

    with socket.socket() as held:  # another process's listener on the port
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = [sys.executable, str(EXAMPLES / "train.py"), *MAIN_JOB, "--parallel", "hsdp", "--nproc", "1"]
        cmd += ["--fault-tolerant", "--lighthouse", f"start:{port}", "--out", str(tmp_path)]
        done = subprocess.run(cmd, env=env_without_launcher(), capture_output=True, text=True, timeout=DEADLINE_S)
    errors = [line for line in done.stderr.splitlines() if line.startswith("train.py:")]
    assert done.returncode == 2 and errors == [
        f"train.py: error: --lighthouse start:{port}: port {port} is already in use on this host; pick another "
        f"PORT, or give --lighthouse HOST:{port} if a lighthouse already serves there"
    ], done.stderr[-3000:]


def test_lighthouse_that_comes_up_late_is_waited_for() -> None:
    """`create_manager`'s check connects again until `connect_timeout`: a lighthouse that another
    group is still starting is found; one that never comes is reported when the time is up."""
    import threading

    from composable.integrations.torchft_manager import _reachable

    port = _free_port()
    listener = socket.socket()

    def come_up() -> None:
        time.sleep(0.5)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    thread = threading.Thread(target=come_up)
    thread.start()
    try:
        assert _reachable(f"127.0.0.1:{port}", timedelta(seconds=30)) is None
    finally:
        thread.join()
        listener.close()
    began = time.monotonic()
    assert _reachable(f"http://127.0.0.1:{_free_port()}", timedelta(seconds=0.5)) is not None
    assert time.monotonic() - began >= 0.4


MAIN_JOB_ERRORS = [
    (
        ["--fault-tolerant"],
        "--fault-tolerant needs --parallel hsdp (the groups are its replicate dim), got --parallel fsdp",
    ),
    (["--parallel", "hsdp", "--fault-tolerant", "--pp", "2"], "--fault-tolerant with --pp 2: not supported"),
    (["--parallel", "hsdp", "--fault-tolerant", "--tp-size", "2"], "--fault-tolerant with --tp-size 2: not supported"),
    (["--parallel", "hsdp", "--fault-tolerant", "--mp", "fp16"], "--fault-tolerant with --mp fp16 (its scaler"),
    (["--lighthouse", "http://h:1"], "--lighthouse needs --fault-tolerant"),
    (["--replica-group", "1"], "--replica-group needs --fault-tolerant"),
    (["--parallel", "hsdp", "--fault-tolerant", "--replica-group", "-1"], "--replica-group must be >= 0, got -1"),
    (
        ["--parallel", "hsdp", "--fault-tolerant"],
        "--fault-tolerant needs a lighthouse: --lighthouse HOST:PORT or TORCHFT_LIGHTHOUSE (one running), "
        "or --lighthouse start:PORT on replica group 0",
    ),
    (["--min-replicas", "2"], "--min-replicas needs --fault-tolerant"),
    *(
        (
            ["--parallel", "hsdp", "--fault-tolerant", "--lighthouse", value],
            f"--lighthouse {value}: start:PORT needs a PORT in 1..65535",
        )
        for value in ("start", "start:", "start:http", "start:0", "start:65536")
    ),
    (
        ["--parallel", "hsdp", "--fault-tolerant", "--lighthouse", "start:29510", "--replica-group", "1"],
        "--lighthouse start:29510 on replica group 1: only group 0 starts the lighthouse; "
        "give this group --lighthouse HOST:29510 (HOST: group 0's node; localhost on one host)",
    ),
    (
        ["--parallel", "hsdp", "--fault-tolerant", "--lighthouse", "http://h:1", "--min-replicas", "2"],
        "--min-replicas 2 needs --lighthouse start:PORT",
    ),
    (
        ["--parallel", "hsdp", "--fault-tolerant", "--lighthouse", "start:29510", "--min-replicas", "0"],
        "--min-replicas must be >= 1, got 0",
    ),
    (["--heartbeat-timeout", "1"], "--heartbeat-timeout needs --fault-tolerant"),
    (
        ["--parallel", "hsdp", "--fault-tolerant", "--lighthouse", "http://h:1", "--heartbeat-timeout", "1.5"],
        "--heartbeat-timeout 1.5 needs --lighthouse start:PORT",
    ),
    *(
        (
            ["--parallel", "hsdp", "--fault-tolerant", "--lighthouse", "start:29510", "--heartbeat-timeout", value],
            f"--heartbeat-timeout must be > 0 seconds, got {value}",
        )
        for value in ("0", "-1")
    ),
]


@pytest.mark.parametrize("argv,message", MAIN_JOB_ERRORS, ids=[m[:40] for _, m in MAIN_JOB_ERRORS])
def test_main_job_refuses_fault_tolerant_flags_that_do_not_fit(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    _assert_refused(argv, message, tmp_path, capsys, monkeypatch)


def _assert_refused(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer import options

    with pytest.raises(SystemExit) as exit_info:
        options.parse_args([*MAIN_JOB, "--out", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("train.py: error: ") and message in line, line


def test_main_job_reads_the_replica_group_from_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """$REPLICA_GROUP_ID stands for --replica-group: group 1 from it may not start the
    lighthouse, a value that is no index is refused; group 0 may, with --min-replicas."""
    flags = ["--parallel", "hsdp", "--fault-tolerant", "--lighthouse", "start:29510"]
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    _assert_refused(flags, "--lighthouse start:29510 on replica group 1: only group 0", tmp_path, capsys, monkeypatch)
    monkeypatch.setenv("REPLICA_GROUP_ID", "one")
    _assert_refused(flags, "$REPLICA_GROUP_ID must be an integer >= 0, got 'one'", tmp_path, capsys, monkeypatch)
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    from trainer import options

    args = options.parse_args([*MAIN_JOB, "--out", str(tmp_path), *flags, "--min-replicas", "2"])
    assert (args.lighthouse, args.min_replicas) == ("start:29510", 2)
