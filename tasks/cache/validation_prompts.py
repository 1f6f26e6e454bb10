"""Validation prompts encoded once in stage 1 and kept beside the cache, for stage-2 sampling.

Stage 2 never loads a text encoder it does not train, so the prompts' embeddings (and their
negatives') are computed where the encoders are: in preprocess, into
`<cache.url>/validation-prompts/<key>.safetensors`. The key covers the prompts, the encoders'
fingerprints and the stage-1 settings; it is not part of the training samples' cache key, so
changing the prompts never invalidates the cache (a rerun of preprocess encodes only them).
With `validation.reference_images` the family's reference step (`Family.reference_conditioning`,
for the prompts and for their negatives) runs there too, once per sample size, into
`ref.<WxH>.cond.<name>` / `ref.<WxH>.uncond.<name>` tensors of the same file; the key then also
covers the images' content, the sizes and the reference models.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from splitstage.config.monitoring import size_label
from splitstage.pipelines.runtime import StepContext
from splitstage.splitter import UserError
from splitstage.storage.files import join, open_fs, storage_errors, write_atomic
from splitstage.tasks.cache.fingerprint import stable_hash
from splitstage.tasks.cache.validation_references import (
    Reference,
    check_validation_references,
    reference_key,
    reference_sizes,
    reference_tensors,
)
from splitstage.tasks.device import pick_device
from splitstage.tasks.job_plan import JobPlan

FOLDER = "validation-prompts"
Conditioning = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]
References = dict[str, Conditioning]  # sample size 'WxH' -> (cond, uncond) reference outputs


def prompts_key(plan: JobPlan) -> str:
    """What the embeddings depend on: prompts, negatives, encoders, units and settings (and the
    reference images' content, sizes and models when given: reading them refuses bad ones)."""
    config, family = plan.config, plan.family
    payload = {
        "pipeline": plan.pipeline.name,
        "prompts": config.validation.prompts,
        "negatives": config.validation.negatives(),
        "units": [unit.spec.to_dict() for unit in family.prompt_units()],
        "models": {m: plan.model_fingerprint(m) for m in family.prompt_models()},
        "settings": family.stage1_settings(),
    }
    references = check_validation_references(family)
    if references:  # only then: the keys of jobs without references stay as they were
        models = {m: plan.model_fingerprint(m) for m in family.reference_models()}
        payload["references"] = reference_key(family, references) | {"models": models}
    return stable_hash(payload)[:32]


def prompts_path(plan: JobPlan) -> tuple[Any, str, str]:
    """(fs, path, URL) of this job's validation-prompt embeddings file."""
    cache = plan.config.cache
    block = cache.credentials_block
    fs, root = open_fs(cache.url, cache.storage_options, field="cache.url", credentials_block=block)
    name = f"{prompts_key(plan)}.safetensors"
    return fs, join(root, FOLDER, name), f"{cache.url.rstrip('/')}/{FOLDER}/{name}"


def encode(plan: JobPlan, models: dict, device: torch.device, prompts, negatives) -> Conditioning:
    """The prompt units' outputs for the prompts and for their negatives."""
    family = plan.family
    ctx = StepContext(models=models, device=device, settings=family.settings())
    with torch.no_grad():
        return family.prompt_conditioning(ctx, prompts), family.prompt_conditioning(ctx, negatives)


def encode_references(
    plan: JobPlan,
    models: dict,
    device: torch.device,
    references: list[list[Reference]],
    sizes: list[tuple[int, int]] | None = None,
) -> References:
    """The family's reference step on each prompt's references with the prompts (cond) and
    with their negatives (uncond), at `sizes` (default: every sample size)."""
    family, settings = plan.family, plan.config.validation
    if not references:
        return {}
    ctx = StepContext(models=models, device=device, settings=family.settings())
    out: References = {}
    with torch.no_grad():
        for size in reference_sizes(family) if sizes is None else sizes:
            images = reference_tensors(family, references, size)
            out[size_label(*size)] = (
                family.reference_conditioning(ctx, images, settings.prompts),
                family.reference_conditioning(ctx, images, settings.negatives()),
            )
    return out


def validation_prompts_written(plan: JobPlan) -> bool:
    """Whether nothing is left to encode: validation is off or its prompts' file is there."""
    config = plan.config
    if not config.validation.enabled:
        return True
    fs, path, url = prompts_path(plan)
    with storage_errors(url, "check", config.cache.storage_options):
        return fs.exists(path)


def write_validation_prompts(plan: JobPlan) -> str | None:
    """Encode the validation prompts into their file unless it is there; its URL (or None)."""
    config = plan.config
    if not config.validation.enabled:
        return None
    fs, path, url = prompts_path(plan)
    if validation_prompts_written(plan):
        return url
    family = plan.family
    references = check_validation_references(family)  # read before any model loads
    names = set(family.prompt_models()) | set(family.reference_models() if references else ())
    device = pick_device(config.preprocess.device)
    models = {name: family.build_model(name, device) for name in sorted(names)}
    cond, uncond = encode(
        plan, models, device, config.validation.prompts, config.validation.negatives()
    )
    tensors = {f"cond.{k}": v.detach().cpu().contiguous() for k, v in cond.items()}
    tensors |= {f"uncond.{k}": v.detach().cpu().contiguous() for k, v in uncond.items()}
    for label, pair in encode_references(plan, models, device, references).items():
        for part, outputs in zip(("cond", "uncond"), pair, strict=True):
            prefix = f"ref.{label}.{part}."
            tensors |= {prefix + k: v.detach().cpu().contiguous() for k, v in outputs.items()}
    meta = {"prompts": json.dumps(config.validation.prompts)}
    if references:
        meta["reference_images"] = json.dumps([[r.shown for r in refs] for refs in references])
    write_atomic(fs, path, safetensors_save(tensors, metadata=meta), url)
    return url


def read_validation_prompts(plan: JobPlan) -> Conditioning | None:
    """The cached (cond, uncond) embeddings, or None when preprocess has not encoded them."""
    tensors = read_validation_file(plan)
    if tensors is None:
        return None
    cond = {k[5:]: v for k, v in tensors.items() if k.startswith("cond.")}
    uncond = {k[7:]: v for k, v in tensors.items() if k.startswith("uncond.")}
    return cond, uncond


def read_validation_references(plan: JobPlan) -> References | None:
    """The cached (cond, uncond) reference outputs per sample size ('WxH'), or None when not
    encoded."""
    tensors = read_validation_file(plan)
    if tensors is None:
        return None
    out: References = {}
    for key, value in tensors.items():
        if key.startswith("ref."):
            label, part, name = key[4:].split(".", 2)
            pair = out.setdefault(label, ({}, {}))
            pair[part == "uncond"][name] = value
    return out


def read_validation_file(plan: JobPlan) -> dict[str, torch.Tensor] | None:
    """Every tensor of this job's validation-prompts file, or None when it is not there."""
    fs, path, url = prompts_path(plan)
    with storage_errors(url, "read", plan.config.cache.storage_options):
        if not fs.exists(path):
            return None
        data = fs.cat_file(path)
    try:
        tensors = safetensors_load(data)
    except Exception as error:  # noqa: BLE001 - any decode failure means a damaged file
        raise UserError(
            f"{url}: the encoded validation prompts are damaged ({error}); delete the file and "
            "run `splitstage preprocess` again"
        ) from None
    return tensors
