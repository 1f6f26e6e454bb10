"""Stage-2 step time split vs unsplit for the reference-image families (wan_i2v, qwenimage_edit),
side by side in one run, and the cache bytes per sample computed from the real models' shapes.

Run: .venv/bin/python bench/bench_reference_families.py [--quick] [--rounds 5] [--scale 16]

In one process, one thread, fp32, LoRA rank 4, on one batch, interleaved (split, unsplit, alone,
...), medians after warm-up (bench_families.py's `Steps`):
  split    stage 2: the V2 outputs (prompts, latents, CLIP image embeddings, condition latents /
           reference latents) computed once; V1 units + denoiser fwd/bwd + AdamW
  unsplit  decode the clips / images and references, every unit, denoiser fwd/bwd + AdamW
  alone    the denoiser fwd/bwd + AdamW on one prepared step's inputs
Cases: `wan_i2v` and `qwenimage_edit` on the tests' tiny folders (64 px; 5-frame clips), and
`wan_i2v` at Wan 2.1 I2V 14B's proportions: real depths and head counts (transformer 40 blocks,
UMT5-XXL 24 layers, CLIP ViT-H/14 32 layers at 224 px), every width / --scale, 128 px 9-frame
clips. Wan I2V always takes 512 prompt tokens + 257 CLIP tokens (its attention splits the context
at 512), so at 128 px its context is larger against the video tokens than at 480x832x81.
Goal: split / unsplit < 1 for every case.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

QUIET = {"TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
for _name, _value in {**QUIET, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1"}.items():
    os.environ.setdefault(_name, _value)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_families import Steps, timed  # noqa: E402

from splitstage.config.job import config_from_dict  # noqa: E402
from tests.helpers.tiny_diffusers import t5_tokenizer, write_tiny_folder  # noqa: E402

WORK = Path("runs/bench/reference_families")
BF16 = 2  # bytes per cached element at the real models' precision

# Wan 2.1 I2V 14B 480p (Wan-AI/Wan2.1-I2V-14B-480P-Diffusers configs).
WAN_I2V_14B = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=36,
    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=1280,
    added_kv_proj_dim=5120, rope_max_seq_len=1024,
)  # fmt: skip
UMT5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
CLIP_H14 = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32)
CLIP_H14 |= dict(num_attention_heads=16, image_size=224, patch_size=14, projection_dim=1024)
WAN_VAE_STATS = dict(
    latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                  0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    latents_std=[2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                 3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160],
)  # fmt: skip
TRANSFORMER_WIDTHS = ("attention_head_dim", "text_dim", "ffn_dim", "image_dim", "added_kv_proj_dim")


def wan_i2v_real_bytes(frames: int = 81, height: int = 480, width: int = 832) -> dict[str, int]:
    """Bytes each cached param of one Wan 2.1 I2V sample holds in bf16, from the shapes alone
    (the empty prompt's embeddings are stored once per shard, not per sample)."""
    latent = 16 * ((frames - 1) // 4 + 1) * (height // 8) * (width // 8)
    return {
        "latent_mean": BF16 * latent,
        "latent_logvar": BF16 * latent,
        "condition_latents": BF16 * latent * (16 + 4) // 16,  # 4 mask channels + 16
        "image_embeds": BF16 * 257 * 1280,  # CLIP ViT-H/14 penultimate states at 224 px
        "prompt_embeds": BF16 * 512 * 4096,  # UMT5-XXL, padded to 512
    }


def write_clips(data: Path, count: int, frames: int) -> None:
    """`count` h264 clips of `frames` + 4 frames, the second with an edit_image, captioned."""
    from PIL import Image

    from tests.helpers.video_files import write_video

    rows = []
    for index in range(count):
        name = f"clips/clip{index}.mp4"
        write_video(data / name, frames + 4, rate=16)
        rows.append({"video": name, "prompt": f"clip {index} of moving squares"})
    Image.new("RGB", (80, 48), (200, 90, 30)).save(data / "first.png")
    rows[min(1, count - 1)]["edit_image"] = "first.png"
    text = "".join(json.dumps(row) + "\n" for row in rows)
    (data / "metadata.jsonl").write_text(text, encoding="utf-8")


def write_wan_i2v_folder(folder: Path, factor: int) -> None:
    """Wan 2.1 I2V 14B's components with every width / factor (real depths and heads), saved as
    a WanImageToVideoPipeline folder (image processor named as the Hub names it)."""
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanImageToVideoPipeline,
        WanTransformer3DModel,
    )
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        CLIPVisionModel,
        UMT5Config,
        UMT5EncoderModel,
    )

    torch.manual_seed(0)
    transformer = dict(WAN_I2V_14B)
    for key in TRANSFORMER_WIDTHS:
        transformer[key] //= factor
    tokenizer = t5_tokenizer()
    umt5 = {k: v // factor if k in ("d_model", "d_kv", "d_ff") else v for k, v in UMT5_XXL.items()}
    widths = ("hidden_size", "intermediate_size")
    clip = {k: v // factor if k in widths else v for k, v in CLIP_H14.items()}
    clip["hidden_size"] -= clip["hidden_size"] % clip["num_attention_heads"]  # whole heads
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=UMT5EncoderModel(
            UMT5Config(vocab_size=len(tokenizer), feed_forward_proj="gated-gelu", **umt5)
        ),
        vae=AutoencoderKLWan(base_dim=max(96 // factor, 4), z_dim=16, **WAN_VAE_STATS),
        scheduler=UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        ),
        image_processor=CLIPImageProcessorPil(),
        image_encoder=CLIPVisionModel(CLIPVisionConfig(**clip)),
        transformer=WanTransformer3DModel(**transformer),
    )
    shutil.rmtree(folder, ignore_errors=True)
    pipe.save_pretrained(folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))


def wan_i2v_job(folder: Path, data: Path, side: int, frames: int, batch: int):
    """A LoRA job on the folder's transformer over the clips."""
    return config_from_dict({
        "job": {"name": "bench-wan-i2v", "seed": 0},
        "pipeline": {"name": "wan_i2v", "pretrained": str(folder), "resolution": side,
                     "precision": "fp32"},
        "trainable": {"lora_base_model": "transformer", "lora_rank": 4},
        "data": {"base_path": str(data), "video": {"num_frames": frames}},
        "cache": {"url": str(WORK / "cache")}, "output": {"url": str(WORK / "out")},
        "train": {"batch_size": batch, "max_steps": 3},
    })  # fmt: skip


def qwen_edit_job(batch: int):
    """A LoRA job on the tests' tiny QwenImageEditPipeline folder: digits with one reference."""
    from PIL import Image, ImageOps

    from splitstage.data.digits import write_digits_dataset

    data, folder = WORK / "edit-data", WORK / "qwenimage_edit"
    shutil.rmtree(data, ignore_errors=True)
    write_digits_dataset(data, limit=batch, size=32)
    lines = (data / "metadata.csv").read_text().splitlines()
    rows = [lines[0] + ",edit_image"]
    for line in lines[1:]:
        image = line.split(",")[0]
        name = f"ref-{Path(image).stem}.png"
        ImageOps.mirror(Image.open(data / image).convert("RGB").resize((64, 64))).save(data / name)
        rows.append(f"{line},{name}")
    (data / "metadata.csv").write_text("\n".join(rows) + "\n")
    write_tiny_folder("qwenimage_edit", folder)
    pipeline = {"name": "qwenimage_edit", "pretrained": str(folder), "resolution": 64}
    pipeline |= {"precision": "fp32", "max_prompt_length": 96}
    pipeline |= {"reference_max_pixels": 64 * 64, "condition_max_pixels": 56 * 56}
    return config_from_dict({
        "job": {"name": "bench-qwen-edit", "seed": 0}, "pipeline": pipeline,
        "trainable": {"lora_base_model": "transformer", "lora_rank": 4},
        "data": {"base_path": str(data)},
        "cache": {"url": str(WORK / "cache")}, "output": {"url": str(WORK / "out")},
        "train": {"batch_size": batch, "max_steps": 3},
    })  # fmt: skip


def cached_bytes(bench: Steps) -> dict[str, int]:
    """Bytes per sample of each param stage 1 caches for this batch (empty_* left out)."""
    count = len(bench.rows)
    return {
        name: value.numel() * value.element_size() // count
        for name, value in bench.cached.items()
        if torch.is_tensor(value) and not name.startswith("empty_")
    }


def run_case(label: str, config, args) -> dict:
    """Time one case's split, unsplit and alone steps; its V2 units and cached bytes."""
    start = time.perf_counter()
    bench = Steps(config, torch.device("cpu"))
    steps = {"split": bench.split, "unsplit": bench.unsplit, "alone": bench.alone}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.warmup + args.rounds):
        for name, step in steps.items():
            times[name].append(timed(step))
    medians = {name: statistics.median(t[args.warmup :]) for name, t in times.items()}
    result = {"label": label, "family": bench.family.name, **medians}
    result["v2"] = [unit.spec.name for unit in bench.plan.v2_units]
    result["bytes"] = cached_bytes(bench)
    print(f"{label}: V2 {result['v2']}; split {medians['split'] * 1e3:.0f} ms, unsplit "
          f"{medians['unsplit'] * 1e3:.0f} ms, alone {medians['alone'] * 1e3:.0f} ms "
          f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 timed rounds (~7 min)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (after warm-up)")
    parser.add_argument("--scale", type=int, default=None, help="width divisor (default 16)")
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 6)
    args.warmup, args.scale = 1, args.scale or 16  # head dims 8: RoPE's 3 axes need >= 6
    torch.set_num_threads(1)
    WORK.mkdir(parents=True, exist_ok=True)
    results = []

    tiny_data = WORK / "clips-5"
    shutil.rmtree(tiny_data, ignore_errors=True)
    write_clips(tiny_data, args.batch, 5)
    write_tiny_folder("wan_i2v", WORK / "wan_i2v")
    tiny = wan_i2v_job(WORK / "wan_i2v", tiny_data, 64, 5, args.batch)
    results.append(run_case("wan_i2v tiny, 64 px x 5 frames", tiny, args))
    try:
        edit = qwen_edit_job(args.batch)
    except Exception as error:  # noqa: BLE001 - another family's work in progress
        print(f"qwenimage_edit tiny: skipped ({type(error).__name__}: {error})")
    else:
        results.append(run_case("qwenimage_edit tiny, 64 px, one reference", edit, args))

    real_data = WORK / "clips-9"
    shutil.rmtree(real_data, ignore_errors=True)
    write_clips(real_data, args.batch, 9)
    write_wan_i2v_folder(WORK / f"wan_i2v-{args.scale}", args.scale)
    scaled_job = wan_i2v_job(WORK / f"wan_i2v-{args.scale}", real_data, 128, 9, args.batch)
    label = f"wan_i2v 14B proportions / {args.scale}, 128 px x 9 frames"
    results.append(run_case(label, scaled_job, args))

    print(f"\nbatch {args.batch}, median of {args.rounds} rounds, 1 thread, fp32, LoRA rank 4")
    print(f"{'case':52} {'split':>9} {'unsplit':>9} {'ratio':>7} {'goal':>5}  met")
    figures = {}
    for r in results:
        ratio = r["split"] / r["unsplit"]
        figures[f"{r['label']}: split / unsplit"] = ratio
        print(f"{r['label']:52} {r['split'] * 1e3:7.0f}ms {r['unsplit'] * 1e3:7.0f}ms "
              f"{ratio:7.3f} {'< 1':>5}  {'yes' if ratio < 1 else 'NO'}")  # fmt: skip

    real = wan_i2v_real_bytes()
    measured = results[0]["bytes"]
    if set(real) != set(measured):  # a param the formula does not know would be left out
        raise SystemExit(f"cached params {sorted(measured)} != the formula's {sorted(real)}")
    t2v = real["latent_mean"] + real["latent_logvar"] + real["prompt_embeds"]
    print("\ncache per sample, Wan 2.1 I2V 14B at 81 x 480 x 832, bf16 (from the shapes):")
    for name, size in real.items():
        print(f"  {name:20} {size / 1e6:8.2f} MB   (tiny run: {measured[name] / 1e3:.1f} kB)")
    total = sum(real.values())
    print(f"  {'total':20} {total / 1e6:8.2f} MB = {total / t2v:.2f}x Wan 2.1 T2V's "
          f"{t2v / 1e6:.2f} MB")  # fmt: skip
    figures["wan_i2v real cache MB per sample"] = total / 1e6
    return figures


if __name__ == "__main__":
    main()
