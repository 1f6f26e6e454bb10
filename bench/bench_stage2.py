"""Stage 2 vs unsplit training on the demo pipeline, side by side in one run.

Run: .venv/bin/python bench/bench_stage2.py [--samples 256] [--updates 40] [--batch 8]

Builds the digits data set, demo weights and the cache (real MiniLM text encoder), then trains the
DiT's LoRA for the same updates three ways, each a 1-process torchrun job (OMP_NUM_THREADS=1):
  split    reads the cache (local disk), runs V1 + the denoiser
  unsplit  decodes images and runs every unit every step, all models loaded
  s3       split, with the cache on a moto S3 endpoint (loader stall share)
and times the denoiser's own forward+backward+step on in-memory tensors (1 thread).
Goals: split/unsplit step time <= 0.35; split step within 1.15x of the denoiser alone;
split/unsplit peak RSS <= 0.6; loader stall < 5% of step time with the cache on S3.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from demo_job import demo_job  # noqa: E402

from splitstage.data.digits import write_digits_dataset  # noqa: E402
from splitstage.demo import write_demo_weights  # noqa: E402
from splitstage.pipelines.family import family_for  # noqa: E402
from splitstage.tasks.launch.launcher import train  # noqa: E402
from splitstage.tasks.stage1.preprocess import preprocess  # noqa: E402
from splitstage.tasks.stage2.models import add_lora  # noqa: E402

WORK = Path("runs/bench/stage2")
ENV = {"SPLITSTAGE_DEVICE": "cpu"}


def job(name: str, samples: int, updates: int, batch: int, **cache):
    """The benchmark's job config (LoRA on the DiT, real text encoder)."""
    return demo_job(WORK, name, samples, cache, batch_size=batch, max_steps=updates, epochs=1000)


def above(report) -> float:
    """Peak RSS above the worker's post-import baseline: what models and data cost."""
    return report.peak_rss_mb - report.baseline_rss_mb


def steady(step_seconds: list[float]) -> float:
    """Median step time after the first quarter (warm-up)."""
    return statistics.median(step_seconds[len(step_seconds) // 4 :])


def denoiser_alone(config, updates: int, batch: int) -> float:
    """Median forward+backward+step time of the LoRA DiT on in-memory tensors, 1 thread."""
    torch.set_num_threads(1)
    family = family_for(config)
    model = family.build_model(family.denoiser, torch.device("cpu"))
    model = add_lora(model, family)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    latents = torch.randn(batch, 4, 8, 8)
    emb = torch.randn(batch, 16, 384)
    mask = torch.ones(batch, 16, dtype=torch.bool)
    times = []
    for _ in range(updates):
        start = time.perf_counter()
        t = torch.rand(batch)
        loss = torch.nn.functional.mse_loss(model(latents, t, emb, mask), latents)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return steady(times)


def start_s3():
    """A moto S3 endpoint in its own process, with a bucket; returns (server, endpoint)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_cache import start_s3 as start

    return start()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    write_digits_dataset(WORK / "data", limit=args.samples)
    write_demo_weights(WORK / "weights")
    split_cfg = job("bench-split", args.samples, args.updates, args.batch)
    preprocess(split_cfg, workers=1, progress=False)
    quiet = {"env": ENV, "on_line": lambda line: None, "run_root": WORK / "runs"}
    runs = {}
    for name, config in (
        ("split", split_cfg),
        ("unsplit", job("bench-unsplit", args.samples, args.updates, args.batch)),
    ):
        if name == "unsplit":
            config.train.mode = "unsplit"
        runs[name] = train(config, run_id=f"{name}-{time.time_ns()}", **quiet)
    server, options = start_s3()
    try:
        os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = "key", "secret"
        endpoint = options["client_kwargs"]["endpoint_url"]
        s3_cfg = job(
            "bench-s3",
            args.samples,
            args.updates,
            args.batch,
            url="s3://bench/cache",
            storage_options={"endpoint_url": endpoint},
        )
        preprocess(s3_cfg, workers=1, progress=False)
        runs["s3"] = train(s3_cfg, run_id=f"s3-{time.time_ns()}", **quiet)
    finally:
        server.terminate()
    alone = denoiser_alone(split_cfg, args.updates, args.batch)
    split, unsplit, s3 = (steady(runs[k].step_seconds) for k in ("split", "unsplit", "s3"))
    s3_total = sum(runs["s3"].step_seconds)
    figures = {
        "split_step_s": split,
        "unsplit_step_s": unsplit,
        "denoiser_alone_s": alone,
        "step_ratio": split / unsplit,
        "split_vs_denoiser": split / alone,
        "rss_split_mb": runs["split"].peak_rss_mb,
        "rss_unsplit_mb": runs["unsplit"].peak_rss_mb,
        "rss_ratio": runs["split"].peak_rss_mb / runs["unsplit"].peak_rss_mb,
        "rss_above_imports_ratio": above(runs["split"]) / above(runs["unsplit"]),
        "s3_stall_share": runs["s3"].stall_seconds / s3_total,
        "loss_split_first": runs["split"].losses[0],
        "loss_unsplit_first": runs["unsplit"].losses[0],
    }
    rows = [
        (
            "stage-2 step / unsplit step",
            f"{split * 1e3:.1f} ms / {unsplit * 1e3:.1f} ms",
            figures["step_ratio"],
            "<= 0.35",
            figures["step_ratio"] <= 0.35,
        ),
        (
            "stage-2 step / denoiser alone",
            f"{split * 1e3:.1f} ms / {alone * 1e3:.1f} ms",
            figures["split_vs_denoiser"],
            "<= 1.15",
            figures["split_vs_denoiser"] <= 1.15,
        ),
        (
            "peak RSS stage 2 / unsplit",
            f"{figures['rss_split_mb']:.0f} MB / {figures['rss_unsplit_mb']:.0f} MB",
            figures["rss_ratio"],
            "<= 0.6",
            figures["rss_ratio"] <= 0.6,
        ),
        (
            "loader stall share (cache on S3)",
            f"{runs['s3'].stall_seconds:.3f} s of {s3_total:.2f} s",
            figures["s3_stall_share"],
            "< 0.05",
            figures["s3_stall_share"] < 0.05,
        ),
    ]
    print(f"{'figure':36} {'measured':28} {'ratio':>7} {'goal':>8}  met")
    for name, measured, ratio, goal, ok in rows:
        met = "-" if ok is None else ("yes" if ok else "NO")
        print(f"{name:36} {measured:28} {ratio:7.3f} {goal:>8}  {met}")
    print(
        f"first-update loss split {figures['loss_split_first']:.6f} "
        f"unsplit {figures['loss_unsplit_first']:.6f}"
    )
    return figures


if __name__ == "__main__":
    main()
