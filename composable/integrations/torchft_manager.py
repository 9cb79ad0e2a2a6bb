"""A replica group's torchft `Manager`, made for `composable.integrations.torchft.fault_tolerant`.

`create_manager` checks what a user can get wrong before torchft would hang or fail obscurely
(no process group, no lighthouse reachable), and gives the Manager the group's own TCPStore and
torchft's process group for the group's backend. It lives apart from `fault_tolerant`, which
wires a model and optimizer to whatever Manager it is given. torchft is imported when it runs.
"""

from __future__ import annotations

import importlib
import os
import socket
import time
import urllib.parse
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

__all__ = ["create_manager"]


def import_torchft_manager(api: str) -> Any:
    """`torchft.manager`, imported when `api` runs; without torchft, one line naming `api`."""
    try:
        import torchft.manager
    except ImportError as e:
        raise ImportError(f"{api}: needs torchft (pip install 'composable[ft]'): {e}") from None
    return torchft.manager


def _with_scheme(address: str) -> str:
    """`address` as a URL: torchft's client needs the scheme, users often write host:port."""
    return address if "://" in address else f"http://{address}"


def _reachable(address: str, timeout: timedelta) -> str | None:
    """None once a TCP connection to `address` (http://host:port) opens within `timeout`, else
    why not. A refused connection is tried again until then: a lighthouse that another replica
    group is starting alongside this one comes up a little later."""
    url = urllib.parse.urlparse(_with_scheme(address))
    try:
        port = url.port
    except ValueError as e:
        return str(e)
    if url.hostname is None or port is None:
        return "it is not http://host:port"
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.05
    while True:
        try:
            socket.create_connection((url.hostname, port), timeout=max(deadline - time.monotonic(), 0.01)).close()
            return None
        except socket.gaierror as e:  # a name that does not resolve will not start to
            return str(e) or type(e).__name__
        except OSError as e:
            why = str(e) or type(e).__name__
        left = deadline - time.monotonic()
        if left <= 0:
            return why
        time.sleep(min(pause, left))  # then a last try at the deadline
        pause = min(2 * pause, 1.0)


def _default_store() -> dist.Store:
    """The store the default process group was initialized with. Raises `RuntimeError` in one
    line naming the installed torch when torch no longer has the accessor.

    The one private torch function composable's torchft integration calls: torch.distributed's
    public store API makes stores (`TCPStore`, `rendezvous`) but does not return the one
    `init_process_group` took, which a caller may have made itself at an address that no
    environment variable names. A public accessor of the default group's store would replace
    this; until then `create_manager(store_addr=..., store_port=...)` does without it."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        raise RuntimeError(
            f"create_manager: torch {torch.__version__} has no torch.distributed.distributed_c10d._get_default_store, "
            "the private function composable reads the group's store with; pass store_addr= and store_port= "
            "(the group's TCPStore)"
        )
    return cast(dist.Store, get())


def _group_store() -> tuple[str, int] | None:
    """The host and port of the group's own TCPStore (the default process group's: torchrun's
    at MASTER_ADDR:MASTER_PORT, or one the caller made), or None (the Manager then reads
    MASTER_ADDR and MASTER_PORT)."""
    store = _default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return (store.host, store.port) if isinstance(store, dist.TCPStore) else None


def create_manager(
    *,
    replica_id: str,
    lighthouse: str | None = None,
    min_replica_size: int = 1,
    timeout: timedelta = timedelta(seconds=60),
    quorum_timeout: timedelta = timedelta(seconds=60),
    connect_timeout: timedelta = timedelta(seconds=10),
    init_sync: bool = True,
    **manager_kwargs: Any,
) -> Any:
    """This replica group's `torchft.Manager`, for `fault_tolerant`: call it on every rank of
    the group after `init_process_group` (the group's own world; its TCPStore, torchrun's, is
    the Manager's too; without one, `MASTER_ADDR` and `MASTER_PORT` name it).

    `replica_id` names the group (ending in its index, e.g. "group_3": torchft numbers the
    groups' ranks from it); `lighthouse` is the lighthouse's address, `http://host:port` or
    `host:port` (default: the `TORCHFT_LIGHTHOUSE` environment variable). The cross-group
    process group is torchft's gloo one on CPU and its NCCL one where the group's backend is
    NCCL. `init_sync=False` when every group builds the same weights from the same seed (no
    fetch at the first step). The other keyword arguments go to `Manager`. Rank 0 waits up to
    `connect_timeout` for the lighthouse to accept a connection (one being started alongside
    this group is waited for); raises `ConnectionError` on every rank of the group, in one line
    naming the address, when it does not."""
    ft = import_torchft_manager("create_manager")
    api = "create_manager"
    if not dist.is_initialized():
        raise RuntimeError(
            f"{api}: torch.distributed is not initialized; start each replica group as its own world "
            "(torchrun) and call init_process_group first"
        )
    if not isinstance(replica_id, str) or not replica_id:
        raise ValueError(f"{api}: 'replica_id' must be a non-empty str, got {replica_id!r}")
    lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lighthouse:
        raise ValueError(f"{api}: 'lighthouse' is not given and TORCHFT_LIGHTHOUSE is not set")
    rank, world = dist.get_rank(), dist.get_world_size()
    # Only rank 0 talks to the lighthouse; the others would wait for it in the store, so rank 0
    # tries first and tells them.
    verdict = [_reachable(lighthouse, connect_timeout) if rank == 0 else None]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ConnectionError(
            f"{api}: no torchft lighthouse reachable at 'lighthouse'={lighthouse!r} within "
            f"{connect_timeout.total_seconds():g} s ({verdict[0]}); start one (torchft_lighthouse "
            "--min_replicas 1 --bind [::]:29510) or pass its address"
        )
    if "store_addr" not in manager_kwargs and (address := _group_store()) is not None:
        manager_kwargs["store_addr"], manager_kwargs["store_port"] = address
    pgs = importlib.import_module("torchft.process_group")
    nccl = dist.get_backend() == "nccl"
    pg = pgs.ProcessGroupNCCL(timeout=timeout) if nccl else pgs.ProcessGroupGloo(timeout=timeout)
    return ft.Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=min_replica_size,
        rank=rank,
        world_size=world,
        replica_id=replica_id,
        lighthouse_addr=_with_scheme(lighthouse),
        timeout=timeout,
        quorum_timeout=quorum_timeout,
        connect_timeout=connect_timeout,
        init_sync=init_sync,
        **manager_kwargs,
    )
