"""Loading one frozen DiffSynth slot: peak RSS over the file's bytes, DiffSynth's own
`from_pretrained` against splitstage's `load_slot`, side by side in one run.

Run: .venv/diffsynth/bin/python bench/bench_diffsynth_load.py [--layers 4] [--model audio_encoder]

The model (`--model dit`, the default) is DiffSynth's own `WanModel` at Wan 2.1 1.3B's widths (dim
1536, FFN 8960, 12 heads, 4096-wide text) with `--layers` of its 30 blocks (4: ~0.2B parameters,
a ~0.8 GB fp32 file); `--model audio_encoder` is DiffSynth's `WanS2VAudioEncoder` at its real
size (Wan-S2V's wav2vec2-large, ~0.3B parameters, a ~1.3 GB fp32 file; a transformers model whose
weight-normed convolution has a load hook: `load_slot` hands it a copy of its own per tensor).
Random weights, saved once under runs/bench/diffsynth_load/ (never committed, nothing
downloaded) in fp32 and in bf16, and registered in DiffSynth's MODEL_CONFIGS by its key hash as
the tests register their tiny files. Each case runs in its own process (1 torch thread, CPU):
a WanVideoPipeline holding that one model, loaded from one file into one torch_dtype. Loaders:
DiffSynth's `from_pretrained` on the file path (it reads every tensor through its DiskMap,
clones it, then moves the whole model to the dtype); `load_slot` now; and the loader before
(`diffsynth_load`: a mapped state dict handed to DiffSynth's `from_pretrained`). Printed per
case: VmHWM (peak RSS, file-mapped pages included) and the peak over the process's RSS before
loading (imports), both over the file's bytes and over the loaded weights' bytes; RssAnon and
RssFile once loaded (GB).
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

WORK = Path("runs/bench/diffsynth_load")
MODELS = {  # --model: (class, DiffSynth model name, WanVideoPipeline slot, kwargs per layers)
    "dit": ("diffsynth.models.wan_video_dit.WanModel", "wan_video_dit", "dit", True),
    "audio_encoder": (
        "diffsynth.models.wav2vec.WanS2VAudioEncoder",
        "wans2v_audio_encoder",
        "audio_encoder",
        False,
    ),
}
WAN_1_3B = {  # DiffSynth's MODEL_CONFIGS kwargs of Wan 2.1 T2V 1.3B, layers set per run
    "has_image_input": False,
    "patch_size": [1, 2, 2],
    "in_dim": 16,
    "dim": 1536,
    "ffn_dim": 8960,
    "freq_dim": 256,
    "text_dim": 4096,
    "out_dim": 16,
    "num_heads": 12,
    "eps": 1e-06,
}
FILES = ("fp32", "bf16")
CASES = {  # name: (loader, file dtype, torch_dtype)
    "DiffSynth from_pretrained, fp32 file -> bf16": ("diffsynth", "fp32", "bf16"),
    "load_slot before, fp32 file -> bf16": ("before", "fp32", "bf16"),
    "load_slot now, fp32 file -> bf16": ("load_slot", "fp32", "bf16"),
    "DiffSynth from_pretrained, fp32 file -> fp32": ("diffsynth", "fp32", "fp32"),
    "load_slot before, fp32 file -> fp32": ("before", "fp32", "fp32"),
    "load_slot now, fp32 file -> fp32": ("load_slot", "fp32", "fp32"),
    "DiffSynth from_pretrained, bf16 file -> bf16": ("diffsynth", "bf16", "bf16"),
    "load_slot before, bf16 file -> bf16": ("before", "bf16", "bf16"),
    "load_slot now, bf16 file -> bf16": ("load_slot", "bf16", "bf16"),
}


def status_gb(field: str) -> float:
    """One /proc/self/status field in GB (VmHWM: the peak RSS since this process started)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    return 0.0


def file_path(model: str, layers: int, dtype: str) -> Path:
    if model == "dit":
        return WORK / f"wan_dit_{layers}l_{dtype}.safetensors"
    return WORK / f"wan_{model}_{dtype}.safetensors"


def kwargs_of(model: str, layers: int) -> dict:
    """The model's constructor arguments (the DiT's with `layers` blocks; the others: none)."""
    return {**WAN_1_3B, "num_layers": layers} if MODELS[model][3] else {}


