"""End to end, 10 epochs: preprocess once + split training vs unsplit training, wall time.

Run: .venv/bin/python bench/bench_end_to_end.py [--samples 256] [--epochs 10]

Both train the DiT's LoRA on the same digits with the real MiniLM text encoder, 1 process.
split = `preprocess` (fresh cache) + stage 2 from the cache; unsplit = every unit every step.
Goal: split / unsplit wall time <= 0.45.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_job import demo_job  # noqa: E402

from splitstage.data.digits import write_digits_dataset  # noqa: E402
from splitstage.demo import write_demo_weights  # noqa: E402
from splitstage.tasks.launch.launcher import train  # noqa: E402
from splitstage.tasks.stage1.preprocess import preprocess  # noqa: E402

WORK = Path("runs/bench/end_to_end")


def job(name: str, samples: int, epochs: int, mode: str):
    """The benchmark's job config in `mode` (split or unsplit)."""
    return demo_job(WORK, name, samples, mode=mode, epochs=epochs)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args(argv)
    write_digits_dataset(WORK / "data", limit=args.samples)
    write_demo_weights(WORK / "weights")
    shutil.rmtree(WORK / "cache", ignore_errors=True)
    shutil.rmtree(WORK / "out", ignore_errors=True)
    quiet = {
        "env": {"SPLITSTAGE_DEVICE": "cpu"},
        "on_line": lambda line: None,
        "run_root": WORK / "runs",
    }
    start = time.perf_counter()
    split_cfg = job("e2e-split", args.samples, args.epochs, "split")
    prep = preprocess(split_cfg, workers=1, progress=False)
    prep_s = time.perf_counter() - start
    split = train(split_cfg, run_id=f"split-{time.time_ns()}", **quiet)
    split_s = time.perf_counter() - start
    start = time.perf_counter()
    unsplit = train(
        job("e2e-unsplit", args.samples, args.epochs, "unsplit"),
        run_id=f"unsplit-{time.time_ns()}",
        **quiet,
    )
    unsplit_s = time.perf_counter() - start
    ratio = split_s / unsplit_s
    print(f"{args.samples} samples x {args.epochs} epochs, {split.updates} updates each")
    print(
        f"split:   preprocess {prep_s:.1f} s ({prep.computed} samples) + train "
        f"{split_s - prep_s:.1f} s = {split_s:.1f} s, final loss {split.losses[-1]:.4f}"
    )
    print(f"unsplit: train {unsplit_s:.1f} s, final loss {unsplit.losses[-1]:.4f}")
    print(
        f"split / unsplit wall time: {ratio:.3f} (goal <= 0.45: {'yes' if ratio <= 0.45 else 'NO'})"
    )
    return {
        "split_s": split_s,
        "preprocess_s": prep_s,
        "unsplit_s": unsplit_s,
        "ratio": ratio,
        "updates": split.updates,
    }


if __name__ == "__main__":
    main()
