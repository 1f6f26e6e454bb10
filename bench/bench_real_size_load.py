"""Stage 2's load of SD 1.5's real UNet (859.5M parameters, a 3.44 GB fp32 file), LoRA rank 4:
the largest process's peak RSS over the file's bytes, mapped frozen weights against copied ones,
side by side in one run.

Run: .venv/bin/python bench/bench_real_size_load.py [--size 256] [--steps 1]

The UNet is built once from its real config (diffusers' UNet2DConditionModel defaults with SD 1.5's
768-wide cross-attention and 64-latent sample size) with random weights and saved under
runs/bench/real_size/ (never committed, nothing downloaded). Each case runs in its own process (1
torch thread, CPU) through the stage-2 loader as a LoRA rank builds the trained model: meta device
-> peft LoRA on the attention projections -> frozen base in the case's dtype (`hold_base_in`) ->
`materialize_and_load`; then `--steps` LoRA updates (AdamW) at `--size` px, batch 1. Cases: fp32
base mapped (the default now), fp32 base copied (`map_frozen=False`: the loader before), bf16 base
with the file's pages handed back after each converted tensor (now), and without (before). Printed
per case: peak RSS / file bytes after loading and after the steps, and RssAnon / RssFile after
loading (GB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORK = Path("runs/bench/real_size")
FILE = WORK / "unet-sd15.safetensors"
SD15 = {"sample_size": 64, "cross_attention_dim": 768}  # over diffusers' defaults: SD 1.5's UNet
CASES = {
    "fp32 base, mapped (now)": {"dtype": "fp32", "map": True, "drop": True},
    "fp32 base, copied (before)": {"dtype": "fp32", "map": False, "drop": False},
    "bf16 base, pages handed back (now)": {"dtype": "bf16", "map": True, "drop": True},
    "bf16 base, pages kept (before)": {"dtype": "bf16", "map": True, "drop": False},
}


def status_gb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    return 0.0


def peak_gb() -> float:
    """This process's peak RSS (VmHWM: ru_maxrss would start at the parent's at the fork)."""
    return status_gb("VmHWM")


def write_unet() -> None:
    """The real-size UNet with random weights, saved once."""
    if FILE.is_file():
        return
    import torch
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file

    WORK.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**SD15)
    save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, str(FILE) + ".tmp")
    os.replace(str(FILE) + ".tmp", FILE)


def one_case(case: dict, size: int, steps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig, inject_adapter_in_model

    import splitstage.tasks.stage2.pretrained_weights as weights
    from splitstage.tasks.stage2.models import hold_base_in

    if not case["drop"]:
        weights.drop_mapped_pages = lambda tensor: 0  # the loader before: pages kept
    baseline = status_gb("VmRSS")
    with torch.device("meta"):
        unet = UNet2DConditionModel(**SD15)
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    unet = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=targets), unet)
    for name, param in unet.named_parameters():
        param.requires_grad_("lora_" in name)
    hold_base_in(unet, {"fp32": torch.float32, "bf16": torch.bfloat16}[case["dtype"]])
    started = time.perf_counter()
    report = weights.materialize_and_load(unet, FILE, device="cpu", map_frozen=case["map"])
    figures = {
        "load_s": time.perf_counter() - started,
        "mapped": report.mapped,
        "after_load_peak_gb": peak_gb(),
        "anon_gb": status_gb("RssAnon"),
        "file_gb": status_gb("RssFile"),
        "baseline_gb": baseline,
    }
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    latents = torch.randn(1, 4, size // 8, size // 8)
    text = torch.randn(1, 77, 768)
    started = time.perf_counter()
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case["dtype"] == "bf16"):
            out = unet(latents, torch.tensor([500 + step]), text).sample
        out.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    figures["step_s"] = (time.perf_counter() - started) / max(steps, 1)
    figures["peak_gb"] = peak_gb()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=256, help="image side in pixels")
    parser.add_argument("--steps", type=int, default=1, help="LoRA updates after loading")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print("RESULT " + json.dumps(one_case(CASES[args.case], args.size, args.steps)))
        return
    write_unet()
    file_gb = FILE.stat().st_size / 2**30
    print(f"UNet file {FILE}: {file_gb:.2f} GB; {args.size} px, batch 1, LoRA rank 4, CPU")
    columns = ("peak/file after load", "peak/file", "anon GB", "file GB", "load s", "step s")
    print(f"{'case':<36} {'  '.join(columns)}  mapped")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in CASES:
        command = [sys.executable, __file__, "--case", name, "--size", str(args.size)]
        done = subprocess.run(
            [*command, "--steps", str(args.steps)], capture_output=True, text=True, env=env
        )
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: failed\n{done.stderr[-2000:]}")
            continue
        r = json.loads(line.removeprefix("RESULT "))
        print(
            f"{name:<36} {r['after_load_peak_gb'] / file_gb:>20.2f} "
            f"{r['peak_gb'] / file_gb:>10.2f} {r['anon_gb']:>8.2f} {r['file_gb']:>8.2f} "
            f"{r['load_s']:>7.1f} {r['step_s']:>7.1f} {r['mapped']:>7}"
        )


if __name__ == "__main__":
    main()
