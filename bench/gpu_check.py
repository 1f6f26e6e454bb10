"""A prepared check for one CUDA GPU without network: SD 1.5 / SDXL split vs unsplit, memory levers.

Run: bash bench/gpu_check.sh [--budget 468] [--keep] [--only levers]   (CPU smoke: --cpu-smoke)

Builds the real architectures from their configs with random weights (SD 1.5: UNet 860M, CLIP-L,
VAE; SDXL base: UNet 2.6B, CLIP-L + CLIP-G, VAE) as diffusers folders (bf16, save_pretrained) in a
temp dir. Text models keep their real 49408-row token tables; the tiny tokenizers of
`tests.helpers.tiny_diffusers` index the first 514 rows (bos/eos set to their ids), so widths,
depths and parameter counts are the real ones. Then, on the GPU:
  1. stage 1: text + VAE encoding of N samples in bf16 (SD at 512 px, SDXL at 1024 px)
  2. stage-2 step vs unsplit step, medians of 10 interleaved after warm-up (batch 4 SD at 512,
     batch 2 SDXL at 1024; LoRA rank 16 on an fp32 denoiser under bf16 autocast, as stage 2 trains)
  3. peak CUDA memory of stage 2 (only its models on the GPU) vs unsplit (all of them)
  4. a FLUX.1-dev-size transformer (11.9B, random bf16 weights built on the GPU, no file): the
     flux family's own LoRA training step (rank 16) at 1024 px, batch 1, gradient checkpointing
     through the family's hook: peak CUDA memory and step time, checkpointing on and off
  5. torchrun --nproc_per_node 1: an all_reduce through splitstage's process-group set-up, and the
     real launcher (`train`) on a tiny SD folder: the backend it used (NCCL's log) and its step time
  6. the memory plan (`splitstage validate`'s estimate, fake tensors) against the same stage-2
     micro-step on the real models for SD 1.5 and SDXL: torch.cuda.max_memory_allocated, within
     10% (the issue's promise), and torch's tracker on the real tensors
  7. the memory levers (bench/gpu_levers.py): FLUX.1-dev-size and Qwen-Image-size (20.4B)
     transformers built by stage 2's own functions, random bf16 weights made on the GPU, a LoRA
     step at 1024 px with checkpointing for a bf16 base, each `train.base_quantization` (int8,
     fp8, nf4), `train.offload = "cpu"` and an int8 base with half its blocks' frozen weights in
     host memory (`train.offload = N`): peak CUDA memory allocated, median step time and the
     frozen bytes, one row each; they run last, with 80% of their budgets kept for them
`--only GROUP[,GROUP]` runs some groups (device and imports always): torchrun, flux, sd, sdxl,
levers.
Every row has a time budget and the run a hard cap: a row that fails or runs out of time says so
in the table and the script still exits 0. Without CUDA it says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

try:
    import torch
except ImportError as _error:  # main() says so in one line
    torch, TORCH_ERROR = None, _error

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
QUIET = {"TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
for _name, _value in {**QUIET, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}.items():
    os.environ.setdefault(_name, _value)

# kind: (width divisor, resolution, batch, samples encoded, encode batch); then rounds, warm-up
FULL = {"sd": (1, 512, 4, 64, 8), "sdxl": (1, 1024, 2, 32, 4), "rounds": 4, "warmup": 1}
SMOKE = {"sd": (16, 64, 2, 8, 4), "sdxl": (16, 64, 2, 4, 2), "rounds": 3, "warmup": 1}
# FLUX.1-dev's transformer config (11.9B parameters) and its step at 1024 px; the smoke one tiny
FLUX_DEV = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
FLUX_SMOKE = FLUX_DEV | {
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "joint_attention_dim": 64,
    "pooled_projection_dim": 32,
    "axes_dims_rope": (8, 12, 12),
}
FLUX_STEP = {"full": (FLUX_DEV, 1024, 512), "smoke": (FLUX_SMOKE, 64, 16)}  # config, px, tokens
ARCH = {"sd": "SD 1.5", "sdxl": "SDXL base"}
GROUPS = ("torchrun", "flux", "sd", "sdxl", "levers")
CAP = 468  # seconds of the whole GPU check: under 8 minutes with Python's start and the table
LEVERS_SHARE = 0.8  # of the lever rows' budgets, kept for them from the start


class Skipped(Exception):
    """A row that cannot run (what it needs failed or was skipped above)."""


class Check:
    """Rows of (name, result), each run under its own time budget inside a hard total cap."""

    def __init__(self, cap: float):
        self.start, self.cap, self.rows, self.deadline = time.monotonic(), cap, [], 0.0
        self.reserve = 0.0  # seconds of the cap kept for rows still to come

    def left(self) -> float:
        """Seconds left of the total cap, less what is reserved for later rows."""
        return self.cap - (time.monotonic() - self.start) - self.reserve

    def row_left(self) -> float:
        """Seconds left of the running row's budget."""
        return self.deadline - time.monotonic()

    def add(self, name: str, result: str) -> None:
        """Record a row and print it at once (a killed run still shows what it had)."""
        self.rows.append((name, result))
        print(f"[{time.monotonic() - self.start:5.0f} s] {name}: {result}", flush=True)

    def run(self, name: str, budget: float, work, need: float = 5.0):
        """Run `work()` (returning a result, or [(name, result), ...]) within `budget` seconds."""
        if self.left() < need:
            return self.add(name, "skipped: time")
        limit = min(budget, self.left())
        self.deadline = time.monotonic() + limit
        signal.signal(signal.SIGALRM, _out_of_time)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            results = work()
        except Skipped as error:
            return self.add(name, f"skipped: {error}")
        except BaseException as error:  # every failure becomes one table row
            if isinstance(error, KeyboardInterrupt):
                raise
            reason = " ".join(str(error).split())[:160] or type(error).__name__
            return self.add(name, f"FAILED: {type(error).__name__}: {reason}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for row, result in results if isinstance(results, list) else [(name, results)]:
            self.add(row, result)
        return results


def _out_of_time(signum, frame):
    """SIGALRM: the running row's budget is spent."""
    raise TimeoutError("its time budget ran out")


def importable_splitstage() -> None:
    """Make `splitstage.*` importable here and in torchrun's workers without installing it."""
    try:
        import splitstage.tasks.launch.launcher  # noqa: F401

        return
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("splitstage"):
            raise
    shim = Path(tempfile.mkdtemp(prefix="splitstage-shim-"))
    (shim / "splitstage").mkdir()
    package = ROOT / "splitstage"
    (shim / "splitstage/__init__.py").write_text(
        f"__path__ = [{str(package)!r}, {str(ROOT)!r}]\n"
        f"exec(open({str(package / '__init__.py')!r}).read())\n"
    )
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), os.getenv("PYTHONPATH")]))
    for module in [m for m in sys.modules if m.split(".")[0] == "splitstage"]:
        del sys.modules[module]


