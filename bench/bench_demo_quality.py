"""Demo sample quality, split vs unsplit: a digits classifier labels the validation grids.

Run: .venv/bin/python bench/bench_demo_quality.py [--quick] [--updates N] [--every N]

Trains configs/demo.toml's DiT twice from the same seed, 1 process each (OMP_NUM_THREADS=1):
  split    preprocess into a fresh cache (stage 1, timed, 1 worker), then stage 2 from the cache
  unsplit  every unit every step, no cache
Every `--every` updates (and at the end) each run samples the demo's 10 prompts "a handwritten
digit zero".."nine" x 4 images. A LogisticRegression trained on 80% of sklearn's 8x8 digits labels
every 64x64 tile: grayscale, 8x8 average pool, x 16/255, then the inverse of the linear blur that
splitstage/data/digits.py digit_image's bicubic upscaling leaves in the pooled values (white ink on
black, 0..16 like the original: no inversion). Checked by round-tripping the held-out real digits
through digit_image, grid_png and the same tile parser. Figures: the share of samples labelled as
prompted per grid; split - unsplit at equal updates against the binomial SE (n = 40 per grid);
accuracy vs time (split: preprocess + cumulative step seconds; unsplit: cumulative step seconds)
and the time each first reaches 50% / 80%. Default: the demo's full 560 updates, grids every 40
(~8.5 min on 2 cores); --quick: 400 updates, grids every 80 (~5 min; 80% is first reached near
update 320, so fewer updates cannot show the time to 80%).
Goals: split >= 0.8 at the end; |split - unsplit| <= 2 SE; time to 80% split / unsplit < 1.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from splitstage.config.job import load_config  # noqa: E402
from splitstage.data.digits import DIGIT_WORDS, digit_image  # noqa: E402
from splitstage.demo import prepare_inputs  # noqa: E402
from splitstage.pipelines.sampling_common import grid_png  # noqa: E402
from splitstage.tasks.launch.launcher import train  # noqa: E402
from splitstage.tasks.stage1.preprocess import preprocess  # noqa: E402

WORK = Path("runs/bench/demo_quality")
ENV = {"OMP_NUM_THREADS": "1", "SPLITSTAGE_DEVICE": "cpu"}
BAND = 14  # pipelines/sampling_common.py grid_png: the white label band above each row
THRESHOLDS = (0.5, 0.8)


@functools.cache
def bicubic_pooled(tile: int) -> np.ndarray:
    """[64, 64]: what digit_image's bicubic upscaling to `tile` px, then an 8x8 average pool, does
    to an 8x8 image (linear; from PIL, one impulse per pixel; condition number ~2.4)."""
    columns = []
    for k in range(64):
        impulse = np.zeros((8, 8), np.float32)
        impulse.flat[k] = 1.0
        up = Image.fromarray(impulse, mode="F").resize((tile, tile), Image.Resampling.BICUBIC)
        columns.append(np.asarray(up).reshape(8, tile // 8, 8, tile // 8).mean(axis=(1, 3)))
    return np.stack([c.reshape(64) for c in columns], axis=1).astype(np.float64)


def tiles_to_8x8(grid: Image.Image, count: int, columns: int, unblur: bool = True) -> np.ndarray:
    """The first `count` tiles of a grid_png grid -> [count, 64] ink values in 0..16: grayscale,
    8x8 average pool, x 16/255, then (unblur) undo the pooled bicubic blur of digit_image."""
    rows = (count + columns - 1) // columns
    width, height = grid.size
    tile = width // columns
    if width != tile * columns or height != (tile + BAND) * rows or tile % 8:
        raise ValueError(f"grid {width}x{height} is not {rows} rows x {columns} tiles + bands")
    gray = np.asarray(grid.convert("L"), dtype=np.float64)
    pooled = []
    for index in range(count):
        row, col = divmod(index, columns)
        top = row * (tile + BAND) + BAND
        pixels = gray[top : top + tile, col * tile : (col + 1) * tile]
        pooled.append(pixels.reshape(8, tile // 8, 8, tile // 8).mean(axis=(1, 3)).reshape(64))
    ink = np.stack(pooled) * (16.0 / 255.0)
    if unblur:
        ink = np.clip(np.linalg.solve(bicubic_pooled(tile), ink.T).T, 0.0, 16.0)
    return ink


def classifier(size: int, columns: int):
    """A LogisticRegression on 80% of the 8x8 digits; (model, held-out accuracy, held-out
    accuracy after digit_image -> grid_png -> tiles_to_8x8 (the samples' path), the same with
    the average pool alone)."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    digits = load_digits()
    x_train, x_test, y_train, y_test, _, img_test = train_test_split(
        digits.data, digits.target, digits.images, test_size=0.2, random_state=0,
        stratify=digits.target,
    )  # fmt: skip
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000))
    model.fit(x_train, y_train)
    held_out = float(model.score(x_test, y_test))
    tiles = np.stack([np.asarray(digit_image(p, size), dtype=np.float32) for p in img_test])
    images = torch.from_numpy(tiles).permute(0, 3, 1, 2) / 127.5 - 1.0
    rows = (len(images) + columns - 1) // columns
    png = grid_png(images, [f"row {r}" for r in range(rows)], columns=columns)
    grid = Image.open(io.BytesIO(png))
    trips = [tiles_to_8x8(grid, len(images), columns, unblur) for unblur in (True, False)]
    return model, held_out, *(float(model.score(t, y_test)) for t in trips)


