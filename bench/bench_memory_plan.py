"""The memory plan at SD 1.5's real size: each stage's estimate (models on meta, fake tensors, no
weights read) against the same stage-1 batch and stage-2 micro-step measured on the real models
and tensors by torch's tracker, side by side in one run, per case.

Run: .venv/bin/python bench/bench_memory_plan.py [--size 256] [--cases default,light]

The SD 1.5 folder (UNet 859.5M from bench_real_size_load's builder, CLIP-L text encoder 123M,
the 84M VAE, random weights, the tiny CLIP tokenizer) is written once under
runs/bench/memory_plan/ (never committed, nothing downloaded). Cases: LoRA rank 4 on the UNet at
`--size` px, train batch 1, preprocess batch 2, with the defaults ('default') and with gradient
checkpointing and a bf16 base ('light'). Printed per case and stage: estimate, measured (GiB),
their ratio and the seconds each took.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_real_size_load import FILE, SD15, write_unet  # noqa: E402

WORK = Path("runs/bench/memory_plan")
FOLDER = WORK / "sd15"
CLIP_L = {  # openai/clip-vit-large-patch14's text tower (SD 1.5's text encoder)
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
}
SD_VAE = {  # SD 1.5's AutoencoderKL
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 2,
    "latent_channels": 4,
    "sample_size": 512,
    "scaling_factor": 0.18215,
}
CASES = {
    "default": {},
    "light": {"gradient_checkpointing": True, "weight_dtype": "bf16"},
}


def write_folder() -> Path:
    """The SD 1.5 folder at its real sizes (random weights), written once."""
    if (FOLDER / "model_index.json").is_file():
        return FOLDER
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from tests.helpers.tiny_diffusers import write_tiny_folder

    write_unet()
    tmp = WORK / "sd15.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write_tiny_folder("sd", tmp)
    torch.manual_seed(0)
    CLIPTextModel(CLIPTextConfig(**CLIP_L)).save_pretrained(tmp / "text_encoder")
    AutoencoderKL(**SD_VAE).save_pretrained(tmp / "vae")
    shutil.rmtree(tmp / "unet")
    with torch.device("meta"):
        unet = UNet2DConditionModel(**SD15)
    unet.save_config(tmp / "unet")
    os.link(FILE, tmp / "unet" / "diffusion_pytorch_model.safetensors")  # no second 3.4 GB
    os.replace(tmp, FOLDER)
    return FOLDER


def job(size: int, case: dict) -> dict:
    """A LoRA job on the folder, over a one-image data set."""
    from splitstage.data.digits import write_digits_dataset

    write_digits_dataset(WORK / "data", limit=1, size=size)
    return {
        "job": {"name": "memory-plan-bench"},
        "pipeline": {"name": "sd", "pretrained": str(FOLDER), "resolution": size},
        "trainable": {"lora_base_model": "unet", "lora_rank": 4},
        "data": {"base_path": str(WORK / "data")},
        "cache": {"url": str(WORK / "cache")},
        "preprocess": {"batch_size": 2},
        "train": {"batch_size": 1, "max_steps": 1} | case,
        "output": {"url": str(WORK / "out")},
    }


def one_case(size: int, case: dict) -> dict:
    """Estimate then measure one case in this process."""
    import torch

    from splitstage.config.job import config_from_dict
    from splitstage.tasks.job_plan import make_plan
    from splitstage.tasks.memory.measured_step import measure_memory
    from splitstage.tasks.memory.memory_plan import estimate_memory

    torch.set_num_threads(os.cpu_count() or 1)
    plan = make_plan(config_from_dict(job(size, case)))
    started = time.perf_counter()
    estimated = estimate_memory(plan, torch.device("cpu"))
    estimate_s = time.perf_counter() - started
    started = time.perf_counter()
    measured = measure_memory(plan)
    measure_s = time.perf_counter() - started
    result = {"estimate_s": estimate_s, "measure_s": measure_s}
    for stage in ("stage1", "stage2"):
        result[stage] = {
            "estimate": getattr(estimated, stage).to_dict(),
            "measured": getattr(measured, stage).to_dict(),
        }
    return result


def main() -> None:
    """Write the folder, run each case, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    write_folder()
    print(f"SD 1.5 at its real size, {args.size} px, LoRA rank 4 on the UNet (GiB per process)")
    print(f"{'case':<10} {'stage':<7} {'estimate':>9} {'measured':>9} {'ratio':>6}")
    for name in args.cases.split(","):
        result = one_case(args.size, CASES[name])
        for stage in ("stage1", "stage2"):
            guess = result[stage]["estimate"]["peak_bytes"]
            real = result[stage]["measured"]["peak_bytes"]
            gib = f"{guess / 2**30:9.3f} {real / 2**30:9.3f}"
            print(f"{name:<10} {stage:<7} {gib} {guess / real:6.3f}")
        print(
            f"{name:<10} parts: {json.dumps(result['stage2']['estimate']['parts'])} "
            f"(estimate {result['estimate_s']:.1f} s, measured {result['measure_s']:.1f} s)"
        )


if __name__ == "__main__":
    main()