def gib(count: float) -> str:
    """Bytes in GiB, one decimal."""
    return f"{count / 2**30:.1f} GiB"


def describe(device) -> str:
    """The device, its memory and the torch build."""
    cuda = torch.version.cuda
    if device.type != "cuda":
        return f"cpu (smoke test), torch {torch.__version__}, CUDA build {cuda}"
    props = torch.cuda.get_device_properties(device)
    return (
        f"{props.name}, {gib(props.total_memory)}, torch {torch.__version__}, CUDA {cuda}, "
        f"bf16 {torch.cuda.is_bf16_supported()}, {torch.cuda.device_count()} GPU(s)"
    )


def imports() -> str:
    """splitstage importable (a path shim when not installed) and the library versions."""
    importable_splitstage()
    import diffusers
    import peft
    import transformers

    libraries = (torch, diffusers, transformers, peft)
    return ", ".join(f"{m.__name__} {m.__version__}" for m in libraries)


def build_folder(kind: str, size: tuple, device, work: Path, state: dict):
    """Write the (full-size) folder of `kind`, built on the device, saved in bf16."""
    from bench_families import REAL_VOCAB, write_folder

    started = time.perf_counter()
    folder = work / kind
    with torch.device(device):
        numbers = write_folder(kind, folder, size[0], {"clip": REAL_VOCAB["clip"]}, torch.bfloat16)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    state[kind] = {"folder": folder}
    written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    params = ", ".join(
        f"{name.replace('vae', 'vae encoder')} {n[0] / 1e6:.1f}M" for name, n in numbers.items()
    )
    return f"{params} params; {gib(written)} written in {time.perf_counter() - started:.0f} s"


