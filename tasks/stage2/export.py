"""Export trained weights: gather them, and write the files the family lays them out as."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from splitstage.config.job import SplitstageConfig
from splitstage.pipelines.family import ExportRequest, Family
from splitstage.storage.files import ensure_folder, join, write_atomic
from splitstage.tasks.stage2.models import LORA_ADAPTER, Stage2Models
from splitstage.tasks.stage2.outputs import open_output


def request_for(config: SplitstageConfig, stage2: Stage2Models, family: Family, steps: int):
    """What this run exports: LoRA (rank, alpha, targets) or full weights."""
    trainable = config.trainable
    return ExportRequest(
        lora=stage2.lora,
        rank=trainable.lora_rank,
        alpha=float(trainable.lora_alpha or trainable.lora_rank),
        targets=family.lora_targets(trainable.lora_base_model) if stage2.lora else [],
        remove_prefix=config.output.remove_prefix_in_ckpt,
        steps=steps,
    )


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
    steps: int = 0,
    suffix: str = "",
) -> dict:
    """Write each trained model's export files (the family's layout) into the output folder;
    returns {label: URL} (rank 0). `states` (gathered on rank 0 by the caller) replaces
    `trained_state`; `suffix` names another set of the same files (`_ema`: `x_ema.safetensors`)."""
    states = trained_state(stage2) if states is None else states
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    url = spec["output_url"]
    fs, root = open_output(config, url)
    ensure_folder(fs, root, url, field="output.url")  # never creates a bucket
    request = request_for(config, stage2, family, steps)
    written = {}
    for name, state in states.items():
        plain = {key.replace(f".{LORA_ADAPTER}.", "."): t for key, t in state.items()}
        for label, (file_name, data) in family.export_files(name, plain, request).items():
            file_name = with_suffix(file_name, suffix)
            write_atomic(fs, join(root, file_name), data)
            written[label + suffix] = f"{url.rstrip('/')}/{file_name}"
    return written


def with_suffix(file_name: str, suffix: str) -> str:
    """`dit_lora.safetensors` + `_ema` -> `dit_lora_ema.safetensors` (folders kept)."""
    if not suffix:
        return file_name
    folder, _, base = file_name.rpartition("/")
    stem, dot, extension = base.partition(".")
    return f"{folder + '/' if folder else ''}{stem}{suffix}{dot}{extension}"
