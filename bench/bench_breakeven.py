"""The epoch count at which split training beats unsplit end to end, per family, vs a base tree.

Run: .venv/bin/python bench/bench_breakeven.py [--base 324f741] [--families demo,sd]
     [--rows 32] [--epochs 1,4] [--repeats 1] [--out /tmp/bench-breakeven]

For each family (the demo; the tiny `sd` folder) and each tree (the base commit, extracted with
`git archive` as bench_startup.py does, then this working tree), on the same files, 1 rank, CPU:
split = `splitstage preprocess` (a fresh cache) + `splitstage train` for E epochs; unsplit =
`splitstage train` with `train.mode = "unsplit"` for E epochs (every unit every step). Each
train runs at two epoch counts, which gives its fixed cost (the intercept) and its cost per epoch
(the slope); the break-even epoch count is where the lines cross:

    E* = (preprocess + split fixed - unsplit fixed) / (unsplit per epoch - split per epoch)

Every command is the real CLI in a fresh process; the trees alternate --repeats times and each
wall time keeps its minimum (a shared box slows runs at random).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_startup import ENV, MAIN, extract_base, run, toml, write_assets  # noqa: E402


def walls(tree: Path | None, job: dict, work: Path, data: Path, epochs: list[int]) -> dict:
    """Wall seconds of preprocess, and of split and unsplit training at each epoch count."""
    env = {**os.environ, **ENV}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    else:
        env.pop("PYTHONPATH", None)
    work.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-c", MAIN]
    figures: dict[str, float] = {}

    def config(name: str, mode: str, count: int) -> str:
        document = {
            "job": {"name": "breakeven", "seed": 0},
            **job,
            "data": {"base_path": str(data)},
            "cache": {"url": str(work / "cache"), "shard_samples": 16},
            "output": {"url": str(work / f"out-{name}")},
        }
        document["train"] = {
            **job["train"],
            "mode": mode,
            "epochs": count,
            "log_every": 1000,
            "checkpoint_every": 100_000,
            "scratch_dir": str(work / f"runs-{name}"),
        }
        path = work / f"{name}.toml"
        path.write_text(toml(document))
        return str(path)

    figures["preprocess"] = run([*cli, "preprocess", config("pre", "split", 1)], env, work)["wall"]
    for count in epochs:
        for mode in ("split", "unsplit"):
            path = config(f"{mode}-{count}", mode, count)
            figures[f"{mode}-{count}"] = run([*cli, "train", path], env, work)["wall"]
    return figures


def breakeven(figures: dict, epochs: list[int]) -> dict:
    """Fixed cost and cost per epoch of each mode (a line through the two epoch counts), and
    the epoch count at which split (preprocess included) costs less than unsplit."""
    low, high = epochs
    lines = {}
    for mode in ("split", "unsplit"):
        slope = (figures[f"{mode}-{high}"] - figures[f"{mode}-{low}"]) / (high - low)
        lines[mode] = (figures[f"{mode}-{low}"] - slope * low, slope)
    (split_fixed, split_epoch), (unsplit_fixed, unsplit_epoch) = lines["split"], lines["unsplit"]
    gap = figures["preprocess"] + split_fixed - unsplit_fixed
    saved = unsplit_epoch - split_epoch
    crossing = max(gap / saved, 0.0) if saved > 0 else math.inf
    return {
        "preprocess_s": figures["preprocess"],
        "split_fixed_s": split_fixed,
        "split_epoch_s": split_epoch,
        "unsplit_fixed_s": unsplit_fixed,
        "unsplit_epoch_s": unsplit_epoch,
        "breakeven_epochs": crossing,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="324f741", help="the commit to compare against")
    parser.add_argument("--families", default="demo,sd")
    parser.add_argument("--rows", type=int, default=32, help="images in the data set")
    parser.add_argument("--epochs", default="1,4", help="the two epoch counts to fit")
    parser.add_argument("--repeats", type=int, default=1, help="runs per tree; minimum kept")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-breakeven"))
    args = parser.parse_args()
    families, epochs = args.families.split(","), [int(e) for e in args.epochs.split(",")]
    if len(epochs) != 2 or epochs[0] >= epochs[1]:
        raise SystemExit("--epochs takes two increasing counts, e.g. 1,4")
    args.out.mkdir(parents=True, exist_ok=True)
    base = extract_base(args.base, args.out)
    jobs = write_assets(args.out, families)
    from splitstage.data.digits import write_digits_dataset

    data = args.out / "assets" / f"data-{args.rows}"
    if not data.is_dir():
        write_digits_dataset(data, limit=args.rows, size=64)
    kept: dict[tuple[str, str], dict] = {}
    for family in families:
        for _ in range(args.repeats):
            for label, tree in (("base", base), ("this", None)):
                work = args.out / "runs" / f"{family}-{label}-{time.time_ns()}"
                figures = walls(tree, jobs[family], work, data, epochs)
                print(family, label, {k: round(v, 2) for k, v in figures.items()}, flush=True)
                row = kept.setdefault((family, label), figures)
                for key, value in figures.items():
                    row[key] = min(row[key], value)
    print(f"\n{args.rows} images, epochs {epochs[0]} and {epochs[1]}, 1 rank, CPU; seconds")
    names = ["preprocess_s", "split_fixed_s", "split_epoch_s", "unsplit_fixed_s"]
    names += ["unsplit_epoch_s", "breakeven_epochs"]
    print(f"{'family':<8} {'tree':<5} " + " ".join(f"{name:>16}" for name in names))
    for (family, label), figures in kept.items():
        row = breakeven(figures, epochs)
        print(f"{family:<8} {label:<5} " + " ".join(f"{row[name]:>16.2f}" for name in names))


if __name__ == "__main__":
    main()
