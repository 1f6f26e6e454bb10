"""Every benchmark of the project in one run, then one table of figures and goals.

Run: make bench   (or .venv/bin/python bench/run_all.py [--quick])
Each benchmark also runs alone (see its docstring). Ratios are measured side by side within each
benchmark, since this machine is noisy; absolute times are for orientation only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))


def run(name: str, argv: list[str]):
    """Import bench/<name>.py and run its main(argv); return what it returns."""
    print(f"\n=== {name} {' '.join(argv)}", flush=True)
    module = importlib.import_module(name)
    result = module.main(argv)
    return getattr(module, "FIGURES", None) if isinstance(result, int) else result


def run_alone(name: str, argv: list[str], results: str) -> dict:
    """Run bench/<name>.py in its own process from the repository root (for a benchmark whose
    main() reads sys.argv and writes its figures to a file) and return the JSON at `results`."""
    print(f"\n=== {name} {' '.join(argv)}", flush=True)
    subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *argv], cwd=ROOT, check=True)
    return json.loads((ROOT / results).read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a few minutes)")
    args = parser.parse_args(argv)
    q = args.quick
    table = []
    split = run("bench_split", ["--sizes", "1000,10000" if q else "1000,10000,100000"])
    at_10k = next(r for r in split if r["units"] == 10000 and r["shape"] == "chain")
    table.append(("splitter speed-up vs seed, 10k units (chain)", at_10k["ratio"], ">= 50"))
    cache = run("bench_cache", ["--rounds", "2" if q else "5"])
    table.append(("cache bytes/sample vs torch.save (synthetic)", cache["bytes_ratio"], "<= 0.5"))
    linked = "link_stage1_write_ratio" in cache  # the goal is judged link-bound when measured
    table.append(
        (
            "S3 write: stage-1 writer vs raw puts (CPU-bound)",
            cache["stage1_write_ratio"],
            "info" if linked else ">= 0.9",
        )
    )
    if linked:
        table.append(
            (
                "S3 write: stage-1 writer vs raw puts (link-bound)",
                cache["link_stage1_write_ratio"],
                ">= 0.9",
            )
        )
    listing = run("bench_listing", ["--rounds", "1" if q else "3"])
    table.append(
        ("S3 flat listing: key ranges / one chain (moto)", listing["cpu_bound_ratio"], "info")
    )
    table.append(
        (
            "S3 flat listing: key ranges / one chain, 100 ms/request",
            listing["latency_bound_ratio"],
            "< 1",
        )
    )
    prep = run("bench_preprocess", ["--samples", "256" if q else "1024"])
    table.append(("cache bytes/sample vs torch.save (demo)", prep["bytes_ratio"], "<= 0.5"))
    table.append(("preprocess speed-up, 2 workers vs 1", prep["speedup"], ">= 1.6"))
    stage2 = run("bench_stage2", ["--updates", "20" if q else "40"])
    table.append(("stage-2 step / unsplit step", stage2["step_ratio"], "<= 0.35"))
    table.append(("stage-2 step / denoiser alone", stage2["split_vs_denoiser"], "<= 1.15"))
    table.append(("stage-2 peak RSS / unsplit", stage2["rss_ratio"], "<= 0.6"))
    table.append(("loader stall share, cache on S3", stage2["s3_stall_share"], "< 0.05"))
    families = run("bench_families", ["--quick"] if q else [])
    for kind in ("sd", "sdxl", "sd3", "flux"):
        ratio, vs_denoiser = families[f"{kind}_step_ratio"], families[f"{kind}_split_vs_denoiser"]
        table.append((f"{kind}: stage-2 step / unsplit step", ratio, "< 1"))
        table.append((f"{kind}: stage-2 step / denoiser alone", vs_denoiser, "<= 1.15"))
    distill = run("bench_direct_distill", ["--updates", "12", "--rows", "4"] if q else [])
    table.append(("direct_distill (flux): stage-2 step / unsplit step", distill["ratio"], "info"))
    table.append(("direct_distill (flux): split losses = unsplit", float(distill["equal"]), ">= 1"))
    memory = run_alone(
        "bench_train_memory", ["--steps", "1"] if q else [], "runs/bench/train_memory/results.json"
    )
    off, on = memory["fp32 base, no checkpointing"], memory["fp32 base, checkpointing"]
    bf16, peak = memory["bf16 base, no checkpointing"], "peak_above_baseline_mb"
    for name, value, goal in (
        ("checkpointing on/off peak, fp32 base", on[peak] / off[peak], "<= 0.5"),
        ("checkpointing on/off step time, fp32 base", on["step_s"] / off["step_s"], "info"),
        ("frozen base bytes, bf16 / fp32", bf16["frozen_mb"] / off["frozen_mb"], "<= 0.5"),
        ("peak, bf16 / fp32 base", bf16[peak] / off[peak], "info"),
    ):
        table.append((f"FLUX-shaped LoRA step: {name}", value, goal))
    e2e = run("bench_end_to_end", ["--epochs", "3" if q else "10"])
    table.append(
        (f"end to end split / unsplit wall, {3 if q else 10} epochs", e2e["ratio"], "<= 0.45")
    )
    quality = run("bench_demo_quality", ["--quick"] if q else [])
    table.append(("demo samples labelled as prompted, split", quality["split_acc"], ">= 0.8"))
    table.append(("demo samples split - unsplit, |d| / SE", quality["diff_over_se"], "<= 2"))
    table.append(("demo time to 80% labelled: split / unsplit", quality["ratio_80"], "< 1"))
    try:
        orchestration = run("bench_orchestration", ["--limit", "300" if q else "600"])
        table.append(
            ("Prefect overhead, share of demo wall time", orchestration["overhead_share"], "info")
        )
    except (ImportError, KeyError, TypeError) as error:
        table.append((f"Prefect overhead (not measured: {error})", float("nan"), "info"))
    print("\n| figure | measured | goal | met |\n|---|---|---|---|")
    for name, value, goal in table:
        met = "-" if goal == "info" else ("yes" if _meets(value, goal) else "NO")
        print(f"| {name} | {value:.3f} | {goal} | {met} |")
    return 0


def _meets(value: float, goal: str) -> bool:
    op, number = goal.split()
    target = float(number)
    return {"<=": value <= target, ">=": value >= target, "<": value < target}[op]


if __name__ == "__main__":
    sys.exit(main())
