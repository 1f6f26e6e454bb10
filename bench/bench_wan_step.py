"""Stage-2 step time of the wan family at 33 frames, split vs unsplit, side by side in one run
(tiny Wan 2.1 folder, real short h264 clips written with PyAV, CPU, 1 rank, real torchrun jobs),
and the cache bytes per clip.

Run: .venv/bin/python bench/bench_wan_step.py [--updates 12] [--clips 4] [--frames 33]

Split trains from the cache (UMT5 embeddings and each clip's VAE latent distribution, computed
once in stage 1); unsplit decodes every clip and runs UMT5 and the 3D VAE encoder every step. The
tiny transformer costs about what the tiny VAE does, so the ratio understates what a real Wan
saves (there the VAE encode of 33 frames and the UMT5-XXL pass dominate a LoRA step's inputs);
the losses must be equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
SIDE = 64


def workspace(root: Path, clips: int, frames: int) -> Path:
    """`clips` videos of frames + 8 frames, captioned in metadata.jsonl, and a tiny Wan folder."""
    from tests.helpers.tiny_diffusers import write_tiny_folder
    from tests.helpers.video_files import write_video

    rows = []
    for index in range(clips):
        name = f"clips/clip{index}.mp4"
        write_video(root / "data" / name, frames + 8, rate=16)
        rows.append({"video": name, "prompt": f"clip {index} of moving squares"})
    text = "".join(json.dumps(row) + "\n" for row in rows)
    (root / "data" / "metadata.jsonl").write_text(text, encoding="utf-8")
    write_tiny_folder("wan", root / "wan")
    return root


def job(root: Path, mode: str, updates: int, frames: int):
    """A LoRA job on the tiny folder, split or unsplit."""
    from splitstage.config.job import config_from_dict

    wan = {"name": "wan", "pretrained": str(root / "wan"), "resolution": SIDE}
    wan |= {"precision": "fp32", "max_prompt_length": 32}
    train = {"mode": mode, "batch_size": 1, "max_steps": updates}
    return config_from_dict(
        {
            "job": {"name": f"wan-{mode}", "seed": 3},
            "pipeline": wan,
            "trainable": {"lora_base_model": "transformer", "lora_rank": 4},
            "data": {"base_path": str(root / "data"), "video": {"num_frames": frames}},
            "cache": {"url": str(root / "cache")},
            "train": train | {"epochs": updates, "log_every": updates},
            "output": {"url": str(root / "out")},
            "tracking": {"report_to": "none"},
        }
    )


def cache_bytes_per_clip(root: Path, clips: int) -> float:
    """Shard bytes of the cache over the clips it holds."""
    shards = list((root / "cache").rglob("shards/*.safetensors"))
    return sum(path.stat().st_size for path in shards) / clips


def real_wan_bytes(frames: int = 81, height: int = 480, width: int = 832) -> float:
    """What a Wan 2.1 clip caches in bf16, from the shapes alone: the latent mean and log-variance
    [16, (frames - 1) / 4 + 1, H/8, W/8] and the UMT5 embeddings [512, 4096] (the empty
    prompt's are stored once per shard)."""
    latent = 16 * ((frames - 1) // 4 + 1) * (height // 8) * (width // 8)
    return 2 * (2 * latent + 512 * 4096)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=12)
    parser.add_argument("--clips", type=int, default=4)
    parser.add_argument("--frames", type=int, default=33)
    args = parser.parse_args(argv)
    import torch

    from splitstage.tasks.launch.launcher import train
    from splitstage.tasks.stage1.preprocess import preprocess

    torch.set_num_threads(1)
    root = workspace(Path(tempfile.mkdtemp(prefix="bench-wan-")), args.clips, args.frames)
    preprocess(job(root, "split", args.updates, args.frames), workers=1, progress=False)
    figures = {}
    for mode in ("split", "unsplit"):
        config = job(root, mode, args.updates, args.frames)
        report = train(config, run_root=root / "runs", env=ENV)
        figures[mode] = (statistics.median(report.step_seconds[2:]), report.losses)
    (split, split_losses), (unsplit, unsplit_losses) = figures["split"], figures["unsplit"]
    equal = all(
        abs(a - b) <= 1e-5 * max(1.0, abs(a))
        for a, b in zip(split_losses, unsplit_losses, strict=True)
    )
    ratio = split / unsplit
    tiny = cache_bytes_per_clip(root, args.clips)
    real = real_wan_bytes()
    print(f"stage-2 step at {args.frames} frames {SIDE}x{SIDE}: split {split:.3f} s, unsplit "
          f"{unsplit:.3f} s, ratio {ratio:.2f}")  # fmt: skip
    print(f"losses equal (rel 1e-5): {equal}")
    print(f"cache per clip: tiny {tiny / 1e3:.1f} kB; Wan 2.1 at 81x480x832 bf16 (computed "
          f"from shapes): {real / 1e6:.1f} MB")  # fmt: skip
    return {"split_s": split, "unsplit_s": unsplit, "ratio": ratio, "equal": equal}


if __name__ == "__main__":
    main()