def write_files(model: str, layers: int) -> None:
    """The model with random weights, saved once per dtype."""
    if all(file_path(model, layers, d).is_file() for d in FILES):
        return
    import torch
    from diffsynth.models.model_loader import ModelPool
    from safetensors.torch import save_file

    WORK.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cls = ModelPool().import_model_class(MODELS[model][0])
    state = cls(**kwargs_of(model, layers)).state_dict()
    for dtype in FILES:
        target = torch.float32 if dtype == "fp32" else torch.bfloat16
        tensors = {
            k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in state.items()
        }
        path = file_path(model, layers, dtype)
        save_file(tensors, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)


def one_case(loader: str, model_key: str, path: Path, layers: int, torch_dtype: str) -> dict:
    """Load the slot in this process; what /proc says about memory before and after."""
    import contextlib
    import io

    import torch

    torch.set_num_threads(1)
    from diffsynth.core import ModelConfig
    from diffsynth.pipelines.wan_video import WanVideoPipeline

    from splitstage.pipelines.diffsynth.config import DiffSynthPipelineConfig
    from splitstage.pipelines.diffsynth.loader import (
        DTYPES,
        SlotSource,
        diffsynth_load,
        file_entries,
        load_slot,
    )

    model_class, model_name, slot, _ = MODELS[model_key]
    entry = {"path": str(path), "model_name": model_name, "model_class": model_class}
    config = DiffSynthPipelineConfig(
        pipeline_class="WanVideoPipeline",
        model_paths=[str(path)],
        tokenizer_path=str(WORK),
        register_models=[{**entry, "extra_kwargs": kwargs_of(model_key, layers)}],
        torch_dtype=torch_dtype,
    )
    (registered,) = file_entries(str(path), config.register_models)
    from diffsynth.configs.model_configs import MODEL_CONFIGS

    MODEL_CONFIGS.append(registered)
    before = status_gb("VmRSS")
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        if loader == "diffsynth":
            pipe = WanVideoPipeline.from_pretrained(
                torch_dtype=DTYPES[torch_dtype],
                device="cpu",
                model_configs=[ModelConfig(path=str(path))],
                tokenizer_config=None,
            )
        elif loader == "before":
            pipe = diffsynth_load(
                config, SlotSource(str(path), registered), torch.device("cpu"), False
            )
        else:
            pipe = load_slot(config, SlotSource(str(path), registered), torch.device("cpu"), False)
    seconds = time.perf_counter() - start
    model = getattr(pipe, slot)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert all(p.dtype == DTYPES[torch_dtype] for p in model.parameters())
    return {
        "seconds": seconds,
        "before_gb": before,
        "peak_gb": status_gb("VmHWM"),
        "anon_gb": status_gb("RssAnon"),
        "file_gb": status_gb("RssFile"),
        "weights_gb": weights / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model", choices=list(MODELS), default="dit")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        loader, file_dtype, torch_dtype = CASES[args.case]
        path = file_path(args.model, args.layers, file_dtype)
        print(json.dumps(one_case(loader, args.model, path, args.layers, torch_dtype)))
        return
    os.environ.update({"OMP_NUM_THREADS": "1", "DIFFSYNTH_SKIP_DOWNLOAD": "True"})
    write_files(args.model, args.layers)
    if args.model == "dit":
        print(f"WanModel, Wan 2.1 1.3B widths, {args.layers} blocks; 1 torch thread, CPU")
    else:
        print(f"{MODELS[args.model][0]}, its real size; 1 torch thread, CPU")
    header = "case | file GB | weights GB | peak/file | (peak-before)/file | (peak-before)/weights"
    print(header + " | anon GB | file-mapped GB | s")
    for name, (_, file_dtype, _) in CASES.items():
        path = file_path(args.model, args.layers, file_dtype)
        flags = ["--layers", str(args.layers), "--model", args.model, "--case", name]
        done = subprocess.run(
            [sys.executable, __file__, *flags],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        )
        if done.returncode != 0:
            print(f"{name}: failed\n{done.stderr[-3000:]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        size = path.stat().st_size / 2**30
        grown = r["peak_gb"] - r["before_gb"]
        print(
            f"{name} | {size:.2f} | {r['weights_gb']:.2f} | {r['peak_gb'] / size:.2f}"
            f" | {grown / size:.2f} | {grown / r['weights_gb']:.2f} | {r['anon_gb']:.2f}"
            f" | {r['file_gb']:.2f} | {r['seconds']:.1f}"
        )


if __name__ == "__main__":
    main()
