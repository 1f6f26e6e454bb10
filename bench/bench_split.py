"""Split time on synthetic graphs: splitstage's splitter vs the seed pseudocode, side by side.

Run: .venv/bin/python bench/bench_split.py [--sizes 1000,10000,100000] [--oracle-max 10000]
Prints one row per size with both times and the speed-up; the seed is skipped above --oracle-max
(it grows quadratically: the 100k run would take hours). Goal: >= 50x at 10k units, linear growth.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitstage.splitter import Pipeline, Unit, split_units  # noqa: E402
from tests.helpers import seed_oracle  # noqa: E402

SHAPES = {"chain": 3, "wide": 20}  # how far back (in units) a unit reads its inputs


def synthetic_pipeline(size: int, reach: int = 3, seed: int = 0) -> Pipeline:
    """A long pipeline with local data flow, rewritten params and a few trainable units.

    `reach` is how far back a unit reads: 3 resembles real pipelines (each step consumes what the
    last few produced); 20 is a wider, shallower graph where the seed's level-by-level closure
    needs fewer sweeps.
    """
    rng = random.Random(seed)
    units = []
    for i in range(size):
        reads = [f"p{max(0, i - rng.randint(1, reach))}" for _ in range(rng.randint(1, 3))]
        writes = [f"p{i}"] + ([f"p{max(0, i - rng.randint(1, 50))}"] if rng.random() < 0.1 else [])
        trains = i in (size // 10, size // 2) or rng.random() < 0.0005
        models = ("dit",) if trains else (("vae",) if rng.random() < 0.05 else ())
        units.append(
            Unit(
                f"u{i}",
                tuple(reads),
                input_params_posi={"prompt": f"p{max(0, i - 3)}"} if i % 7 == 0 else {},
                output_params=tuple(writes),
                onload_model_names=models,
            )
        )
    return Pipeline("synthetic", tuple(units))


def timed(fn, repeat: int) -> float:
    """Best wall time of `repeat` calls (this machine is noisy)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(sizes: list[int], oracle_max: int, shapes=tuple(SHAPES)) -> list[dict]:
    """Measure both implementations on each shape and size; check they agree where both ran."""
    rows = []
    for shape, size in [(shape, size) for shape in shapes for size in sizes]:
        pipe = synthetic_pipeline(size, SHAPES[shape])
        units = list(pipe.units)
        ours = timed(lambda units=units: split_units(units, ["dit"]), 3)
        result = split_units(units, ["dit"])
        row = {
            "shape": shape,
            "units": size,
            "ours_s": ours,
            "v1": len(result.v1),
            "seed_s": None,
            "ratio": None,
        }
        if size <= oracle_max:
            seed_time = timed(
                lambda units=units: seed_oracle.split_pipeline_units(units, ["dit"]), 1
            )
            v1, _ = seed_oracle.split_pipeline_units(units, ["dit"])
            assert [u.name for u in v1] == [units[i].name for i in result.v1], "results differ"
            row.update(seed_s=seed_time, ratio=seed_time / ours)
        rows.append(row)
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--oracle-max", type=int, default=10000)
    args = parser.parse_args(argv)
    rows = run([int(s) for s in args.sizes.split(",")], args.oracle_max)
    header = ("shape", "units", "V1", "splitstage s", "seed s", "speed-up", "us/unit")
    widths = (6, 8, 7, 13, 10, 9, 8)
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
    for r in rows:
        seed = f"{r['seed_s']:.3f}" if r["seed_s"] is not None else "skipped"
        ratio = f"{r['ratio']:.0f}x" if r["ratio"] is not None else "-"
        per_unit = r["ours_s"] / r["units"] * 1e6
        cells = (
            r["shape"],
            r["units"],
            r["v1"],
            f"{r['ours_s']:.4f}",
            seed,
            ratio,
            f"{per_unit:.2f}",
        )
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    for shape in SHAPES:
        mine = [r for r in rows if r["shape"] == shape]
        for first, last in zip(mine, mine[1:]):
            growth = (last["ours_s"] / first["ours_s"]) / (last["units"] / first["units"])
            print(
                f"{shape}: splitstage time growth relative to linear ({first['units']} -> "
                f"{last['units']} units): {growth:.2f} (1.00 = linear)"
            )
    return rows


if __name__ == "__main__":
    main()
