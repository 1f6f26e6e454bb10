"""Stage-2 memory and step time of a FLUX-shaped transformer: gradient checkpointing on vs off,
frozen base in bf16 vs fp32 (train.gradient_checkpointing, train.weight_dtype), side by side.

Run: .venv/bin/python bench/bench_train_memory.py [--size 512] [--batch 2] [--steps 2]

A tiny FLUX folder (tests.helpers.tiny_diffusers) whose transformer is replaced by a wider one
(hidden 256: 4 heads of 64, 2 double + 10 single blocks, ~15M parameters) so that at 512 px
(64x64 latents, 1024 packed image tokens + 64 text tokens) activations dominate. Each case runs in
its own process (1 torch thread, CPU) through the real stage-2 build (meta -> LoRA rank 16 ->
weight dtype -> checkpointing -> load from the file) and the family's own training step on
in-memory stage-1 outputs, so the figures are the training step's, not the cache reader's: a
direct training step in-process rather than a torchrun job (same model build and step code).
Memory = the process's peak RSS minus its RSS after imports (what the trainer's result.json
reports as peak_rss_mb - baseline_rss_mb). Goals: checkpointing on/off peak <= 0.5; a bf16 base
holds half the bytes of an fp32 one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORK = Path("runs/bench/train_memory")
CASES = {  # name: [train] fields
    "fp32 base, no checkpointing": {"weight_dtype": "fp32"},
    "fp32 base, checkpointing": {"weight_dtype": "fp32", "gradient_checkpointing": True},
    "bf16 base, no checkpointing": {"weight_dtype": "bf16"},
    "bf16 base, checkpointing": {"weight_dtype": "bf16", "gradient_checkpointing": True},
}
TEXT_TOKENS = 64


def rss_mb() -> float:
    """Resident memory of this process now (Linux /proc)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def write_folder(root: Path) -> Path:
    """A tiny FLUX folder with a wider transformer (hidden 256, 12 blocks)."""
    import torch
    from diffusers import FluxTransformer2DModel

    from tests.helpers.tiny_diffusers import write_tiny_folder

    folder = write_tiny_folder("flux", root / "flux")
    torch.manual_seed(0)
    wide = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * 16,
        num_layers=2,
        num_single_layers=10,
        attention_head_dim=64,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(16, 24, 24),
    )
    shutil.rmtree(folder / "transformer")
    wide.save_pretrained(folder / "transformer")
    return folder


def config_for(folder: Path, size: int, train: dict):
    """A LoRA (rank 16) job on the folder's transformer at `size` px."""
    from splitstage.config.job import config_from_dict

    pipeline = {"name": "flux", "pretrained": str(folder), "resolution": size}
    pipeline |= {"precision": "fp32", "max_prompt_length": TEXT_TOKENS}
    return config_from_dict(
        {
            "job": {"name": "bench", "seed": 0},
            "pipeline": pipeline,
            "trainable": {"lora_base_model": "transformer", "lora_rank": 16},
            "data": {"base_path": str(folder.parent / "data")},
            "cache": {"url": str(folder.parent / "cache")},
            "train": train,
            "output": {"url": str(folder.parent / "out")},
        }
    )


def one_case(folder: Path, size: int, batch: int, steps: int, train: dict) -> dict:
    """Build the model as stage 2 does, run `steps` + 1 updates; figures of this process."""
    import torch

    from splitstage.pipelines.draws import Draws
    from splitstage.pipelines.runtime import StepContext
    from splitstage.tasks.job_plan import make_plan
    from splitstage.tasks.stage2.distributed import DistInfo
    from splitstage.tasks.stage2.models import build_stage2_models

    torch.set_num_threads(1)
    config = config_for(folder, size, train)
    plan = make_plan(config)  # imports diffusers, transformers, peft
    import peft  # noqa: F401  (imported by the build; counted in the baseline)

    baseline = rss_mb()
    dist = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")
    lines: list[str] = []
    stage2 = build_stage2_models(plan, dist, names=["transformer"], log=lines.append)
    model = stage2.models["transformer"]
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4)
    after_build = rss_mb()
    family = plan.family
    g = torch.Generator().manual_seed(0)
    latent = size // 8
    inputs = {
        "input_latents": torch.randn(batch, 16, latent, latent, generator=g),
        "prompt_embeds": torch.randn(batch, TEXT_TOKENS, 32, generator=g),
        "pooled_prompt_embeds": torch.randn(batch, 32, generator=g),
    }
    seconds, losses = [], []
    for step in range(steps + 1):
        ctx = StepContext(
            {"transformer": model},
            dist.device,
            Draws.shared(torch.Generator().manual_seed(step)),
            family.settings(),
        )
        start = time.perf_counter()
        loss = family.training_loss(ctx, dict(inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    return {
        "held": lines[0],
        "frozen_mb": frozen / 2**20,
        "trained_params": sum(p.numel() for p in trained),
        "weights_mb": after_build - baseline,
        "peak_above_baseline_mb": peak - baseline,
        "step_s": statistics.median(seconds[1:]),
        "losses": losses,
    }


def run_case(folder: Path, size: int, batch: int, steps: int, train: dict) -> dict:
    """One case in a fresh process (peak RSS is per process)."""
    args = [sys.executable, __file__, "--case", json.dumps(train), "--folder", str(folder)]
    args += ["--size", str(size), "--batch", str(batch), "--steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=512, help="image side in pixels")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed updates (after one warm-up)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        figures = one_case(
            Path(args.folder), args.size, args.batch, args.steps, json.loads(args.case)
        )
        print(json.dumps(figures))
        return
    WORK.mkdir(parents=True, exist_ok=True)
    folder = write_folder(WORK)
    results = {}
    for name, train in CASES.items():
        results[name] = run_case(folder, args.size, args.batch, args.steps, train)
        r = results[name]
        print(
            f"{name:30s} peak {r['peak_above_baseline_mb']:7.0f} MB above baseline, weights "
            f"{r['weights_mb']:5.0f} MB ({r['held']}; frozen {r['frozen_mb']:.1f} MB), step "
            f"{r['step_s']:.2f} s, losses {', '.join(f'{x:.4f}' for x in r['losses'])}",
            flush=True,
        )
    off, on = results["fp32 base, no checkpointing"], results["fp32 base, checkpointing"]
    bf16 = results["bf16 base, no checkpointing"]
    ratio = on["peak_above_baseline_mb"] / off["peak_above_baseline_mb"]
    print(f"checkpointing on/off peak memory: {ratio:.2f} (goal <= 0.5)")
    print(f"checkpointing on/off step time: {on['step_s'] / off['step_s']:.2f}")
    print(
        f"bf16/fp32 frozen base bytes: {bf16['frozen_mb'] / off['frozen_mb']:.2f} (goal 0.5); "
        f"peak memory: {bf16['peak_above_baseline_mb'] / off['peak_above_baseline_mb']:.2f}; "
        f"step time: {bf16['step_s'] / off['step_s']:.2f}"
    )
    (WORK / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
