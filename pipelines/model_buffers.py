"""Non-persistent buffers across meta init: kept as the class built them, put back after loading.

No weights file holds them (RoPE tables, position ids, ...), and `to_empty` turns them into
garbage, so a family keeps a copy when it builds a model and restores it after the weights load.
"""

from __future__ import annotations

import torch
from torch import nn

from splitstage.config.base_group import ConfigError

KEPT = "_splitstage_buffers"


def keep_buffers(model: nn.Module) -> nn.Module:
    """Remember a copy of every non-persistent buffer of `model` (call right after building)."""
    setattr(
        model,
        KEPT,
        {
            f"{prefix}.{name}" if prefix else name: buffer.clone()
            for prefix, module in model.named_modules()
            for name, buffer in module._buffers.items()
            if buffer is not None and name in module._non_persistent_buffers_set
        },
    )
    return model


def restore_buffers(model: nn.Module, what: str) -> None:
    """Copy the kept buffers back (names matched through peft's `.base_layer` wrapping); a kept
    buffer that is no longer found is an error naming `what`, never a silent garbage table."""
    saved = getattr(model, KEPT, {})
    restored = set()
    with torch.no_grad():
        for key, buffer in model.named_buffers():
            key = key.replace(".base_layer.", ".")  # peft wraps the targeted layers
            if key in saved:
                buffer.copy_(saved[key].to(buffer))
                restored.add(key)
    if set(saved) - restored:
        raise ConfigError(
            f"internal: non-persistent buffers {sorted(set(saved) - restored)} of {what} were "
            "not found after wrapping"
        )
