"""Export trained weights as safetensors: LoRA or full, with a DiffSynth-style key prefix."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save as safetensors_bytes
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from splitstage.pipelines.config import SplitstageConfig
from splitstage.pipelines.family import Family
from splitstage.tasks.cache.storage import ensure_folder, join, write_atomic
from splitstage.tasks.outputs import open_output
from splitstage.tasks.stage2.models import LORA_ADAPTER, Stage2Models


def export_key(family: Family, model_name: str, key: str, remove_prefix: str) -> str:
    """The family's key for a trained tensor (peft's adapter name dropped), minus
    `remove_prefix_in_ckpt`."""
    full = family.export_key(model_name, key.replace(f".{LORA_ADAPTER}.", "."))
    return full[len(remove_prefix) :] if remove_prefix and full.startswith(remove_prefix) else full


def trained_state(stage2: Stage2Models) -> dict[str, dict[str, torch.Tensor]]:
    """Full (gathered) tensors of what was trained, per model; collective, rank 0 gets them."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return {
        name: get_model_state_dict(stage2.models[name], options=options) for name in stage2.trained
    }


def export_weights(
    config: SplitstageConfig,
    family: Family,
    stage2: Stage2Models,
    spec: dict[str, Any],
    states: dict[str, dict[str, torch.Tensor]] | None = None,
) -> dict:
    """Write `<output>/<model>[_lora].safetensors` and `run.json`; returns their URLs (rank 0).

    `states` (per model, already gathered on rank 0 by the caller) replaces `trained_state`.
    """
    states = trained_state(stage2) if states is None else states
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    url = spec["output_url"]
    fs, root = open_output(config, url)
    ensure_folder(fs, root, url, field="output.url")  # never creates a bucket
    written = {}
    for name, state in states.items():
        tensors = {
            export_key(
                family, name, key, config.output.remove_prefix_in_ckpt
            ): t.detach().contiguous()
            for key, t in state.items()
            if not stage2.lora or "lora_" in key
        }
        file_name = f"{name}_lora.safetensors" if stage2.lora else f"{name}.safetensors"
        meta = {"format": "pt", "model": name, "lora": str(stage2.lora).lower()}
        meta.update(family.export_metadata(name, stage2.lora))
        if stage2.lora:
            meta["lora_rank"] = str(config.trainable.lora_rank)
            meta["lora_alpha"] = str(config.trainable.lora_alpha or config.trainable.lora_rank)
        write_atomic(fs, join(root, file_name), safetensors_bytes(tensors, metadata=meta))
        written[name] = f"{url.rstrip('/')}/{file_name}"
    return written