def prompted_digits(prompts: list[str], per_prompt: int) -> np.ndarray:
    """The digit each sample was prompted for, prompt-major like the grid."""
    labels = [DIGIT_WORDS.index(prompt.split()[-1]) for prompt in prompts]
    return np.repeat(np.array(labels), per_prompt)


def grid_accuracy(model, url: str, wanted: np.ndarray, columns: int) -> float:
    """Share of a validation grid's samples the classifier labels as their prompted digit."""
    with Image.open(url.removeprefix("file://")) as grid:
        features = tiles_to_8x8(grid, len(wanted), columns)
    return float(np.mean(model.predict(features) == wanted))


def job(base, mode: str, updates: int | None, every: int):
    """The demo job in `mode`: same seed and data, a fresh cache and outputs under WORK."""
    config = base.model_copy(deep=True)
    config.job.name = "demo-quality"
    config.cache.url = str(WORK / "cache")
    config.output.url = str(WORK / "out")
    config.train.mode = mode
    config.train.max_steps = updates
    config.train.checkpoint_every = 100_000  # only the final checkpoint (not in step times)
    config.validation.every = every
    config.tracking.report_to = "none"
    return config


def step_seconds(report) -> list[float]:
    """Each update's step time, from the run's metrics.jsonl ("s")."""
    lines = (Path(report.run_dir) / "metrics.jsonl").read_text().splitlines()
    rows = sorted((json.loads(line) for line in lines if line.strip()), key=lambda r: r["update"])
    return [row["s"] for row in rows]


def curve(report, model, wanted, columns, offset: float) -> dict[int, tuple[float, float]]:
    """update -> (seconds on the time axis, accuracy) for each of a run's grids."""
    cumulative = np.cumsum(step_seconds(report))
    grids = {int(update): url for update, url in report.samples.items()}
    return {
        u: (offset + float(cumulative[u - 1]), grid_accuracy(model, grids[u], wanted, columns))
        for u in sorted(grids)
    }


def time_to(points: dict[int, tuple[float, float]], threshold: float) -> float:
    """Seconds at the first grid whose accuracy reaches `threshold`; nan if none does."""
    return next((t for _, (t, acc) in sorted(points.items()) if acc >= threshold), math.nan)


def standard_error(a: float, b: float, n: int) -> float:
    """Binomial SE of one grid's accuracy at the pair's mean (kept off 0 and 1)."""
    p = min(max((a + b) / 2, 1 / n), 1 - 1 / n)
    return math.sqrt(p * (1 - p) / n)


def seconds_text(value: float) -> str:
    """A time, or "not reached"."""
    return "not reached" if math.isnan(value) else f"{value:.1f} s"