def load_steps(kind: str, size: tuple, device, work: Path, state: dict):
    """Load every model of the folder and prepare the batch the steps train on."""
    from bench_families import Steps, job_config

    from splitstage.data.digits import write_digits_dataset

    if kind not in state:
        raise Skipped(f"no {kind} folder (see its build row)")
    started = time.perf_counter()
    write_digits_dataset(work / "data", limit=8, size=64)
    rank = 16 if size[0] == 1 else 4
    config = job_config(kind, state[kind]["folder"], work, *size[1:3], 77, rank, "bf16")
    state[kind]["steps"] = steps = Steps(config, device, torch.bfloat16)
    names = ", ".join(f"{n} {next(m.parameters()).dtype}" for n, m in steps.models.items())
    v2 = [u.spec.name for u in steps.plan.v2_units]
    return f"{names}; V2 {v2}; {time.perf_counter() - started:.0f} s"


def encode(kind: str, size: tuple, device, state: dict):
    """Stage 1 without I/O: the V2 units over N decoded samples, batched, under no_grad."""
    from bench_families import timed

    from splitstage.pipelines.runtime import collate_samples, run_units

    steps = _steps(state, kind)
    count, per = size[3], size[4]
    rows = (steps.rows * count)[:count]  # the data set's first rows, repeated
    samples = [steps.family.load_sample(row, steps.base) for row in rows]
    batches = [collate_samples(samples[i : i + per]) for i in range(0, count, per)]
    ctx = steps.context(0)

    def stage1(batch):
        with torch.no_grad():
            run_units(steps.plan.v2_units, ctx, {k: _to(v, device) for k, v in batch.items()})

    timed(lambda: stage1(batches[0]), device)  # warm-up
    seconds = sum(timed(lambda b=b: stage1(b), device) for b in batches)
    rate = f"{count / seconds:.1f} samples/s"
    return f"{count} samples in {seconds:.2f} s = {rate} (batch {per}, {size[1]} px)"


def step_times(kind: str, size: tuple, device, state: dict, check: Check, sizes: dict):
    """Interleaved stage-2 / unsplit steps; medians after warm-up (fewer if the budget runs low)."""
    from bench_families import timed

    steps, rounds, warmup = _steps(state, kind), sizes["rounds"], sizes["warmup"]
    times: dict[str, list[float]] = {"split": [], "unsplit": []}
    for index in range(warmup + rounds):
        for name in times:
            times[name].append(timed(getattr(steps, name), device))
        spent = sum(map(sum, zip(*times.values(), strict=True))) / (index + 1)
        if check.row_left() < 2 * spent + 2:
            break
    done = max(1, len(times["split"]) - warmup)
    split, unsplit = (statistics.median(t[-done:]) for t in times.values())
    where = f"median of {done}, batch {size[2]}, {size[1]} px"
    return f"{split * 1e3:.0f} ms / {unsplit * 1e3:.0f} ms = {split / unsplit:.3f} ({where})"


def peak_memory(kind: str, device, state: dict):
    """Peak CUDA memory of 2 steps each: only the stage-2 models on the GPU, then all of them."""
    steps = _steps(state, kind)
    if device.type != "cuda":
        steps.split(), steps.unsplit()  # the same code path; CPU has no peak counter
        return "n/a on CPU (steps ran)"
    offloaded = [n for n in steps.models if n not in steps.plan.split.models["stage2"]]
    peaks = {}
    for name, where in (("split", "cpu"), ("unsplit", device)):
        for model in offloaded:
            steps.models[model].to(where)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(2):
            getattr(steps, name)()
        torch.cuda.synchronize(device)
        peaks[name] = torch.cuda.max_memory_allocated(device)
    ratio, off = peaks["split"] / peaks["unsplit"], f"stage 2 leaves {offloaded} off the GPU"
    return f"{gib(peaks['split'])} / {gib(peaks['unsplit'])} = {ratio:.3f} ({off})"


