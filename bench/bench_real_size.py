"""Stage 2 at SD 1.5's real size through the real launcher: the rank's peak RSS over the UNet
file's bytes for the memory levers side by side, in one run.

Run: .venv/bin/python bench/bench_real_size.py [--steps 3] [--cases "default,nf4 + ckpt"]
[--repeat 2]

Builds once, under runs/bench/real_size/sd15 (never committed, nothing downloaded), a diffusers
folder with SD 1.5's real configs and random weights: the UNet (859.5M parameters, a 3.44 GB
fp32 file), the CLIP ViT-L text encoder (123M) and the VAE (84M); the tokenizer and scheduler of
the tiny test folder. Four captioned 256 px images go through stage 1 (one worker, a fresh
cache each run: its peak against its resident memory before the models and the models' bytes,
from the preprocess report). Each case then trains LoRA rank 4 on the UNet, 256 px, batch 1,
`--steps` updates, one CPU rank (1 torch thread), through the real launcher
(`splitstage.tasks.launch.launcher.train`, the road of `splitstage train`). Printed per case:
the rank's peak RSS (VmHWM, file-mapped pages included) over the UNet file's bytes, the RSS
after imports, and the mean update time after the first. The case "default without
MALLOC_MMAP_THRESHOLD_" runs the ranks as the launcher started them before it set that variable
(the trainer then fixes glibc's threshold at 128 KiB after imports, `steady_heap`): beside
"default" it measures what the launcher's 1 MiB threshold costs or saves per update; `--repeat`
alternates the cases to pair them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORK = Path("runs/bench/real_size")
FOLDER = WORK / "sd15"
UNET_FILE = FOLDER / "unet" / "diffusion_pytorch_model.safetensors"
CKPT = {"gradient_checkpointing": True}
BF16 = {"weight_dtype": "bf16", "mixed_precision": "bf16"}
NO_THRESHOLD = "default without MALLOC_MMAP_THRESHOLD_"  # the launcher's ranks before they got one
CASES = {
    "default": {},
    NO_THRESHOLD: {},
    "bf16 base + ckpt": BF16 | CKPT,
    "int8 + ckpt": BF16 | CKPT | {"base_quantization": "int8"},
    "nf4 + ckpt": BF16 | CKPT | {"base_quantization": "nf4"},
    "unsplit default": {"mode": "unsplit"},
    "unsplit bf16 base + ckpt": BF16 | CKPT | {"mode": "unsplit"},
}


def write_folder() -> None:
    """SD 1.5's real UNet, text encoder and VAE configs with random weights, as a Hub folder."""
    if (FOLDER / "model_index.json").is_file():
        return
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from tests.helpers.tiny_diffusers import clip_vocab, write_tiny_folder

    partial = FOLDER.with_name("sd15.partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_tiny_folder("sd", partial)  # tokenizer, scheduler, model_index.json
    torch.manual_seed(0)
    ids = len(clip_vocab())
    text = CLIPTextConfig(
        vocab_size=49408,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        projection_dim=768,
        bos_token_id=ids - 2,
        eos_token_id=ids - 1,
        pad_token_id=ids - 1,
    )
    parts = {
        "unet": lambda: UNet2DConditionModel(sample_size=64, cross_attention_dim=768),
        "text_encoder": lambda: CLIPTextModel(text),
        "vae": lambda: AutoencoderKL(
            block_out_channels=(128, 256, 512, 512),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=2,
            latent_channels=4,
            sample_size=512,
        ),
    }
    for name, build in parts.items():
        shutil.rmtree(partial / name)
        model = build()
        model.save_pretrained(partial / name, safe_serialization=True, max_shard_size="10GB")
        del model
    os.replace(partial, FOLDER)


def job(case: dict, steps: int, cache: str = "cache"):
    """The case's config: LoRA rank 4 on the real-size UNet, 256 px, batch 1."""
    from splitstage.config.job import config_from_dict

    train = {"batch_size": 1, "max_steps": steps, "log_every": 1, "checkpoint_every": 10_000}
    return config_from_dict(
        {
            "job": {"name": "real-size", "seed": 0},
            "pipeline": {"name": "sd", "pretrained": str(FOLDER), "resolution": 256},
            "trainable": {"lora_base_model": "unet", "lora_rank": 4},
            "data": {"base_path": str(WORK / "data")},
            "cache": {"url": str(WORK / cache)},
            "train": train | case,
            "output": {"url": str(WORK / "out")},
        }
    )


def stage1(cache: str) -> dict:
    """Stage 1 over the images in a child process (one worker) into `cache`: its memory record
    (MiB: resident before the models, the models' bytes, the peak)."""
    if not (WORK / "data").is_dir():
        from splitstage.data.digits import write_digits_dataset

        write_digits_dataset(WORK / "data", limit=4, size=256)
    shutil.rmtree(WORK / cache, ignore_errors=True)
    command = [sys.executable, __file__, "--preprocess", cache]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    line = next(x for x in done.stdout.splitlines() if x.startswith("MEMORY "))
    return json.loads(line.removeprefix("MEMORY "))


@contextlib.contextmanager
def without_threshold(on: bool):
    """While `on`, the launcher hands its ranks no MALLOC_MMAP_THRESHOLD_."""
    from splitstage.tasks.launch import launcher

    made = launcher.torchrun_spec

    def without(*args, **kwargs):
        spec = made(*args, **kwargs)
        spec.env.pop("MALLOC_MMAP_THRESHOLD_", None)
        return spec

    launcher.torchrun_spec = without if on else made
    try:
        yield
    finally:
        launcher.torchrun_spec = made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="LoRA updates per case")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of the cases, alternated")
    parser.add_argument("--preprocess", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.preprocess:
        from splitstage.tasks.stage1.preprocess import preprocess

        report = preprocess(job({}, 1, cache=args.preprocess), workers=1, progress=False)
        print("MEMORY " + json.dumps(report.memory))
        return
    write_folder()
    memory = stage1("cache-stage1-check")
    if not (WORK / "cache").is_dir():
        stage1("cache")
    from splitstage.tasks.launch.launcher import train

    file_gb = UNET_FILE.stat().st_size / 2**30
    print(f"UNet file: {file_gb:.2f} GiB; 256 px, batch 1, LoRA rank 4, {args.steps} updates")
    above = memory["peak_rss_mb"] - memory["before_models_mb"]
    print(
        f"stage 1 (one worker, fp32): peak {memory['peak_rss_mb'] / 1024:.2f} GiB = resident "
        f"before the models {memory['before_models_mb'] / 1024:.2f} GiB + "
        f"{above / memory['models_mb']:.2f}x the models' {memory['models_mb'] / 1024:.2f} GiB"
    )
    print(f"{'case':<28} {'peak/file':>9} {'peak GiB':>9} {'after imports':>13} {'s/update':>9}")
    env = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for name in args.cases.split(",") * args.repeat:
        shutil.rmtree(WORK / "out", ignore_errors=True)
        shutil.rmtree(WORK / "runs", ignore_errors=True)
        started = time.perf_counter()
        with without_threshold(name == NO_THRESHOLD):
            report = train(job(CASES[name], args.steps), run_root=WORK / "runs", env=env)
        peak = report.peak_rss_mb / 1024
        later = report.step_seconds[1:] or report.step_seconds
        print(
            f"{name:<28} {peak / file_gb:>9.2f} {peak:>9.2f} {report.baseline_rss_mb / 1024:>13.2f}"
            f" {sum(later) / len(later):>9.2f}   ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