def main(argv=None) -> dict:
    """Train split and unsplit, label their grids, print the table; return the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="400 updates, grids every 80")
    parser.add_argument("--updates", type=int, default=None, help="default: the demo's epochs")
    parser.add_argument("--every", type=int, default=None, help="updates between grids")
    args = parser.parse_args(argv)
    updates = args.updates or (400 if args.quick else None)
    every = args.every or (80 if args.quick else 40)
    torch.set_num_threads(1)
    os.chdir(ROOT)  # the demo config's paths are relative to the repository root
    base = load_config("configs/demo.toml")
    prepare_inputs(base)
    shutil.rmtree(WORK, ignore_errors=True)
    settings = base.validation
    columns, size = settings.images_per_prompt, base.pipeline.image_size
    model, held_out, round_trip, pool_only = classifier(size, columns)
    wanted = prompted_digits(settings.prompts, columns)
    n = len(wanted)
    print(f"classifier: held-out accuracy {held_out:.3f}; real digits as 64x64 grid tiles, back "
          f"to 8x8: {round_trip:.3f} ({pool_only:.3f} with the average pool alone)")  # fmt: skip

    def progress(mode: str):
        return lambda line: print(f"  {mode}: {line}", flush=True) if "samples" in line else None

    split_cfg = job(base, "split", updates, every)
    start = time.perf_counter()
    prep = preprocess(split_cfg, workers=1, progress=False)
    prep_s = time.perf_counter() - start
    print(f"preprocess: {prep.computed} samples computed, {prep_s:.1f} s", flush=True)
    runs = {}
    for mode, config in (("split", split_cfg), ("unsplit", job(base, "unsplit", updates, every))):
        runs[mode] = train(
            config,
            run_id=f"{mode}-{time.time_ns()}",
            run_root=WORK / "runs",
            env=ENV,
            on_line=progress(mode),
        )
        print(f"{mode}: {runs[mode].updates} updates, {runs[mode].seconds:.1f} s", flush=True)
    split, unsplit = runs["split"], runs["unsplit"]
    loss_diff = max(abs(a - b) for a, b in zip(split.losses, unsplit.losses, strict=True))
    points = {
        "split": curve(split, model, wanted, columns, prep_s),
        "unsplit": curve(unsplit, model, wanted, columns, 0.0),
    }
    shared = sorted(set(points["split"]) & set(points["unsplit"]))
    print(f"\n{n} samples per grid; time: split = preprocess {prep_s:.1f} s + step seconds, "
          "unsplit = step seconds")  # fmt: skip
    print(f"{'update':>6} {'split t':>9} {'split':>6} {'unsplit t':>9} {'unsplit':>7} "
          f"{'d':>7} {'SE':>6} {'|d|/SE':>6}")  # fmt: skip
    ratios = []
    for u in shared:
        (ts, acc_s), (tu, acc_u) = points["split"][u], points["unsplit"][u]
        se = standard_error(acc_s, acc_u, n)
        ratios.append(abs(acc_s - acc_u) / se)
        print(f"{u:6d} {ts:8.1f}s {acc_s:6.3f} {tu:8.1f}s {acc_u:7.3f} "
              f"{acc_s - acc_u:+7.3f} {se:6.3f} {ratios[-1]:6.2f}")  # fmt: skip
    last = shared[-1]
    acc_split, acc_unsplit = points["split"][last][1], points["unsplit"][last][1]
    figures = {
        "updates": last,
        "classifier_held_out": held_out,
        "classifier_round_trip": round_trip,
        "classifier_round_trip_pool_only": pool_only,
        "split_acc": acc_split,
        "unsplit_acc": acc_unsplit,
        "diff": acc_split - acc_unsplit,
        "se": standard_error(acc_split, acc_unsplit, n),
        "diff_over_se": ratios[-1],
        "max_diff_over_se": max(ratios),
        "max_loss_diff": loss_diff,
        "preprocess_s": prep_s,
        "split_step_s": statistics.median(step_seconds(split)),
        "unsplit_step_s": statistics.median(step_seconds(unsplit)),
    }
    print(f"\nmax |loss split - unsplit| over {len(split.losses)} updates: {loss_diff:.3g}")
    print(f"median step: split {figures['split_step_s'] * 1e3:.0f} ms, "
          f"unsplit {figures['unsplit_step_s'] * 1e3:.0f} ms")  # fmt: skip
    for threshold in THRESHOLDS:
        key = f"{round(threshold * 100)}"
        ts, tu = (time_to(points[mode], threshold) for mode in ("split", "unsplit"))
        figures[f"time_to_{key}_split"], figures[f"time_to_{key}_unsplit"] = ts, tu
        figures[f"ratio_{key}"] = ts / tu
        ratio = "n/a" if math.isnan(ts / tu) else f"{ts / tu:.3f}"
        print(f"time to {key}%: split {seconds_text(ts)}, unsplit {seconds_text(tu)}, "
              f"split / unsplit {ratio}")  # fmt: skip
    rows = [
        ("classifier held-out accuracy (real digits)", held_out, ">= 0.9"),
        ("classifier on round-tripped real tiles", round_trip, ">= 0.9"),
        (f"labelled as prompted, split (update {last})", acc_split, ">= 0.8"),
        (f"labelled as prompted, unsplit (update {last})", acc_unsplit, ">= 0.8"),
        ("|split - unsplit| / SE, last grid", figures["diff_over_se"], "<= 2"),
        ("|split - unsplit| / SE, worst grid", figures["max_diff_over_se"], "<= 2"),
        ("time to 80%: split / unsplit", figures["ratio_80"], "< 1"),
    ]
    print(f"\n{'figure':46} {'measured':>8} {'goal':>7}  met")
    for name, value, goal in rows:
        op, target = goal.split()
        ok = {
            "<=": value <= float(target),
            ">=": value >= float(target),
            "<": value < float(target),
        }[op]
        print(f"{name:46} {value:8.3f} {goal:>7}  {'yes' if ok else 'NO'}")
    return figures


if __name__ == "__main__":
    main()
