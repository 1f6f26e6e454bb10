"""A tiny block model (uneven dims, a non-persistent buffer) shared by the distributed workers."""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

D_IN, D, HIDDEN, D_OUT = 5, 7, 10, 1  # D=7 splits 4/3 under FSDP; D_OUT=1 leaves an empty shard
TP_PLAN = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}


class Block(nn.Module):
    """Pre-norm MLP block with a residual."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + MLP(norm(x))."""
        return x + self.drop(self.fc2(torch.relu(self.fc1(self.norm(x)))))


class Tiny(nn.Module):
    """embed -> 2 blocks -> head, plus a non-persistent `phase` buffer added after embedding."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList([Block(dropout) for _ in range(2)])
        self.head = nn.Linear(D, D_OUT)
        self.register_buffer("phase", torch.empty(D), persistent=False)
        init_buffers(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embed, add the buffer, run the blocks, project."""
        x = self.embed(x) + self.phase
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def init_buffers(model: nn.Module) -> None:
    """Recompute the non-persistent buffer (what to_empty leaves as garbage)."""
    base = getattr(model, "base_model", None)
    target = base.model if base is not None and hasattr(base, "model") else model
    with torch.no_grad():
        target.phase.copy_(torch.sin(torch.arange(D, dtype=torch.float32)))


def reference_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """The pretrained weights every test file holds."""
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in Tiny().state_dict().items()}


def add_lora(model: nn.Module) -> nn.Module:
    """Wrap with peft LoRA on fc1/fc2 (only adapter weights train)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, lora_alpha=4, target_modules=["fc1", "fc2"], lora_dropout=0.0)
    return get_peft_model(model, config)


class Results:
    """Named check outcomes written as JSON per rank, so one launch serves many pytest tests."""

    def __init__(self, out_dir: str, rank: int) -> None:
        self.path = os.path.join(out_dir, f"results-rank{rank}.json")
        self.data: dict[str, dict] = {}

    def check(self, name: str, fn) -> None:
        """Run fn(); record ok/detail (its return value, or the traceback)."""
        try:
            detail = fn()
            self.data[name] = {"ok": True, "detail": detail}
        except Exception:  # recorded for the test to show
            self.data[name] = {"ok": False, "detail": traceback.format_exc()}
        self.save()

    def save(self) -> None:
        """Write the results so far (a crash still leaves earlier ones)."""
        with open(self.path, "w") as fh:
            json.dump(self.data, fh, indent=1, default=str)
