"""DiffSynth jobs on tiny models, their pipelines and outputs (tests/diffsynth, side venv only)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from diffsynth.configs.model_configs import MODEL_CONFIGS
from diffsynth.core import ModelConfig
from diffsynth.core.loader import hash_model_file

from splitstage.config.job import config_from_dict
from splitstage.pipelines.diffsynth.loader import pipeline_class

ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "DIFFSYNTH_SKIP_DOWNLOAD": "True"}
PIPELINES = {"ZImagePipeline": "bf16", "WanVideoPipeline": "fp32", "QwenImagePipeline": "bf16"}
# The source text's Qwen-Image LoRA (its three commands): these targets, rank 32 (alpha = rank,
# DiffSynth's default), `--remove_prefix_in_ckpt "pipe.dit."`, `--lora_base_model "dit"`.
SOURCE_TEXT_TARGETS = [
    *("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"),
    *("img_mlp.net.2", "img_mod.1", "txt_mlp.net.2", "txt_mod.1"),
]
LORA = {
    "QwenImagePipeline": {
        "lora_base_model": "dit",
        "lora_target_modules": SOURCE_TEXT_TARGETS,
        "lora_rank": 32,
        "lora_alpha": 32,
    }
}
SEED = 3


def job(root: Path, name: str, **train):
    """A LoRA job on the dit (rank 4, alpha 8; Qwen-Image: the source text's), one per step."""
    return config_from_dict(job_document(root, name, **train))


def job_document(root: Path, name: str, **train) -> dict:
    """The job as the dict a TOML file holds."""
    info = json.loads((root / name / "info.json").read_text())
    pipeline = {"name": "diffsynth", "pipeline_class": name, "height": 32, "width": 32}
    pipeline |= {"torch_dtype": PIPELINES[name], **info}
    return {
        "job": {"name": f"{name}-lora", "seed": SEED},
        "pipeline": pipeline,
        "trainable": LORA.get(name, {"lora_base_model": "dit", "lora_rank": 4, "lora_alpha": 8}),
        "data": {"base_path": str(root / "data")},
        "cache": {"url": str(root / "cache"), "shard_samples": 2},
        "train": {"batch_size": 1, "max_steps": 2, "log_every": 1, "learning_rate": 1e-3} | train,
        "output": {"url": str(root / "out"), "remove_prefix_in_ckpt": "pipe.dit."},
    }


def fresh(name: str, info: dict):
    """DiffSynth's own pipeline from the same files, in training mode."""
    pipe = pipeline_class(job_group(name, info)).from_pretrained(
        torch_dtype=torch.bfloat16 if PIPELINES[name] == "bf16" else torch.float32,
        device="cpu",
        model_configs=[ModelConfig(path=p) for p in info["model_paths"]],
        tokenizer_config=ModelConfig(path=info["tokenizer_path"]),
    )
    pipe.scheduler.set_timesteps(1000, training=True)
    return pipe


def job_group(name: str, info: dict):
    """A stand-in config group naming the pipeline class (for `pipeline_class`)."""
    return type("Group", (), {"pipeline_class": name})()


def output(pipe, name: str, dit=None) -> torch.Tensor:
    """model_fn on a fixed input (what a LoRA changes), with the pipe's dit or `dit`."""
    torch.manual_seed(0)
    dtype = pipe.torch_dtype
    shape = (1, 16, 1, 4, 4) if name == "WanVideoPipeline" else (1, 16, 4, 4)
    latents = torch.randn(shape).to(dtype)
    if name == "ZImagePipeline":
        cond = {"prompt_embeds": [torch.randn(5, 32).to(dtype)]}
    elif name == "QwenImagePipeline":
        cond = {"prompt_emb": torch.randn(1, 5, 32).to(dtype), "height": 32, "width": 32}
        cond["prompt_emb_mask"] = torch.ones(1, 5, dtype=torch.long)
    else:
        cond = {"context": torch.randn(1, 5, 32).to(dtype)}
    timestep = torch.tensor([500.0]).to(dtype)
    with torch.no_grad():
        dit = pipe.dit if dit is None else dit
        return pipe.model_fn(dit, latents=latents, timestep=timestep, **cond).float()


@contextlib.contextmanager
def registered(infos: list[dict]) -> Iterator[None]:
    """The tiny models of `infos` (write_tiny_models' answers) in DiffSynth's MODEL_CONFIGS
    (hash computed from each file), taken out again after."""
    added = []
    for info in infos:
        for entry in info["register_models"]:
            fields = {k: v for k, v in entry.items() if k != "path"}
            added.append({"model_hash": hash_model_file(entry["path"]), **fields})
    MODEL_CONFIGS.extend(added)
    try:
        yield
    finally:
        for entry in added:
            MODEL_CONFIGS.remove(entry)
