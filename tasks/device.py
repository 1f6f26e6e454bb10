"""Device and precision from what is present: CUDA when there is one, CPU otherwise."""

from __future__ import annotations

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
    """Compute dtype: 'auto' is bf16 on GPUs that support it, else fp32."""
    if mixed_precision == "bf16":
        return torch.bfloat16
    if mixed_precision == "fp16":
        return torch.float16
    if mixed_precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32
