"""splitstage's split training against DiffSynth-Studio's own, side by side on tiny Z-Image.

Run: .venv/bin/python bench/bench_diffsynth_peer.py [--steps 8] [--repeats 2]
     [--out /tmp/bench-diffsynth-peer] [--stage1-sizes [--stage1-shape wide|deep]]

Needs .venv/diffsynth. Same tiny Z-Image files and 8 digit images with prompts (bench_startup's
write_assets; its metadata.csv is DiffSynth's image,prompt format), 32x32, batch 1, --steps updates,
LoRA rank 4 on the dit's same modules, AdamW lr 1e-4 and weight decay 0.01, no gradient
checkpointing, bf16 pipeline, 1 torch thread. splitstage: the CLI's `preprocess` then `train` (1
rank). DiffSynth: as its examples/z_image/model_training/special/split_training/Z-Image.sh,
`accelerate launch` (1 process) of a driver written like its example train.py on the package's
APIs, `--task sft:data_process` (dit offloaded to disk; one .pth per sample) then `--task
sft:train` (text encoder and VAE offloaded); the driver's ModelLogger prints a line per optimizer
update, as the rank's `update 1/` line. Figures: stage 2 launch to the first update, wall, fixed
cost (wall minus the updates' own seconds), peak RSS of the training process (rank / accelerate's
child), launcher and process tree (every 50 ms, psutil), peak USS of the training process and the
tree (every 0.5 s); stage 1: wall, peak RSS of its largest process and its tree. Tools alternate
--repeats times, each figure keeps its minimum; prints a row per tool and splitstage / DiffSynth
ratios beside the project's goals.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_startup import (  # noqa: E402
    ENV,
    MAIN,
    SIDE_PYTHON,
    python_path,
    role,
    run,
    toml,
    write_assets,
)

SAMPLES, LR, DECAY = 8, 1e-4, 0.01
ACCELERATE = ["-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1"]
ACCELERATE += ["--mixed_precision", "no", "--dynamo_backend", "no"]
DRIVER = '''"""Z-Image split training on DiffSynth-Studio's public APIs, as its example train.py."""
import argparse, json, time
import accelerate, torch
from diffsynth.configs import MODEL_CONFIGS
from diffsynth.core import ModelConfig, UnifiedDataset
from diffsynth.core.loader.file import hash_model_file
from diffsynth.diffusion import (DiffusionTrainingModule, FlowMatchSFTLoss, ModelLogger,
    add_general_config, add_image_size_config, launch_data_process_task, launch_training_task)
from diffsynth.pipelines.z_image import ZImagePipeline

if not hasattr(torch.cpu, "empty_cache"):  # offloading calls it; torch has none for the CPU
    torch.cpu.empty_cache = lambda: None


class ZImageModule(DiffusionTrainingModule):
    def __init__(self, args, device):
        super().__init__()
        configs = self.parse_model_configs(
            args.model_paths, None, offload_models=args.offload_models, device=device)
        self.pipe = ZImagePipeline.from_pretrained(
            torch_dtype=torch.bfloat16, device=device, model_configs=configs,
            tokenizer_config=ModelConfig(path=args.tokenizer_path))
        self.pipe = self.split_pipeline_units(
            args.task, self.pipe, args.trainable_models, args.lora_base_model)
        self.switch_pipe_to_training_mode(
            self.pipe, args.trainable_models, args.lora_base_model, args.lora_target_modules,
            args.lora_rank, task=args.task)
        self.task, self.checkpointing = args.task, args.use_gradient_checkpointing

    def forward(self, data, inputs=None):
        self.started = time.perf_counter()
        if inputs is None:
            image = data["image"]
            shared = {"input_image": image, "height": image.size[1], "width": image.size[0],
                      "embedded_guidance": 1.0, "cfg_scale": 1, "rand_device": self.pipe.device,
                      "use_gradient_checkpointing": self.checkpointing,
                      "use_gradient_checkpointing_offload": False}
            inputs = (shared, {"prompt": data["prompt"]}, {"negative_prompt": ""})
        inputs = self.transfer_data_to_device(inputs, self.pipe.device, self.pipe.torch_dtype)
        for unit in self.pipe.units:
            inputs = self.pipe.unit_runner(unit, self.pipe, *inputs)
        if self.task.endswith(":data_process"):
            return inputs
        return FlowMatchSFTLoss(self.pipe, **inputs[0], **inputs[1])


