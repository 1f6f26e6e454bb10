"""Stage-2 start-up and fixed cost per family: this tree against a base commit, side by side.

Run: .venv/bin/python bench/bench_startup.py [--base 324f741] [--families demo,sd,diffsynth]
     [--steps 4] [--repeats 2] [--out /tmp/bench-startup]

For each family (demo; tiny sd; tiny Z-Image through DiffSynth-Studio when the side environment
.venv/diffsynth exists) and each tree (the base commit, extracted with `git archive` and put on
PYTHONPATH ahead of the installed one: `python_path`; then this working tree), on the same files:
`splitstage validate` wall time, then `splitstage preprocess`, then `splitstage train` (1 rank,
--steps updates, one update a line): launch to the first update (the rank's `update 1/` line
reaching the launcher), wall time, the fixed cost (wall minus the updates' own seconds from the
report) and the peak resident memory of the launcher (the process that stays alive for the run),
its short-lived set-up child (plan and preflight, where the tree has one), torchrun's agent and the
rank, each polled every 50 ms (psutil), and their peak unique memory (USS: pages no other process
shares; torch's libraries count in every RSS), polled every 0.5 s. The trees alternate --repeats
times and each figure keeps its minimum (a shared box slows runs at random). Prints one row per
(family, tree), the ratios this tree / base, and each tree's launcher and agent against its rank.
Every command is the real CLI in a fresh process.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
SIDE_PYTHON = ROOT / ".venv/diffsynth/bin/python"
MAIN = (  # the `splitstage` console script, as installed (`main` alone in trees without it)
    "import sys; import splitstage.cli as cli; console = getattr(cli, 'console', None); "
    "sys.exit(console() if console else cli.main(sys.argv[1:]))"
)
ENV = {
    "SPLITSTAGE_DEVICE": "cpu",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "DIFFSYNTH_SKIP_DOWNLOAD": "True",
    "TOKENIZERS_PARALLELISM": "false",
}
PACKAGES = ("pipelines", "tasks", "flows", "splitter")  # folders mapped under `splitstage`


def extract_base(ref: str, out: Path) -> Path:
    """The base commit's tree under out/base, importable as `splitstage` via PYTHONPATH."""
    tree = out / "base"
    if not (tree / "splitstage").is_dir():
        data = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(data.stdout)) as archive:
            archive.extractall(tree, filter="data")
        for name in PACKAGES:  # as the editable install maps them
            (tree / "splitstage" / name).symlink_to(tree / name)
    return tree


def python_path(work: Path, tree: Path | None = None) -> str:
    """PYTHONPATH of a run in `work`: `work/fixtures-path`, holding only a link to this checkout's
    tests/ (the tiny Z-Image files name their classes `tests.helpers.tiny_diffsynth.<class>`:
    every process of the run imports them, DiffSynth's own too, and no `splitstage` comes with
    them), then the base `tree` when given (this tree's `splitstage` is the installed one)."""
    folder = work / "fixtures-path"
    if not (folder / "tests").exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
    return os.pathsep.join(str(p) for p in (folder, tree) if p is not None)


def write_assets(out: Path, families: list[str]) -> dict[str, dict]:
    """Data, demo weights, the tiny sd folder and tiny Z-Image files; each family's job body."""
    sys.path.insert(0, str(ROOT))
    from splitstage.data.digits import write_digits_dataset
    from splitstage.pipelines.demo.weight_files import build_demo_weights
    from tests.helpers.tiny_diffusers import write_tiny_folder

    assets = out / "assets"
    write_digits_dataset(assets / "data", limit=8, size=64)
    jobs: dict[str, dict] = {}
    if "demo" in families:
        weights = build_demo_weights(assets / "demo")
        jobs["demo"] = {
            "models": {
                "vae": {"weights": str(weights["vae"])},
                "dit": {"weights": str(weights["dit"])},
                "text_encoder": {"builder": "tiny"},
            },
            "trainable": {"lora_base_model": "dit", "lora_rank": 4},
            "train": {"batch_size": 2},
        }
    if "sd" in families:
        write_tiny_folder("sd", assets / "sd")
        jobs["sd"] = {
            "pipeline": {"name": "sd", "pretrained": str(assets / "sd"), "resolution": 64},
            "trainable": {"lora_base_model": "unet", "lora_rank": 4},
            "train": {"batch_size": 2},
        }
    if "diffsynth" in families:
        script = (
            "import json, sys; from tests.helpers.tiny_diffsynth import write_tiny_models; "
            "print(json.dumps(write_tiny_models('ZImagePipeline', sys.argv[1])))"
        )
        done = subprocess.run(
            [str(SIDE_PYTHON), "-c", script, str(assets / "zimage")],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, **ENV, "PYTHONPATH": python_path(assets)},
        )
        info = json.loads(done.stdout.strip().splitlines()[-1])
        jobs["diffsynth"] = {
            "pipeline": {
                "name": "diffsynth",
                "pipeline_class": "ZImagePipeline",
                "height": 32,
                "width": 32,
                **info,
            },
            "trainable": {"lora_base_model": "dit", "lora_rank": 4},
            "train": {"batch_size": 1},
        }
    for body in jobs.values():
        body["data"] = {"base_path": str(assets / "data")}
    return jobs


