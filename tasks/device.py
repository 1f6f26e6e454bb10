"""Device and precision from what is present (CUDA when there is one, CPU otherwise), and the
memory a process holds on it."""

from __future__ import annotations

import ctypes
import os
import resource
from collections.abc import Iterable
from pathlib import Path

import torch

from splitstage.splitter import UserError


def pick_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """'auto' -> cuda:<local_rank> if CUDA is present, else cpu; explicit names are checked."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(
            f"device {name!r} is not a device name; use auto, cpu, cuda or cuda:N"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r} asked for but CUDA is not available here; use 'auto'")
    return device


def pick_dtype(mixed_precision: str, device: torch.device) -> torch.dtype:
    """Compute dtype: 'auto' is bf16 on GPUs that support it, else fp32; 'fp16' only on a GPU
    (fp16 needs a gradient scaler and fp16 kernels: a CPU runs it in fp32, as preflight says)."""
    if mixed_precision == "bf16":
        return torch.bfloat16
    if mixed_precision == "fp16":
        return torch.float16 if device.type == "cuda" else torch.float32
    if mixed_precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


# glibc's mallopt parameter and its initial value: requests this large are mapped, not heaped.
M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES = -3, 128 * 1024


def steady_heap() -> bool:
    """Fix glibc's mmap threshold at its initial 128 KiB, as MALLOC_MMAP_THRESHOLD_ would: left
    dynamic, it rises to the largest block freed, and a CPU forward's transient buffers then
    stay in the heap between the tensors it keeps (a 99 MB text encoder's first CPU forward
    held +540 MB; fixed, +50 MB: docs/benchmarks.md). False where it was not set: not glibc,
    or the user chose a threshold (MALLOC_MMAP_THRESHOLD_, GLIBC_TUNABLES)."""
    chosen = os.environ.get("MALLOC_MMAP_THRESHOLD_") or "mmap_threshold" in os.environ.get(
        "GLIBC_TUNABLES", ""
    )
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        glibc = None
    if chosen or not glibc:
        return False
    return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def resident_mb() -> float:
    """Resident memory of this process now, in MiB (Linux /proc; 0 where unavailable)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_resident_mb() -> float:
    """This process's peak resident memory in MiB (VmHWM: counts from its exec, where ru_maxrss
    starts at the forking parent's size), file-mapped pages included; ru_maxrss where /proc is
    absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory_gib(device: torch.device) -> dict[str, float]:
    """This process's peak memory since it started, in GiB: the resident set (Linux ru_maxrss,
    KiB) and, on a GPU, what torch's CUDA allocator held at most."""
    peak = {"peak_rss_gib": peak_resident_mb() / 2**10}
    if device.type == "cuda":
        peak["peak_cuda_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return peak


def tensor_mb(models: Iterable[torch.nn.Module]) -> float:
    """The models' own size in MiB: their parameters' and buffers' bytes (each tensor once)."""
    seen: dict[int, int] = {}
    for model in models:
        for tensor in [*model.parameters(), *model.buffers()]:
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values()) / 2**20