class UpdateLogger(ModelLogger):  # on_step_end follows optimizer.step: one line an update
    def on_step_end(self, accelerator, model, save_steps=None, **kwargs):
        super().on_step_end(accelerator, model, save_steps, **kwargs)
        seconds = time.perf_counter() - self.module.started
        print(f"diffsynth update {self.num_steps}/{self.total} {seconds:.6f}s", flush=True)


parser = add_image_size_config(add_general_config(argparse.ArgumentParser()))
for name in ("--tokenizer_path", "--register"):  # register: tiny models MODEL_CONFIGS lacks
    parser.add_argument(name)
parser.add_argument("--max_data_items", type=int, default=None)
args = parser.parse_args()
MODEL_CONFIGS.extend({**entry, "model_hash": hash_model_file(entry["path"])}
                     for entry in json.load(open(args.register)))
ddp = accelerate.DistributedDataParallelKwargs(find_unused_parameters=args.find_unused_parameters)
accelerator = accelerate.Accelerator(
    gradient_accumulation_steps=args.gradient_accumulation_steps, kwargs_handlers=[ddp])
dataset = UnifiedDataset(
    base_path=args.dataset_base_path, metadata_path=args.dataset_metadata_path,
    repeat=args.dataset_repeat, data_file_keys=args.data_file_keys.split(","),
    main_data_operator=UnifiedDataset.default_image_operator(
        base_path=args.dataset_base_path, max_pixels=args.max_pixels, height=args.height,
        width=args.width, height_division_factor=16, width_division_factor=16),
    max_data_items=args.max_data_items)
