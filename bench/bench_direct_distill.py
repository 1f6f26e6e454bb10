"""Stage-2 step time of direct distillation (`train.task = "direct_distill"`, flux family), split
vs unsplit, side by side in one run (tiny FLUX folder, CPU, 1 rank, real torchrun jobs).

Run: .venv/bin/python bench/bench_direct_distill.py [--updates 30] [--rows 8]

Split trains from the cache (prompt embeddings, the teacher image's latents and the row-seeded
starting noise computed once in stage 1); unsplit runs every unit every step. At tiny sizes the
encoders cost almost nothing, so the ratio says little about real models: the figure to read is
that the losses are equal and what the split saves grows with the text encoder and VAE.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def workspace(root: Path, rows: int) -> Path:
    """Digits with a teacher seed and step count per row, and a tiny FLUX folder."""
    from splitstage.data.digits import write_digits_dataset
    from tests.helpers.tiny_diffusers import write_tiny_folder

    write_digits_dataset(root / "data", limit=rows, size=32)
    with (root / "data" / "metadata.csv").open(encoding="utf-8") as handle:
        table = list(csv.DictReader(handle))
    with (root / "data" / "distill.jsonl").open("w", encoding="utf-8") as handle:
        for index, row in enumerate(table):
            handle.write(json.dumps(row | {"seed": index, "num_inference_steps": 2}) + "\n")
    write_tiny_folder("flux", root / "flux")
    return root


def job(root: Path, mode: str, updates: int):
    """The distillation job, split or unsplit."""
    from splitstage.config.job import config_from_dict

    flux = {"name": "flux", "pretrained": str(root / "flux"), "resolution": 64}
    flux |= {"precision": "fp32", "max_prompt_length": 16, "vae_latents": "mean"}
    data = {"base_path": str(root / "data"), "metadata_path": str(root / "data/distill.jsonl")}
    train = {"task": "direct_distill", "mode": mode, "batch_size": 2, "max_steps": updates}
    return config_from_dict(
        {
            "job": {"name": f"distill-{mode}", "seed": 3},
            "pipeline": flux,
            "trainable": {"lora_base_model": "transformer", "lora_rank": 4},
            "data": data,
            "cache": {"url": str(root / "cache")},
            "train": train | {"epochs": updates, "log_every": updates},
            "output": {"url": str(root / "out")},
            "tracking": {"report_to": "none"},
        }
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args(argv)
    from splitstage.tasks.launch.launcher import train
    from splitstage.tasks.stage1.preprocess import preprocess

    root = workspace(Path(tempfile.mkdtemp(prefix="bench-distill-")), args.rows)
    preprocess(job(root, "split", args.updates), workers=1, progress=False)
    figures = {}
    for mode in ("split", "unsplit"):
        report = train(job(root, mode, args.updates), run_root=root / "runs", env=ENV)
        figures[mode] = (statistics.median(report.step_seconds[2:]), report.losses)
    (split, split_losses), (unsplit, unsplit_losses) = figures["split"], figures["unsplit"]
    equal = all(
        abs(a - b) <= 1e-5 * max(1.0, abs(a))
        for a, b in zip(split_losses, unsplit_losses, strict=True)
    )
    ratio = split / unsplit
    print(f"stage-2 step: split {split:.3f} s, unsplit {unsplit:.3f} s, ratio {ratio:.2f}")
    print(f"losses equal (rel 1e-5): {equal}")
    return {"split_s": split, "unsplit_s": unsplit, "ratio": ratio, "equal": equal}


if __name__ == "__main__":
    main()