def flux_step(device, work: Path, smoke: bool, check: Check):
    """The flux family's LoRA step on a FLUX.1-dev-size transformer: rows for checkpointing on
    and off (peak CUDA memory, median step time of 3 after a warm-up)."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from splitstage.config.job import config_from_dict
    from splitstage.pipelines.draws import Draws
    from splitstage.pipelines.runtime import StepContext
    from splitstage.tasks.job_plan import make_plan
    from tests.helpers.tiny_diffusers import write_tiny_folder

    arch, pixels, tokens = FLUX_STEP["smoke" if smoke else "full"]
    folder = write_tiny_folder("flux", work / "flux-small")  # the scheduler and the settings
    pipeline = {"name": "flux", "pretrained": str(folder), "resolution": pixels}
    config = config_from_dict(
        {
            "job": {"name": "gpu-check"},
            "pipeline": pipeline | {"max_prompt_length": tokens},
            "trainable": {"lora_base_model": "transformer", "lora_rank": 16},
            "data": {"base_path": str(work / "data")},
            "cache": {"url": str(work / "cache")},
            "output": {"url": str(work / "out")},
        }
    )
    family = make_plan(config).family
    with torch.device("meta"):
        model = FluxTransformer2DModel(**arch)
    model.to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    model.to(torch.bfloat16).requires_grad_(False)
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=targets))
    trained = [p for p in model.parameters() if p.requires_grad]
    for param in trained:
        param.data = param.data.float()  # LoRA in fp32 over a bf16 base, as stage 2 holds it
    optimizer = torch.optim.AdamW(trained, lr=1e-4)
    count = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device).manual_seed(0)
    latent = pixels // 8
    inputs = {
        "input_latents": torch.randn(1, 16, latent, latent, generator=g, device=device),
        "prompt_embeds": torch.randn(
            1, tokens, arch["joint_attention_dim"], generator=g, device=device
        ),
        "pooled_prompt_embeds": torch.randn(
            1, arch["pooled_projection_dim"], generator=g, device=device
        ),
    }

    def step(seed: int) -> None:
        ctx = StepContext(
            {"transformer": model},
            device,
            Draws.shared(torch.Generator(device).manual_seed(seed)),
            family.settings(),
        )
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = family.training_loss(ctx, dict(inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    rows = []
    for checkpointing in (True, False):
        if checkpointing:
            family.enable_gradient_checkpointing("transformer", model)
        else:
            model.disable_gradient_checkpointing()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        step(0)  # warm-up
        seconds = []
        for seed in (1, 2, 3):
            if check.row_left() < 3 * (seconds[-1] if seconds else 10.0):
                break
            started = time.perf_counter()
            step(seed)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - started)
        peak = gib(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else "n/a"
        timing = f"{statistics.median(seconds):.2f} s/step" if seconds else "no timed step"
        label = "on" if checkpointing else "off"
        rows.append(
            (
                f"flux ({count / 1e9:.1f}B) LoRA step {pixels} px, checkpointing {label}",
                f"peak {peak}, {timing}",
            )
        )
    return rows  # the model and its optimizer go with this frame (release() collects)


ESTIMATE_TOLERANCE = 0.10  # the memory plan's promise on a GPU: within 10% of the allocator


def memory_estimate(kind: str, device, state: dict):
    """The memory plan's stage-2 estimate for this job (`splitstage validate`'s, fake tensors)
    against the same micro-step on the real models: torch.cuda.max_memory_allocated above what
    was allocated before (the estimate's CUDA-context allowance left out: the allocator does
    not see it), and torch's tracker on the real tensors."""
    from splitstage.tasks.memory.measured_step import measure_stage1, measure_stage2
    from splitstage.tasks.memory.memory_plan import estimate_memory

    steps = state.get(kind, {}).pop("steps", None)  # the split/unsplit rows' models: freed
    if steps is None:
        raise Skipped(f"no {kind} models (see its load row)")
    plan = steps.plan
    del steps
    gc.collect()
    parts = estimate_memory(plan, device).stage2.parts
    estimate = sum(v for k, v in parts.items() if k != "cuda_context")
    _, cached = measure_stage1(plan, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    tracked = sum(measure_stage2(plan, cached, device).values())
    if device.type != "cuda":
        return f"estimate {mib(estimate)} / tracked {mib(tracked)} = {estimate / tracked:.3f} (CPU)"
    torch.cuda.synchronize(device)
    allocated = torch.cuda.max_memory_allocated(device) - before
    ratio = estimate / allocated
    verdict = "within" if abs(ratio - 1) <= ESTIMATE_TOLERANCE else "OUTSIDE"
    return (
        f"estimate {mib(estimate)} / max_memory_allocated {mib(allocated)} = {ratio:.3f} "
        f"({verdict} {ESTIMATE_TOLERANCE:.0%}; tracked {mib(tracked)})"
    )


def mib(count: float) -> str:
    """Bytes as MiB (the smoke sizes are a few MiB, the real ones thousands)."""
    return f"{count / 2**20:.1f} MiB"


def release(kind: str, device, state: dict) -> None:
    """Free the family's models before the next one."""
    state.get(kind, {}).pop("steps", None)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not state.get("keep"):
        shutil.rmtree(state.get(kind, {}).get("folder", "/nonexistent"), ignore_errors=True)


ALL_REDUCE = """
import torch, torch.distributed as dist
from splitstage.tasks.stage2.distributed import close_distributed, init_distributed
info = init_distributed()
value = torch.full((4,), float(info.rank + 1), device=info.device)
dist.all_reduce(value)
print(f"ALLREDUCE backend={dist.get_backend()} device={info.device} world={info.world_size}",
      f"sum={value[0].item()}")
close_distributed()
"""


def all_reduce(device, work: Path, check: Check):
    """torchrun --nproc_per_node 1 with splitstage's init_distributed: the backend and a sum."""
    script = work / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    env = {**os.environ, "SPLITSTAGE_DEVICE": device.type, "NCCL_DEBUG": "INFO"}
    started, command, limit = (
        time.perf_counter(),
        [*torchrun, "--nproc-per-node=1", str(script)],
        max(1, check.row_left()),
    )
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=limit)
    lines = (done.stdout + done.stderr).splitlines()
    found = [line for line in lines if line.startswith("ALLREDUCE")]
    if done.returncode or not found:
        raise RuntimeError(f"exit {done.returncode}: {(lines or ['no output'])[-1]}")
    nccl = sum("NCCL INFO" in line for line in lines)
    wall = time.perf_counter() - started
    return f"{found[0].removeprefix('ALLREDUCE ')}; {nccl} NCCL log lines; {wall:.1f} s wall"


