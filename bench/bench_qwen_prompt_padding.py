"""Qwen-Image-Edit's prompts cached at their own length vs padded to max_prompt_length: the cache
bytes per sample and the stage-2 step time, side by side in one run.

Run: .venv/bin/python bench/bench_qwen_prompt_padding.py [--quick] [--rounds 5] [--scale 16]
     [--side 256] [--batch 2]

The model is bench_reference_families.py's Qwen-Image-Edit-2509 at its real proportions (real
depths and head counts, widths / --scale: the MMDiT's 60 blocks, Qwen2.5-VL-7B's text width 3584
-> 224), a QwenImageEditPlusPipeline folder; digits at `--side` px, one reference each at `--side`²
for the VAE and 48² for Qwen2.5-VL (4 vision tokens). max_prompt_length keeps the real ratio of
the default 2048 text tokens to a 1024 px target's and reference's 2 x 4096 image tokens (at 256
px: 512 image tokens, so 128). The tiny writer's byte-level tokenizer gives each prompt ~50
tokens: about 40% of the padded length, where a real prompt with its references (~300-600 of
2048) is 15-30%, so the measured savings understate the real ones.
In one process, one thread, fp32, LoRA rank 4, on one batch, interleaved (trimmed, padded, ...),
medians after warm-up (bench_families.py's `Steps`):
  trimmed  stage 2 on the batch as the cache now gives it: prompts padded to the batch's longest
  padded   the same batch with every prompt (and the empty one) padded to max_prompt_length, as
           stage 1 cached it before
The cache bytes are what stage 1 stores per sample for the prompt params (prompt, empty prompt,
masks) in this run (fp32), and from the shapes at the real width (3584, bf16).
"""

from __future__ import annotations

import argparse
import os
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
from bench_reference_families import WORK, qwen_edit_job, write_qwen_edit_plus_folder  # noqa: E402

from splitstage.pipelines.runtime import split_batch  # noqa: E402

REAL_WIDTH = 3584  # Qwen2.5-VL-7B's hidden size: the prompt embeddings' width
REAL_LENGTH = 2048  # the qwenimage_edit family's default max_prompt_length
REAL_IMAGE_TOKENS = 2 * (1024 // 16) ** 2  # a 1024 px target and one 1024² reference, packed
BF16, MASK = 2, 8  # bytes per cached embedding element (real precision) and per mask element


def padded_to(cached: dict, sequences: dict, length: int) -> dict:
    """The batch with every sequence param (and mask) zero-padded along dim 1 to `length`."""
    out = dict(cached)
    for name in (*sequences, *filter(None, sequences.values())):
        value = cached[name]
        tail = value.new_zeros(value.shape[0], length - value.shape[1], *value.shape[2:])
        out[name] = torch.cat([value, tail], dim=1)
    return out


def prompt_bytes(cached: dict, sequences: dict, count: int, trim: bool) -> float:
    """Mean bytes per sample stage 1 stores for the sequence params (trimmed or as given)."""
    names = [*sequences, *filter(None, sequences.values())]
    samples = split_batch(cached, names, count, sequences if trim else None)
    return statistics.mean(sum(s[n].numel() * s[n].element_size() for n in names) for s in samples)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 timed rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (after warm-up)")
    parser.add_argument("--scale", type=int, default=16, help="width divisor (default 16)")
    parser.add_argument("--side", type=int, default=256, help="target and reference px")
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 6)
    torch.set_num_threads(1)
    WORK.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    folder = WORK / f"qwenimage_edit_plus-{args.scale}"
    write_qwen_edit_plus_folder(folder, args.scale)
    image_tokens = 2 * (args.side // 16) ** 2
    length = round(REAL_LENGTH * image_tokens / REAL_IMAGE_TOKENS)
    config = qwen_edit_job(args.batch, folder, args.side, args.side, 48, length)
    bench = Steps(config, torch.device("cpu"))
    sequences = dict(bench.family.sequence_params)
    trimmed = dict(bench.cached)
    padded = padded_to(trimmed, sequences, length)
    counts = trimmed["prompt_embeds_mask"].sum(dim=1).tolist()
    empty = trimmed["empty_prompt_embeds_mask"].sum(dim=1).tolist()
    longest = trimmed["prompt_embeds"].shape[1]
    print(f"built and encoded in {time.perf_counter() - start:.0f} s; image tokens "
          f"{image_tokens} per sample, prompt tokens {counts} (empty prompt {empty}), batch "
          f"padded to {longest} (trimmed) or {length} (padded)", flush=True)  # fmt: skip

    variants = {"trimmed": trimmed, "padded": padded}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(1 + rounds):
        for name, cached in variants.items():
            bench.cached = cached
            times[name].append(timed(bench.split))
    step = {name: statistics.median(t[1:]) for name, t in times.items()}
    size = {
        "trimmed": prompt_bytes(trimmed, sequences, args.batch, trim=True),
        "padded": prompt_bytes(padded, sequences, args.batch, trim=False),
    }
    tokens = {"trimmed": statistics.mean(counts) + statistics.mean(empty), "padded": 2 * length}
    real = {name: n * (REAL_WIDTH * BF16 + MASK) for name, n in tokens.items()}
    real_padded = 2 * REAL_LENGTH * (REAL_WIDTH * BF16 + MASK)

    print(
        f"\nqwenimage_edit 2509 proportions / {args.scale}, {args.side} px, one reference, "
        f"batch {args.batch}, median of {rounds} rounds, 1 thread, fp32, LoRA rank 4"
    )
    print(f"{'figure':52} {'trimmed':>12} {'padded':>12} {'ratio':>7}")
    rows = (
        ("stage-2 step (ms)", step, 1e3),
        ("prompt cache per sample, this run (kB, fp32)", size, 1e-3),
        ("same tokens at width 3584, bf16 (MB per sample)", real, 1e-6),
    )
    figures = {}
    for label, values, unit in rows:
        mine, theirs = values["trimmed"] * unit, values["padded"] * unit
        print(f"{label:52} {mine:12.1f} {theirs:12.1f} {mine / theirs:7.3f}")
        figures[label] = mine / theirs
    print(f"(at the real default, 2048 tokens padded: {real_padded / 1e6:.1f} MB per sample; a "
          f"real prompt with its references, ~300-600 tokens, is 15-30% of it)")  # fmt: skip
    return figures


if __name__ == "__main__":
    main()