def toml(document: dict, prefix: str = "", header: str | None = None) -> str:
    """A job dict as TOML (tables, arrays of tables, plain values)."""
    lines, tables = [], []
    for key, value in document.items():
        if isinstance(value, dict):
            tables.append(toml(value, f"{prefix}{key}."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables += [toml(v, f"{prefix}{key}.", f"[[{prefix}{key}]]\n") for v in value]
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    if header is None:
        header = f"[{prefix[:-1]}]\n" if prefix and lines else ""
    return header + "".join(f"{line}\n" for line in lines) + "".join(tables)


def role(proc: psutil.Process, launcher: int) -> str:
    """launcher, set-up (its plan-and-preflight child), agent (torchrun) or rank, by pid and
    command line."""
    if proc.pid == launcher:
        return "launcher"
    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return "other"
    if "torchrun_agent" in line or "stage2.agent" in line:  # its arguments name the worker too
        return "agent"
    if "splitstage.tasks.stage2.worker" in line:
        return "rank"
    if "splitstage.tasks.stage2.prepare" in line:  # trees with a set-up child (before issue 34)
        return "set-up"
    return "other"


def run(
    command: list[str], env: dict[str, str], cwd: Path, mark: str | None = None, label=role
) -> dict:
    """Run a command to the end in `cwd` (never the checkout: `python -c` puts the working folder
    first on sys.path, which would shadow the base tree): wall seconds, stdout, when `mark` first
    appeared, the peak RSS (MB) of each role (`label(process, root pid)`) in its process tree, and
    its peak USS (MB); "largest" (any one process) and "tree" (summed) peaks besides."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd
    )
    lines: list[str] = []
    first: list[float] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if mark and not first and mark in line:
                first.append(time.perf_counter() - start)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peaks: dict[str, float] = {}
    unique: dict[str, float] = {}
    root = psutil.Process(proc.pid)
    next_uss = 0.0
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        now = time.perf_counter()
        deep = now >= next_uss  # smaps of a torch process takes ~10-50 ms to read
        tree_rss = tree_uss = 0.0
        for child in procs:
            name = label(child, proc.pid)
            try:
                rss = child.memory_info().rss / 2**20
                uss = child.memory_full_info().uss / 2**20 if deep else 0.0
            except psutil.Error:
                continue
            tree_rss, tree_uss = tree_rss + rss, tree_uss + uss
            for key in (name, "largest"):
                peaks[key] = max(peaks.get(key, 0.0), rss)
                unique[key] = max(unique.get(key, 0.0), uss)
        peaks["tree"] = max(peaks.get("tree", 0.0), tree_rss)
        if deep:
            unique["tree"] = max(unique.get("tree", 0.0), tree_uss)
            next_uss = now + 0.5
        time.sleep(0.05)
    reader.join()
    wall = time.perf_counter() - start
    text = "".join(lines)
    if proc.returncode:
        raise SystemExit(f"{' '.join(command[-3:])} failed ({proc.returncode}):\n{text[-3000:]}")
    first_s = first[0] if first else None
    return {"wall": wall, "out": text, "first": first_s, "peaks": peaks, "uss": unique}


def measure(python: str, tree: Path | None, job: dict, work: Path, steps: int) -> dict:
    """validate, preprocess, train of one job with one tree; the figures of each."""
    env = {**os.environ, **ENV, "PYTHONPATH": python_path(work, tree)}
    work.mkdir(parents=True, exist_ok=True)
    document = {
        "job": {"name": "startup", "seed": 0},
        **job,
        "cache": {"url": str(work / "cache"), "shard_samples": 8},
        "output": {"url": str(work / "out")},
    }
    document["train"] = {
        **job["train"],
        "max_steps": steps,
        "log_every": 1,
        "checkpoint_every": 10_000,
        "scratch_dir": str(work / "runs"),
    }
    config = work / "job.toml"
    config.write_text(toml(document))
    cli = [python, "-c", MAIN]
    validate = run([*cli, "validate", str(config)], env, work)
    run([*cli, "preprocess", str(config)], env, work)
    trained = run([*cli, "train", str(config), "--json"], env, work, mark="update 1/")
    report = json.loads(trained["out"][trained["out"].rindex("\n{") :])
    loop = sum(report.get("step_seconds") or [])
    return {
        "validate_s": validate["wall"],
        "validate_loaded": len(re.findall("Loading models from", validate["out"])),
        "first_update_s": trained["first"],
        "train_wall_s": trained["wall"],
        "fixed_s": trained["wall"] - loop,
        "loop_s": loop,
        "launcher_mb": trained["peaks"].get("launcher", 0.0),
        "setup_mb": trained["peaks"].get("set-up", 0.0),
        "agent_mb": trained["peaks"].get("agent", 0.0),
        "rank_mb": trained["peaks"].get("rank", 0.0),
        "launcher_uss": trained["uss"].get("launcher", 0.0),
        "agent_uss": trained["uss"].get("agent", 0.0),
        "rank_uss": trained["uss"].get("rank", 0.0),
        "rank_diffsynth_loads": len(re.findall("Loading models from", trained["out"])),
        "updates": report.get("updates"),
    }


COLUMNS = [
    ("validate_s", "validate s", "{:.1f}"),
    ("first_update_s", "launch->1st update s", "{:.1f}"),
    ("train_wall_s", "train wall s", "{:.1f}"),
    ("fixed_s", "fixed cost s", "{:.1f}"),
    ("launcher_mb", "launcher MB", "{:.0f}"),
    ("agent_mb", "agent MB", "{:.0f}"),
    ("rank_mb", "rank MB", "{:.0f}"),
    ("setup_mb", "set-up MB", "{:.0f}"),
    ("launcher_uss", "launcher USS", "{:.0f}"),
    ("agent_uss", "agent USS", "{:.0f}"),
    ("rank_uss", "rank USS", "{:.0f}"),
    ("rank_diffsynth_loads", "DiffSynth loads (rank)", "{}"),
    ("validate_loaded", "DiffSynth loads (validate)", "{}"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="324f741", help="the commit to compare against")
    parser.add_argument("--families", default="demo,sd,diffsynth")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="runs per tree; minimum kept")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-startup"))
    args = parser.parse_args()
    families = args.families.split(",")
    if "diffsynth" in families and not SIDE_PYTHON.exists():
        print(f"no {SIDE_PYTHON}: the diffsynth family is left out")
        families.remove("diffsynth")
    args.out.mkdir(parents=True, exist_ok=True)
    base = extract_base(args.base, args.out)
    jobs = write_assets(args.out, families)
    results: dict[tuple[str, str], dict] = {}
    for family in families:
        python = str(SIDE_PYTHON) if family == "diffsynth" else sys.executable
        for _ in range(args.repeats):  # trees interleaved: a busy box slows both alike
            for label, tree in (("base", base), ("this", None)):  # same files
                work = args.out / "runs" / f"{family}-{label}-{time.time_ns()}"
                row = measure(python, tree, jobs[family], work, args.steps)
                print(family, label, json.dumps(row), flush=True)
                kept = results.setdefault((family, label), row)
                for key, value in row.items():  # the least disturbed run of each figure
                    if isinstance(value, float) and kept[key] is not None:
                        kept[key] = min(kept[key], value)
    head = f"{'family':<10} {'tree':<5} " + " ".join(f"{title:>12}" for _, title, _ in COLUMNS)
    print(f"\nbase = {args.base}, this = the working tree; {args.steps} updates, 1 rank, CPU")
    print(head)
    for (family, label), row in results.items():
        cells = " ".join(f"{fmt.format(row[key] or 0):>12}" for key, _, fmt in COLUMNS)
        print(f"{family:<10} {label:<5} {cells}")
    print("\nratios this / base (lower is better)")
    for family in families:
        this, before = results[family, "this"], results[family, "base"]
        ratios = [
            f"{title} {this[key] / before[key]:.2f}"
            for key, title, _ in COLUMNS[:7]
            if before[key] and this[key] is not None
        ]
        print(f"{family}: {', '.join(ratios)}")
    print("\nlauncher and agent against the rank (goal: launcher + agent <= 0.15 of the rank)")
    for (family, label), row in results.items():
        print(f"{family} {label}: {against_rank(row)}")


def against_rank(row: dict) -> str:
    """The launcher's and the agent's peaks as shares of the rank's, in RSS and in USS."""
    parts = []
    for unit, suffix in (("RSS", "mb"), ("USS", "uss")):
        rank = row[f"rank_{suffix}"]
        if not rank:
            continue
        launcher, agent = row[f"launcher_{suffix}"] / rank, row[f"agent_{suffix}"] / rank
        parts.append(
            f"{unit}: launcher {launcher:.2f}, agent {agent:.2f}, both {launcher + agent:.2f}"
        )
    return "; ".join(parts)


if __name__ == "__main__":
    main()