def launcher(device, work: Path, check: Check):
    """splitstage's real preprocess + train (torchrun, 1 process) on a tiny SD folder."""
    from splitstage.config.job import config_from_dict
    from splitstage.data.digits import write_digits_dataset
    from splitstage.tasks.launch.launcher import train
    from splitstage.tasks.stage1.preprocess import preprocess
    from tests.helpers.tiny_diffusers import write_tiny_folder

    base = work / "tiny"
    write_tiny_folder("sd", base / "sd")
    write_digits_dataset(base / "data", limit=16, size=64)
    config = config_from_dict({
        "job": {"name": "gpu-check", "seed": 0},
        "pipeline": {"name": "sd", "pretrained": str(base / "sd"), "resolution": 64},
        "trainable": {"lora_base_model": "unet", "lora_rank": 4},
        "data": {"base_path": str(base / "data")}, "cache": {"url": str(base / "cache")},
        "train": {"batch_size": 4, "max_steps": 12, "epochs": 10, "nproc_per_node": 1,
                  "log_every": 4, "checkpoint_every": 1000},
        "output": {"url": str(base / "out")},
    })  # fmt: skip
    preprocess(config, workers=1, progress=False)
    lines: list[str] = []
    env = {"SPLITSTAGE_DEVICE": device.type, "NCCL_DEBUG": "INFO"}
    limit = max(1, check.row_left() - 2)
    report = train(config, run_root=base / "runs", env=env, on_line=lines.append, timeout=limit)
    if not report.updates:
        raise RuntimeError(f"no update finished; last line: {(lines or ['none'])[-1]}")
    nccl = sum("NCCL INFO" in line for line in lines)
    backend = f"nccl ({nccl} NCCL log lines)" if nccl else "no NCCL log lines (gloo on CPU)"
    step = statistics.median(report.step_seconds[2:] or report.step_seconds or [float("nan")])
    loss = report.losses[-1] if report.losses else float("nan")
    run = f"{report.updates} updates on {report.world_size} rank(s), models loaded "
    run += f"{report.models_loaded}, median step {step * 1e3:.1f} ms, final loss {loss:.4f}"
    return [("launcher train(): backend", backend), ("launcher train(): run", run)]


def _steps(state: dict, kind: str):
    """The family's loaded steps, or why there are none."""
    if "steps" not in state.get(kind, {}):
        raise Skipped(f"no {kind} models (see their load row)")
    return state[kind]["steps"]


