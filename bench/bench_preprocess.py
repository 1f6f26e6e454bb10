"""Stage 1 on the demo pipeline: 2 workers vs 1, and real cache bytes vs DiffSynth's torch.save.

Run: .venv/bin/python bench/bench_preprocess.py [--samples 512]

(a) wall time of `preprocess` with 1 worker (all cores) and with 2 worker processes, each into a
    fresh cache, real MiniLM text encoder. Goal: speed-up >= 1.6x.
(b) cache bytes per sample (shards + index) vs `torch.save` of each sample's whole inputs dict
    after V2 (what DiffSynth's data_process task writes). Goal: ratio <= 0.5.
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipelines import demo  # noqa: E402
from pipelines.config import config_from_dict  # noqa: E402
from pipelines.data import load_sample  # noqa: E402
from pipelines.digits import write_digits_dataset  # noqa: E402
from pipelines.models import build_demo_weights  # noqa: E402
from pipelines.runtime import StepContext, run_units  # noqa: E402
from tasks.job_plan import make_plan  # noqa: E402
from tasks.preprocess import collate_samples, index_data_set, open_cache, preprocess  # noqa: E402

WORK = Path("runs/bench/preprocess")


def job(cache: str, samples: int):
    """LoRA on the DiT: V2 = shape check, prompt embedding (MiniLM), image encoding (VAE)."""
    return config_from_dict(
        {
            "models": {
                "vae": {"weights": str(WORK / "weights/vae.safetensors")},
                "dit": {"weights": str(WORK / "weights/dit.safetensors")},
                "text_encoder": {"builder": "minilm"},
            },
            "trainable": {"lora_base_model": "dit"},
            "data": {"base_path": str(WORK / "data"), "limit": samples},
            "cache": {"url": str(WORK / cache), "shard_samples": 256},
            "preprocess": {"batch_size": 32},
        }
    )


def torch_save_bytes(config, count: int = 16) -> float:
    """Mean bytes of torch.save(inputs dict after V2) per sample, DiffSynth's cache format."""
    plan = make_plan(config)
    data = index_data_set(config)
    device = torch.device("cpu")
    models = {m: demo.build_model(config, m, device) for m in plan.split.models["stage1"]}
    ctx = StepContext(models=models, device=device, settings=demo.settings(config))
    total = 0
    with torch.no_grad():
        for row in data.rows[:count]:
            sample = load_sample(row, config.data.base_path, config.pipeline.image_size)
            inputs = run_units(plan.v2_units, ctx, collate_samples([sample]))
            buffer = io.BytesIO()
            torch.save(inputs, buffer)
            total += buffer.tell()
    return total / count


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    args = parser.parse_args(argv)
    write_digits_dataset(WORK / "data", limit=args.samples)
    build_demo_weights(WORK / "weights")
    times = {}
    for workers in (1, 2):
        cache = f"cache-{workers}"
        shutil.rmtree(WORK / cache, ignore_errors=True)
        config = job(cache, args.samples)
        start = time.perf_counter()
        report = preprocess(config, workers=workers, progress=False)
        times[workers] = time.perf_counter() - start
        assert report.computed == args.samples, report
    config = job("cache-1", args.samples)
    stats = open_cache(config, make_plan(config)).stats()
    ours = stats.bytes / stats.samples
    theirs = torch_save_bytes(config)
    figures = {
        "one_worker_s": times[1],
        "two_workers_s": times[2],
        "speedup": times[1] / times[2],
        "cache_bytes_per_sample": ours,
        "torch_save_bytes_per_sample": theirs,
        "bytes_ratio": ours / theirs,
    }
    print(f"{'figure':34} {'measured':30} {'ratio':>7} {'goal':>8}  met")
    rows = [
        (
            "preprocess 2 workers vs 1",
            f"{times[2]:.1f} s vs {times[1]:.1f} s",
            figures["speedup"],
            ">= 1.6",
            figures["speedup"] >= 1.6,
        ),
        (
            "cache bytes/sample vs torch.save",
            f"{ours / 1e3:.1f} kB vs {theirs / 1e3:.1f} kB",
            figures["bytes_ratio"],
            "<= 0.5",
            figures["bytes_ratio"] <= 0.5,
        ),
    ]
    for name, measured, ratio, goal, ok in rows:
        print(f"{name:34} {measured:30} {ratio:7.3f} {goal:>8}  {'yes' if ok else 'NO'}")
    return figures


if __name__ == "__main__":
    main()
