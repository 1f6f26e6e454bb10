"""Export trained weights: gather them, and write the files the family lays them out as, each
safetensors file naming the base it was trained on; `check_export` refuses before launch what the
family could not export as asked."""

from __future__ import annotations

import json
from tempfile import gettempdir
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from splitstage.pipelines.family import ExportRequest, Family
from splitstage.storage.files import ensure_folder, join, open_fs, storage_errors, write_atomic
from splitstage.storage.safetensors_io import read_header
from splitstage.tasks.job_plan import JobPlan
from splitstage.tasks.stage2.models import LORA_ADAPTER, Stage2Models
from splitstage.tasks.stage2.outputs import RunPlaces
from splitstage.tasks.stage2.resume import IDENTITY, export_metadata


def request_for(
    lora: bool,
    family: Family,
    steps: int,
    targets: list[str] | None = None,
):
    """What this run exports: LoRA (rank, alpha, `targets`: those preflight adapted, default
    the family's list) or full weights."""
    config = family.config
    trainable = config.trainable
    listed = family.lora_targets(trainable.lora_base_model) if lora else []
    if targets is not None:  # the family's order, less the defaults the model lacks
        listed = [target for target in listed if target in set(targets)]
    return ExportRequest(
        lora=lora,
        rank=trainable.lora_rank,
        alpha=float(trainable.lora_alpha or trainable.lora_rank),
        targets=listed,
        remove_prefix=config.output.remove_prefix_in_ckpt,
        steps=steps,
    )


def check_export(plan: JobPlan) -> None:
    """Before launch: the family can export each trained model as asked (which models, LoRA or
    full, `output.remove_prefix_in_ckpt`), else one ConfigError line from the family."""
    config = plan.config
    lora = config.trainable.lora_base_model is not None
    request = request_for(lora, plan.family, steps=0)
    for name in config.trainable.models():
        model = plan.meta_model(name)
        keys = (
            [f"{module}.lora_A.weight" for module, _ in model.named_modules() if module]
            if lora
            else [key for key, _ in model.named_parameters()]
        )
        plan.family.check_export(name, request, keys)


def trained_state(stage2: Stage2Models) -> dict[str, dict[str, torch.Tensor]]:
    """Full (gathered) tensors of what was trained, per model; collective, rank 0 gets them."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return {
        name: get_model_state_dict(stage2.models[name], options=options) for name in stage2.trained
    }


def export_weights(
    family: Family,
    stage2: Stage2Models,
    places: RunPlaces,
    settings: dict[str, Any],
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
    url, options = places.output_url, places.output_storage_options  # resolved once
    fs, root = open_fs(url, options)
    ensure_folder(fs, root, url, field="output.url")  # never creates a bucket
    request = request_for(stage2.lora, family, steps, settings.get("lora_targets"))
    base = export_metadata(settings.get(IDENTITY))
    written = {}
    for name, state in states.items():
        plain = {key.replace(f".{LORA_ADAPTER}.", "."): t for key, t in state.items()}
        with storage_errors(gettempdir(), "write the export's scratch files under"):
            files = family.export_files(name, plain, request)  # may lay files out in TMPDIR
        for label, (file_name, data) in files.items():
            file_name = with_suffix(file_name, suffix)
            if base and file_name.endswith(".safetensors"):
                data = with_metadata(data, base)
            target = f"{url.rstrip('/')}/{file_name}"
            with storage_errors(target, "write the export", options, field="output.url"):
                write_atomic(fs, join(root, file_name), data)
            written[label + suffix] = target
    return written


def set_aside_averages(places: RunPlaces, written: dict[str, str]) -> list[tuple[str, str]]:
    """Rename the `_ema` twin of each file `written` into the run's output folder, where an
    earlier launch left one, to `<name>.stale` (`.stale-2`, ...: none overwritten); (old, new)
    URLs. Only names this export would write there are touched."""
    url, options = places.output_url.rstrip("/"), places.output_storage_options
    fs, root = open_fs(url, options)
    moved = []
    for target in written.values():
        if not target.startswith(url + "/"):
            continue
        name = with_suffix(target[len(url) + 1 :], "_ema")
        if not fs.exists(join(root, name)):
            continue
        aside, n = f"{name}.stale", 1
        while fs.exists(join(root, aside)):
            n += 1
            aside = f"{name}.stale-{n}"
        with storage_errors(f"{url}/{name}", "set aside", options, field="output.url"):
            fs.mv(join(root, name), join(root, aside))
        moved.append((f"{url}/{name}", f"{url}/{aside}"))
    return moved


def with_suffix(file_name: str, suffix: str) -> str:
    """`dit_lora.safetensors` + `_ema` -> `dit_lora_ema.safetensors` (folders kept)."""
    if not suffix:
        return file_name
    folder, _, base = file_name.rpartition("/")
    stem, dot, extension = base.partition(".")
    return f"{folder + '/' if folder else ''}{stem}{suffix}{dot}{extension}"


def with_metadata(data: bytes, metadata: dict[str, str]) -> bytes:
    """Safetensors bytes with `metadata` added to the header's `__metadata__` (tensors and
    their offsets unchanged; the header stays 8-byte aligned)."""
    size = int.from_bytes(data[:8], "little")
    header = read_header(data)
    header["__metadata__"] = {**(header.get("__metadata__") or {}), **metadata}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + size :]