def _to(value, device):
    """A tensor on the device (other values as they are)."""
    return value.to(device) if hasattr(value, "to") else value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (< 3 min)")
    parser.add_argument("--budget", type=float, default=None, help="hard cap, seconds")
    parser.add_argument("--keep", action="store_true", help="keep the temp folders")
    parser.add_argument(
        "--only", default=",".join(GROUPS), help=f"comma-separated groups of {', '.join(GROUPS)}"
    )
    args = parser.parse_args(argv)
    only = {group.strip() for group in args.only.split(",") if group.strip()}
    if only - set(GROUPS):
        parser.error(f"--only: unknown {', '.join(sorted(only - set(GROUPS)))}; pick of {GROUPS}")
    if torch is None:
        print(f"gpu_check: torch is not importable here ({TORCH_ERROR}); nothing checked")
        return 0
    if not args.cpu_smoke and not torch.cuda.is_available():
        build = f"torch {torch.__version__}, CUDA build {torch.version.cuda}"
        print(f"gpu_check: no CUDA device here ({build}); nothing checked (--cpu-smoke: on CPU)")
        return 0
    torch.set_num_threads(1 if args.cpu_smoke else os.cpu_count() or 1)
    sizes = SMOKE if args.cpu_smoke else FULL
    from gpu_levers import QWEN_IMAGE, QWEN_SMOKE, levers_budget, run_levers

    # The lever rows run last (an untried kernel that breaks the CUDA context breaks only them);
    # 80% of their budgets is kept for them, the rest of the cap goes to the rows before, and
    # what those leave over goes to the levers.
    levers = levers_budget(args.cpu_smoke) if "levers" in only else 0.0
    cap = (110 + LEVERS_SHARE * levers if args.cpu_smoke else CAP) if only - {"levers"} else 0
    check = Check(args.budget or cap or 40 + levers)
    check.reserve = min(LEVERS_SHARE * levers, check.cap / 2)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    work = Path(tempfile.mkdtemp(prefix="splitstage-gpu-check-"))
    state: dict = {"keep": args.keep}
    try:
        check.run("device", 20, partial(describe, device))
        check.run("imports", 60, imports)
        if "torchrun" in only:
            all_reduced = partial(all_reduce, device, work, check)
            check.run("torchrun nproc 1: all_reduce", 60, all_reduced, 15)
            check.run("launcher train()", 90, partial(launcher, device, work, check), 30)
        if "flux" in only:
            flux = partial(flux_step, device, work, args.cpu_smoke, check)
            check.run("flux (FLUX.1-dev size): LoRA step", 40, flux, 30)
            release("flux", device, state)
        for kind in [kind for kind in ("sd", "sdxl") if kind in only]:
            size, label = sizes[kind], f"{kind} ({ARCH[kind]})"
            build = partial(build_folder, kind, size, device, work, state)
            check.run(f"{label}: build folder", 90 if size[0] == 1 else 30, build, 20)
            load = partial(load_steps, kind, size, device, work, state)
            check.run(f"{label}: load models", 60, load, 10)
            encoding = partial(encode, kind, size, device, state)
            check.run(f"{label}: stage 1 encode", 40, encoding, 5)
            timing = partial(step_times, kind, size, device, state, check, sizes)
            check.run(f"{label}: stage-2 step / unsplit step", 60, timing, 10)
            memory = partial(peak_memory, kind, device, state)
            check.run(f"{label}: peak memory stage 2 / unsplit", 40, memory, 5)
            estimated = partial(memory_estimate, kind, device, state)
            check.run(f"{label}: memory plan estimate / measured, stage 2", 60, estimated, 5)
            release(kind, device, state)
        if "levers" in only:
            check.reserve = 0.0
            archs = {"flux": FLUX_DEV, "qwenimage": QWEN_IMAGE}
            if args.cpu_smoke:
                archs = {"flux": FLUX_SMOKE, "qwenimage": QWEN_SMOKE}
            run_levers(check, device, work, args.cpu_smoke, archs)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n| check ({time.monotonic() - check.start:.0f} s of {check.cap:.0f} s) | result |")
    print("|---|---|")
    for name, result in check.rows:
        print(f"| {name} | {result.replace('|', '/')} |")
    out = os.environ.get("OUT")
    if out and Path(out).is_dir():
        (Path(out) / "gpu_check.json").write_text(json.dumps(check.rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