module = ZImageModule(args, accelerator.device)
logger = UpdateLogger(args.output_path, remove_prefix_in_ckpt=args.remove_prefix_in_ckpt)
logger.module, logger.total = module, len(dataset) * args.num_epochs
task = launch_data_process_task if args.task.endswith(":data_process") else launch_training_task
task(accelerator, dataset, module, logger, args=args)
'''


def diffsynth_role(proc: psutil.Process, launcher: int) -> str:
    """accelerate's launcher, the driver it starts (the training process), or other."""
    with contextlib.suppress(psutil.Error):
        if proc.pid == launcher or "diffsynth_driver.py" in " ".join(proc.cmdline()):
            return "launcher" if proc.pid == launcher else "rank"
    return "other"


def watch(command: list[str], cwd: Path, log: str, label, mark: str | None = None) -> dict:
    """bench_startup's `run` of a command (its own PYTHONPATH replaced by `python_path`: the tiny
    models' classes, no other tree), flattened: wall seconds, output, when `mark` first appeared,
    `<role>_rss` / `<role>_uss` peaks (MB) with "largest" and "tree" among the roles; the output
    is kept in cwd/<log>.log."""
    env = {**os.environ, **ENV, "PYTHONPATH": python_path(cwd)}
    result = run(command, env, cwd, mark, label=label)
    (cwd / f"{log}.log").write_text(result["out"])
    flat = {f"{name}_rss": mb for name, mb in result["peaks"].items()}
    flat |= {f"{name}_uss": mb for name, mb in result["uss"].items()}
    return {"wall": result["wall"], "out": result["out"], "first": result["first"], **flat}


def figures(stage1: dict, stage2: dict, loop: float, updates: int | None, loads: list) -> dict:
    """One run's row: stage-2 and stage-1 figures, what stage 2 loaded and its processes."""
    keep = {"rank_rss": "rank_mb", "launcher_rss": "launcher_mb", "tree_rss": "tree_mb"}
    keep |= {"rank_uss": "rank_uss", "tree_uss": "tree_uss"}
    row = {"first_update_s": stage2["first"], "wall_s": stage2["wall"]}
    row |= {"fixed_s": stage2["wall"] - loop} | {new: stage2.get(k, 0.0) for k, new in keep.items()}
    row |= {"s1_wall_s": stage1["wall"], "s1_largest_mb": stage1["largest_rss"]}
    row |= {"s1_tree_mb": stage1["tree_rss"], "updates": updates, "loads": loads}
    named = [k[:-4] for k in stage2 if k.endswith("_rss") and k not in ("tree_rss", "largest_rss")]
    return row | {"processes": sorted(named)}


def splitstage(
    job: dict, work: Path, steps: int, stage1_only: bool = False, trackers: str = "none"
) -> dict:
    """`preprocess` then `train` with the real CLI, as bench_startup.measure runs them (only
    `preprocess` with `stage1_only`: its watch figures and its report's memory); `trackers`:
    `tracking.report_to` ("none" as DiffSynth's example, which logs to no tracker)."""
    train = job["train"] | {"learning_rate": LR, "weight_decay": DECAY, "max_steps": steps}
    train |= {"epochs": math.ceil(steps / SAMPLES), "log_every": 1, "checkpoint_every": 10_000}
    cache = {"url": str(work / "cache"), "shard_samples": SAMPLES}
    document = {"job": {"name": "peer", "seed": 0}, **job, "cache": cache}
    document |= {"output": {"url": str(work / "out")}, "train": train}
    document["tracking"] = {"report_to": trackers}
    document["train"]["scratch_dir"] = str(work / "runs")
    config = work / "job.toml"
    config.write_text(toml(document))
    cli = [str(SIDE_PYTHON), "-c", MAIN]
    stage1 = watch([*cli, "preprocess", str(config), "--json"], work, "preprocess", role)
    if stage1_only:
        return stage1 | {"memory": last_json(stage1["out"]).get("memory") or {}}
    stage2 = watch([*cli, "train", str(config), "--json"], work, "train", role, mark="update 1/")
    report = last_json(stage2["out"])
    loop, loads = sum(report.get("step_seconds") or []), report.get("models_loaded")
    row = figures(stage1, stage2, loop, report.get("updates"), [f"slots {loads}"])
    return row | {"s1_memory": last_json(stage1["out"]).get("memory") or {}}


def last_json(out: str) -> dict:
    """The JSON document a `--json` command printed last (after any log lines)."""
    text = "\n" + out
    return json.loads(text[text.rindex("\n{") :])


def diffsynth(
    job: dict, data: Path, work: Path, steps: int, targets: str, stage1_only: bool = False
) -> dict:
    """`accelerate launch` of the driver: sft:data_process, then sft:train from its .pth files
    (only sft:data_process with `stage1_only`: its watch figures)."""
    driver = work / "diffsynth_driver.py"
    driver.write_text(DRIVER)
    pipeline = job["pipeline"]
    paths = pipeline["model_paths"]
    dit = [p for p in paths if Path(p).name.startswith("dit")]
    common = [
        *("--model_paths", json.dumps(paths), "--tokenizer_path", pipeline["tokenizer_path"]),
        *("--register", str(Path(pipeline["tokenizer_path"]).parent / "models.json")),
        *("--height", "32", "--width", "32", "--data_file_keys", "image"),
        *("--lora_base_model", "dit", "--lora_target_modules", targets, "--lora_rank", "4"),
        *("--learning_rate", str(LR), "--weight_decay", str(DECAY), "--num_epochs", "1"),
        *("--remove_prefix_in_ckpt", "pipe.dit."),
    ]
    launch = [str(SIDE_PYTHON), *ACCELERATE, str(driver), *common]
    cache = work / "cache"
    stage1 = watch(
        [*launch, "--dataset_base_path", str(data), "--dataset_metadata_path",
         str(data / "metadata.csv"), "--output_path", str(cache), "--offload_models",
         ",".join(dit), "--task", "sft:data_process"],
        work, "data_process", diffsynth_role,
    )  # fmt: skip
    if stage1_only:
        return stage1
    stage2 = watch(
        [*launch, "--dataset_base_path", str(cache), "--max_data_items", str(steps),
         "--output_path", str(work / "out"), "--offload_models",
         ",".join(p for p in paths if p not in dit), "--task", "sft:train"],
        work, "sft_train", diffsynth_role, mark="diffsynth update 1/",
    )  # fmt: skip
    seconds = [float(s) for s in re.findall(r"diffsynth update \d+/\d+ ([\d.]+)s", stage2["out"])]
    loads = re.findall(r'Loading models from: "([^"]+)"', stage2["out"])
    return figures(stage1, stage2, sum(seconds), len(seconds), [Path(p).name for p in loads])


TITLES = "launch->1st upd s,s2 wall s,s2 fixed s,s2 trainer MB,s2 launcher MB,s2 tree MB,"
TITLES += "s2 trainer USS,s2 tree USS,s1 wall s,s1 largest MB,s1 tree MB,updates"
KEYS = "first_update_s wall_s fixed_s rank_mb launcher_mb tree_mb rank_uss tree_uss s1_wall_s"
COLUMNS = list(zip((KEYS + " s1_largest_mb s1_tree_mb updates").split(), TITLES.split(",")))
GOALS = {"rank_mb": 1.05, "first_update_s": 1.2}


# The larger text encoders of --stage1-sizes, written in bf16 (the pipeline's dtype, as a real
# encoder's file is), in two sizes of one shape: the second adds only layers, so what its peak
# adds per MB of model is the model's own cost (the goal's 1.05), and the first's peak less its
# models is the fixed cost at that width (the process, and a forward's transient activations,
# which grow with width and tokens, not with depth). wide: Z-Image's text encoder's own layer
# widths (Qwen3-4B: hidden 2560, MLP 9728; tiny attention), 1 and 2 layers (~150 and ~300 MB):
# its ratio of kept hidden states to weights at 512 tokens (~1.8%) is the real one. deep: width
# 32, 256 and 512 layers in thousands of small tensors (per-module and per-tensor costs; at this
# width each layer's hidden state is ~5% of its weights and its transients ~16x). Stage 1
# only: the DiT's cap_feat_dim stays 32.
LARGER = {
    "wide": [
        {"text_encoder": {"layers": n, "hidden_size": 2560, "intermediate_size": 9728}}
        for n in (1, 2)
    ],
    "deep": [{"text_encoder": {"layers": n, "intermediate_size": 1024}} for n in (256, 512)],
}


def with_larger_models(job: dict, folder: Path, kwargs_of: dict) -> dict:
    """The job on tiny Z-Image files with a larger text encoder (`kwargs_of` its constructor
    arguments), in `folder` (all in bf16): stage 1 loads and holds it."""
    script = (
        "import json, sys, torch; from tests.helpers.tiny_diffsynth import write_tiny_models; "
        "print(json.dumps(write_tiny_models('ZImagePipeline', sys.argv[1], "
        f"kwargs_of={kwargs_of!r}, dtype=torch.bfloat16)))"
    )
    done = subprocess.run(
        [str(SIDE_PYTHON), "-c", script, str(folder)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **ENV, "PYTHONPATH": python_path(folder.parent)},
    )
    info = json.loads(done.stdout.strip().splitlines()[-1])
    return job | {"pipeline": job["pipeline"] | info}


def stage1_sizes(job: dict, out: Path, targets: str, repeats: int, shape: str) -> None:
    """Stage 1 of both tools with the tiny files and two larger text encoders of one shape: what
    each extra MB of stage-1 model costs at the peak. The goal: splitstage's peak <= a fixed
    baseline + 1.05x the stage-1 models' own size, the baseline being the first larger run's
    peak less its models (the process and the forward at that width)."""
    jobs = {"tiny": job}
    for i, kwargs_of in enumerate(LARGER[shape], 1):
        jobs[f"{shape}{i}"] = with_larger_models(
            job, out / "assets" / f"zimage-{shape}{i}", kwargs_of
        )
    peaks: dict[tuple[str, str], float] = {}
    models: dict[str, float] = {}
    for _ in range(repeats):
        for size, body in jobs.items():
            for tool in ("splitstage", "diffsynth"):
                work = out / "runs" / f"s1-{tool}-{size}-{time.time_ns()}"
                work.mkdir(parents=True)
                if tool == "splitstage":
                    row = splitstage(body, work, 1, stage1_only=True)
                    models[size] = row["memory"]["models_mb"]
                else:
                    row = diffsynth(body, out / "assets/data", work, 1, targets, stage1_only=True)
                key = (tool, size)
                peaks[key] = min(peaks.get(key, math.inf), row["largest_rss"])
                print(tool, size, f"{row['largest_rss']:.0f} MB", flush=True)
    sizes = list(jobs)
    print(
        "\nstage 1, largest process peak RSS (MB); stage-1 models' own size (splitstage's "
        "report): " + ", ".join(f"{size} {models[size]:.1f} MB" for size in sizes)
    )
    for tool in ("splitstage", "diffsynth"):
        steps = [
            f"{a}->{b} {(peaks[(tool, b)] - peaks[(tool, a)]) / (models[b] - models[a]):5.2f}"
            for a, b in zip(sizes, sizes[1:])
        ]
        cells = "  ".join(f"{size} {peaks[(tool, size)]:6.0f}" for size in sizes)
        print(f"  {tool:<11} {cells}   per model MB: {'  '.join(steps)}")
    first, last = sizes[1], sizes[-1]
    base = peaks[("splitstage", first)] - models[first]
    bound = base + 1.05 * models[last]
    peak = peaks[("splitstage", last)]
    forward = base - (peaks[("splitstage", "tiny")] - models["tiny"])
    print(
        f"splitstage: peak {peak:.0f} MB at {last}; fixed baseline {base:.0f} MB ({first}'s peak "
        f"less its models; {forward:+.0f} MB over the tiny run's: the forward at this width) + "
        f"1.05 x {models[last]:.0f} MB = {bound:.0f} MB: {'met' if peak <= bound else 'NO'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="runs per tool; minimum kept")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-diffsynth-peer"))
    parser.add_argument(
        "--stage1-sizes", action="store_true", help="only stage 1, at two text-encoder sizes"
    )
    parser.add_argument(
        "--stage1-shape",
        choices=tuple(LARGER),
        default="wide",
        help="--stage1-sizes' larger text encoder: wide (a real encoder's proportions) or deep",
    )
    parser.add_argument(
        "--trackers",
        choices=("none", "auto"),
        default="none",
        help="splitstage's tracking.report_to: none (as DiffSynth's example) or auto (TensorBoard)",
    )
    args = parser.parse_args()
    if not SIDE_PYTHON.exists():
        raise SystemExit(f"no {SIDE_PYTHON}: DiffSynth-Studio's side environment is needed")
    args.out.mkdir(parents=True, exist_ok=True)
    job = write_assets(args.out, ["diffsynth"])["diffsynth"]  # puts ROOT on sys.path
    from splitstage.pipelines.diffsynth.config import PIPELINES

    targets = ",".join(PIPELINES["ZImagePipeline"][1])  # splitstage's default LoRA targets
    if args.stage1_sizes:
        stage1_sizes(job, args.out, targets, args.repeats, args.stage1_shape)
        return
    results: dict[str, dict] = {}
    for _ in range(args.repeats):  # tools interleaved: a busy box slows both alike
        for tool in ("splitstage", "diffsynth"):
            work = args.out / "runs" / f"{tool}-{time.time_ns()}"
            work.mkdir(parents=True)
            if tool == "splitstage":
                row = splitstage(job, work, args.steps, trackers=args.trackers)
            else:
                row = diffsynth(job, args.out / "assets/data", work, args.steps, targets)
            print(tool, json.dumps(row), flush=True)
            kept = results.setdefault(tool, row)
            for key, value in row.items():  # the least disturbed run of each figure
                if isinstance(value, float) and kept[key] is not None:
                    kept[key] = min(kept[key], value)
    print(f"\ntiny Z-Image, {args.steps} updates, batch 1, 1 training process, CPU")
    print(f"{'tool':<11}" + " ".join(f"{title:>17}" for _, title in COLUMNS))
    for tool, row in results.items():
        cells = [
            f"{row[k] or 0:.1f}" if k.endswith("_s") else f"{row[k] or 0:.0f}" for k, _ in COLUMNS
        ]
        print(f"{tool:<11}" + " ".join(f"{cell:>17}" for cell in cells))
    print("\nratios splitstage / DiffSynth (lower is better)")
    ours, theirs = results["splitstage"], results["diffsynth"]
    for key, title in COLUMNS[:-1]:
        if theirs[key] and ours[key] is not None:
            ratio, goal = ours[key] / theirs[key], GOALS.get(key)
            met = "" if goal is None else f"   goal <= {goal}: {'met' if ratio <= goal else 'NO'}"
            print(f"  {title:<18} {ratio:6.2f}{met}")
    for tool, row in results.items():
        print(f"{tool} stage 2 loaded {row['loads']}; processes {row['processes']}")
    memory = results["splitstage"].get("s1_memory") or {}
    if memory:  # at these sizes the models are noise: --stage1-sizes measures their cost
        base, models, peak = (memory[k] for k in ("before_models_mb", "models_mb", "peak_rss_mb"))
        print(
            f"splitstage stage 1 (its report): {base:.0f} MB before the models, peak {peak:.0f} MB"
            f" (models' own size {models:.1f} MB; per-MB cost: --stage1-sizes)"
        )


if __name__ == "__main__":
    main()
