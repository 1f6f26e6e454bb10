"""Process-group set-up for stage 2: rank info from torchrun's environment and the device mesh.

Device and backend follow what is present: CUDA + NCCL when CUDA is available, CPU + gloo otherwise.
`SPLITSTAGE_DEVICE=cpu` (or the `device` argument) forces a device type, e.g. to run several CPU
ranks on a machine that has fewer GPUs than ranks.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DEVICE_ENV = "SPLITSTAGE_DEVICE"


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job: global and local rank, job size, device and backend."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that writes shared files and logs."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    """Read an integer torchrun variable, naming it when it is malformed."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def default_device_type(device: str | None = None) -> str:
    """The device type to train on: `device`, else $SPLITSTAGE_DEVICE, else cuda if present."""
    chosen = device or os.environ.get(DEVICE_ENV) or ""
    if chosen:
        return torch.device(chosen).type
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device_type: str) -> str:
    """The collective backend for a device type: nccl for cuda, gloo for cpu, else torch's."""
    if device_type == "cuda":
        return "nccl"
    if device_type == "cpu":
        return "gloo"
    get_default = getattr(dist, "get_default_backend_for_device", None)
    if get_default is None:
        raise ValueError(f"no collective backend known for device type {device_type!r}")
    return get_default(device_type)


def _local_device(device_type: str, local_rank: int, local_world_size: int) -> torch.device:
    """This rank's device; one accelerator per local rank, with a clear error when too few."""
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type)
    count = module.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"{local_world_size} processes per node but only {count} {device_type} device(s): "
            f"set nproc_per_node <= {count}, or {DEVICE_ENV}=cpu to train on the CPU"
        )
    module.set_device(local_rank)
    return torch.device(device_type, local_rank)


def init_distributed(
    device: str | None = None,
    timeout: datetime.timedelta | None = None,
    *,
    host_collectives: bool = False,
) -> DistInfo:
    """Join the job torchrun started (or a 1-rank group without torchrun) and pick the device.

    `host_collectives`: tensors in host memory take part in collectives too (weights offloaded
    to the CPU: their gradients' norm), so an accelerator's group also gets gloo for them."""
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
    device_type = default_device_type(device)
    local_device = _local_device(device_type, local_rank, local_world_size)
    backend = backend_for(device_type)
    if host_collectives and device_type != "cpu":
        backend = f"{device_type}:{backend},cpu:gloo"
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), local_device, backend)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if world_size == 1:  # one rank (with or without torchrun): an in-memory store, no port
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs
        )
    elif "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
    else:
        raise RuntimeError(
            f"WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are unset: start the job "
            "with torchrun (tasks.launcher.run_torchrun)"
        )
    return DistInfo(rank, local_rank, world_size, local_device, backend)


def close_distributed(barrier: bool = False) -> None:
    """Leave the process group if one is open (safe to call twice). `barrier` (the normal end
    only: every rank gets there) first waits for all ranks, so none tears gloo down while a peer
    still has work in flight: that race aborts a rank at exit ("terminate called without an
    active exception") after everything was written."""
    if dist.is_initialized():
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """`data` from rank `src` to every rank of the default group (raw bytes in a uint8 tensor:
    no pickle); returned unchanged when there is no group of more than one rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return data or b""
    device = comm_device()
    size = torch.tensor([len(data or b"")], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    if not size.item():
        return b""
    if dist.get_rank() == src:
        assert data is not None
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), src)
        return data
    buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src)
    return buffer.cpu().numpy().tobytes()


def comm_device() -> torch.device:
    """The device collectives of the default group need: the current accelerator for nccl."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_mesh(
    dp_shard: int, tp: int, world_size: int, *, device_type: str | None = None
) -> DeviceMesh:
    """A mesh of dp_shard x tp ranks: 1-D ("dp",) when tp == 1, else 2-D ("dp", "tp")."""
    fields = (("the data-parallel degree", dp_shard), ("train.tp_degree", tp))
    for name, value in fields:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if dp_shard * tp != world_size:
        raise ValueError(
            f"mesh dp={dp_shard} x tp={tp} = {dp_shard * tp} ranks but the job has {world_size}; "
            "set train.tp_degree (with train.parallelism 'tp' or 'fsdp+tp') to a divisor of the "
            "world size (train.nnodes * train.nproc_per_node)"
        )
    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise ValueError(
            f"world_size={world_size} but the process group has {dist.get_world_size()} ranks"
        )
    device_type = device_type or (comm_device().type if dist.is_initialized() else None)
    device_type = device_type or default_device_type()
    if tp == 1:
        return init_device_mesh(device_type, (dp_shard,), mesh_dim_names=("dp",))
    return init_device_mesh(device_type, (dp_shard, tp), mesh_dim_names=("dp", "tp"))
