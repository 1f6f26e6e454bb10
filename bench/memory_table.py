"""docs/memory-table.md: LoRA rank 32 and full fine-tuning of six public models on 24, 48 and
80 GiB GPUs, as splitstage's memory plan and `train.fit = "auto"` compute them.

Run: .venv/bin/python bench/memory_table.py --write [--models flux1dev,...]   (rebuild the page's
     rows of those models, default all: about an hour on 2 CPU cores)
     .venv/bin/python bench/memory_table.py --check [--models sd15]   (exit 1 when stale)

Each model is a config-only folder (tests/helpers/public_configs: the public config values, no
weights, stand-in tokenizers). Per model and training: the job's stage-2 estimate at its
defaults (`estimate_memory`, as `validate` computes it), then fit's candidates in fit's order
(`fit_candidates`, `usable`), each estimated once and shared by the three budgets: for each
budget the first candidate under it, as `choose_fit` picks (tests/unit/test_memory_table.py
checks the two agree). The estimate runs on this CPU with `mixed_precision = "bf16"` (a GPU's
dtypes); validate on a GPU adds `CUDA_ALLOWANCE_BYTES`, so every figure here includes it and
fit runs against the budget less it: the choice validate makes on that GPU.
"""

from __future__ import annotations

import argparse
import fcntl
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from splitstage.config.job import ConfigError, config_from_dict  # noqa: E402
from splitstage.tasks.job_plan import JobPlan, make_plan  # noqa: E402
from splitstage.tasks.memory.fit import (  # noqa: E402
    FitChoice,
    Overrides,
    apply_fit,
    fit_candidates,
    usable,
)
from splitstage.tasks.memory.memory_plan import (  # noqa: E402
    CUDA_ALLOWANCE_BYTES,
    GIB,
    estimate_memory,
    gib,
)
from tests.helpers.public_configs import configs_digest, write_config_folder  # noqa: E402

PAGE = Path(__file__).resolve().parents[1] / "docs" / "memory-table.md"
BUDGETS_GIB = (24, 48, 80)
LORA_RANK = 32
DEVICE = torch.device("cpu")  # fake tensors; the GPU's context is added (module docstring)
WAN_FRAMES, WAN_SIZE = 81, (480, 832)


@dataclass(frozen=True)
class Model:
    """One public model: its config folder, family, trained component and usual size."""

    key: str  # its folder under tests/helpers/public_configs
    title: str
    family: str
    denoiser: str
    resolution: int
    size_words: str


MODELS = (
    Model("sd15", "SD 1.5", "sd", "unet", 512, "512 px"),
    Model("sdxl", "SDXL 1.0", "sdxl", "unet", 1024, "1024 px"),
    Model("sd35m", "SD3.5 Medium", "sd3", "transformer", 1024, "1024 px"),
    Model("flux1dev", "FLUX.1-dev", "flux", "transformer", 1024, "1024 px"),
    Model("qwenimage", "Qwen-Image", "qwenimage", "transformer", 1024, "1024 px"),
    Model("wan21_14b", "Wan 2.1 T2V 14B", "wan", "transformer", 480, "81 x 480 x 832"),
)
TRAININGS = {"lora": f"LoRA r{LORA_RANK}", "full": "full"}


def job(model: Model, folder: Path, training: str) -> dict[str, Any]:
    """The job a user would write: batch 1, AdamW, bf16, everything else at its default."""
    root = folder.parent
    document = {
        "job": {"name": f"table-{model.key}-{training}"},
        "data": {"base_path": str(root / "data")},
        "cache": {"url": str(root / "cache")},
        "output": {"url": str(root / "out")},
        "preprocess": {"batch_size": 1},
        "pipeline": {"name": model.family, "pretrained": str(folder)},
        "train": {"batch_size": 1, "optimizer": "adamw", "mixed_precision": "bf16"},
    }
    document["pipeline"]["resolution"] = model.resolution
    if model.family == "wan":  # 480 x 832 clips: the one largest bucket of that area
        height, width = WAN_SIZE
        document["data"]["video"] = {"num_frames": WAN_FRAMES}
        document["data"]["buckets"] = {
            "enabled": True,
            "area": height * width,
            "step": 32,
            "min_side": height,
            "max_side": width,
        }
    if training == "lora":
        document["trainable"] = {"lora_base_model": model.denoiser, "lora_rank": LORA_RANK}
    else:
        document["trainable"] = {"full": [model.denoiser]}
    return document


@dataclass
class Cell:
    """One training of one model: the default estimates and fit's candidates with theirs
    (bytes as `estimate_memory` gives them on this CPU: no CUDA allowance)."""

    stage1: int
    stage2: int
    candidates: list[tuple[Overrides, int]]  # usable candidates in fit's order, estimated

    def choice(self, budget: int) -> FitChoice | None:
        """What fit does under `budget` (None: nothing fits): `choose_fit`'s rule."""
        if self.stage2 <= budget:
            return FitChoice({}, "fits", self.stage2)
        for overrides, peak in self.candidates:
            if peak <= budget:
                return FitChoice(overrides, "chosen", peak)
        return None


def fit_cell(plan: JobPlan, smallest: int) -> Cell:
    """The plan's estimate, then fit's candidates, each estimated once, until one is under
    the `smallest` budget (the larger budgets' choices are among them)."""
    memory = estimate_memory(plan, DEVICE)
    assert memory.stage1 is not None and memory.stage2 is not None
    cell = Cell(memory.stage1.peak_bytes, memory.stage2.peak_bytes, [])
    if cell.stage2 <= smallest:
        return cell
    for overrides in fit_candidates(plan.config, DEVICE):
        config = plan.config.model_copy(deep=True)
        apply_fit(config, overrides)
        if not usable(config, plan):
            continue
        try:
            fitted = estimate_memory(make_plan(config), DEVICE)
        except (ConfigError, NotImplementedError):  # as choose_fit: the family refuses it
            continue
        assert fitted.stage2 is not None
        cell.candidates.append((overrides, fitted.stage2.peak_bytes))
        if fitted.stage2.peak_bytes <= smallest:
            break
    return cell


def model_rows(model: Model, workdir: Path) -> list[str]:
    """The table rows of one model (LoRA, then full), estimated from its config folder; every
    figure with the CUDA allowance, every budget less it (module docstring)."""
    folder = write_config_folder(model.key, workdir / model.key / "pretrained")
    (folder.parent / "data").mkdir()
    budgets = [size * GIB - CUDA_ALLOWANCE_BYTES for size in BUDGETS_GIB]
    rows = []
    for training, words in TRAININGS.items():
        plan = make_plan(config_from_dict(job(model, folder, training)))
        cell = fit_cell(plan, min(budgets))
        outcomes = [outcome_words(cell.choice(budget), cell) for budget in budgets]
        rows.append(
            f"| {model.title} | {model.size_words} | {words} | {on_gpu(cell.stage1)} | "
            f"{on_gpu(cell.stage2)} | " + " | ".join(outcomes) + " |"
        )
    return rows


def on_gpu(peak: int) -> str:
    """An estimate as validate gives it on a GPU, in GiB: the CUDA allowance added."""
    return gib(peak + CUDA_ALLOWANCE_BYTES)


def outcome_words(choice: FitChoice | None, cell: Cell) -> str:
    """A budget's cell: 'fits', the levers fit chose and their estimate, or 'does not fit'."""
    if choice is None:
        lowest = min((peak for _, peak in cell.candidates), default=cell.stage2)
        return f"does not fit (lowest {on_gpu(lowest)})"
    if choice.outcome == "fits":
        return "fits"
    levers = ", ".join(
        name if value is True else f"{name} {value}" for name, value in choice.overrides.items()
    )
    assert choice.peak_bytes is not None
    return f"{levers}: {on_gpu(choice.peak_bytes)}"


def page(rows: Sequence[str]) -> str:
    """docs/memory-table.md around the rows."""
    budgets = " | ".join(f"{size} GiB" for size in BUDGETS_GIB)
    return "\n".join(
        [
            "# Memory before you rent a GPU",
            "",
            'Stage 2\'s peak device memory per rank (GiB), and what `train.fit = "auto"` does on '
            "a GPU of each size, for LoRA rank 32 and full fine-tuning of six public models at "
            "their usual sizes. Computed by splitstage itself (on a GPU, `splitstage validate "
            "--device-memory SIZE` of the same job gives the same figures; on a CPU 1 GiB "
            "less, see below): each model built "
            "on the meta device from its public config values, one stage-1 batch and one "
            "stage-2 micro-step of the ranks' own code run on fake tensors under torch's "
            "`MemTracker` ([job-config.md](job-config.md#the-training-step-train)). No weights "
            "are read or downloaded.",
            "",
            'The job: one GPU, `train.batch_size = 1`, `optimizer = "adamw"` (torch; full '
            'fine-tuning holds fp32 weights and two fp32 moments), `mixed_precision = "bf16"` '
            "(a LoRA's frozen base in bf16, its adapters fp32), `preprocess.batch_size = 1`, "
            "every other setting at its default (gradient checkpointing off). Prompts at each "
            "family's full token count; Wan: 81 frames of 832 x 480 (the largest bucket of "
            "480 x 832's area; the same memory). Every figure includes the 1 GiB validate adds "
            "on a GPU for the CUDA context and the allocator.",
            "",
            "- **stage 1**: one preprocess worker (text encoders and VAE, batch 1). Stage 1 and "
            "stage 2 are separate jobs: a smaller GPU than stage 1 needs can still train, with "
            "the cache written elsewhere.",
            "- **stage 2 as configured**: one training rank at the settings above.",
            '- **24 / 48 / 80 GiB**: `train.fit = "auto"` with `train.device_memory` that '
            "size: *fits* (nothing changed), the `[train]` levers it adds (in the order of "
            "[job-config.md](job-config.md#trainfit--auto-the-levers-cheapest-first)) and the "
            "estimate with them, or *does not fit* (validate refuses; the lowest estimate "
            "tried). Levers by their `[train]` field: `gradient_checkpointing` is `= true`, "
            '`base_quantization int8` is `= "int8"`. `offload cpu` keeps the trained '
            "model's weights, gradients and AdamW state in host memory (a full fine-tune: 16 "
            "bytes per parameter), so the host needs that much RAM.",
            "",
            f"| model | size | training | stage 1 | stage 2 as configured | {budgets} |",
            "|---|---|---|---|---|" + "---|" * len(BUDGETS_GIB),
            *rows,
            "",
            "Estimates, not measurements: within 15% of torch's tracker on the same step "
            "(`tests/unit/test_memory_plan_families.py`, tiny models). FSDP over several GPUs "
            "is estimated by torch's `FSDPMemTracker` on the model as `fully_shard` shards it "
            "over a fake process group (rank 0's shards plus the all-gathered blocks, "
            "`gathered_blocks`; within 15% of the per-rank peak measured under torchrun, "
            "`tests/integration/test_memory_fsdp.py`; not shown: one GPU here).",
            "",
            "Regenerate after a change to the estimate, the levers or a config: "
            "`.venv/bin/python bench/memory_table.py --write` (55 minutes on two shared CPU "
            "cores, from 2 minutes for SD 3.5 Medium to 22 for Wan: each estimate is one fake "
            "step, `--models` rebuilds some); "
            "`tests/unit/test_memory_table.py` rebuilds SD 1.5's rows and checks the configs' "
            "digest. Configs: `tests/helpers/public_configs/` (digest "
            f"`{configs_digest()}`).",
            "",
        ]
    )


def page_rows(text: str, models: Sequence[Model]) -> list[str]:
    """The rows of `models` in a page's table."""
    titles = tuple(f"| {model.title} |" for model in models)
    return [line for line in text.splitlines() if line.startswith(titles)]


def build_rows(model: Model, workdir: Path) -> list[str]:
    """The rows of one model, timed on stderr."""
    start = time.perf_counter()
    rows = model_rows(model, workdir)
    print(f"{model.title}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return rows


def write_rows(model: Model, rows: Sequence[str]) -> None:
    """Put `model`'s rows into the page, keeping the other models' (locked: runs for other
    models may write at the same time)."""
    with open(Path(tempfile.gettempdir()) / "splitstage-memory-table.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        text = PAGE.read_text() if PAGE.is_file() else ""
        kept = {m.key: page_rows(text, [m]) for m in MODELS}
        kept[model.key] = list(rows)
        PAGE.write_text(page([row for m in MODELS for row in kept[m.key]]))


def stale(models: Sequence[Model], rows: Sequence[str], text: str) -> list[str]:
    """What differs between rebuilt `rows` of `models` and the page (empty: up to date)."""
    found = []
    if f"digest `{configs_digest()}`" not in text:
        found.append("the configs' digest differs from the page's")
    old = page_rows(text, models)
    found += [f"page: {line}" for line in old if line not in rows]
    found += [f"now:  {line}" for line in rows if line not in old]
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Write or check the page (exit 1 when stale)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="rebuild every row and the page")
    action.add_argument("--check", action="store_true", help="rebuild rows, compare with page")
    parser.add_argument("--models", default=",".join(m.key for m in MODELS))
    args = parser.parse_args(argv)
    known = {model.key: model for model in MODELS}
    unknown = [key for key in args.models.split(",") if key not in known]
    if unknown:
        parser.error(f"--models: unknown {unknown[0]!r}; use some of {', '.join(known)}")
    models = [known[key] for key in args.models.split(",")]
    torch.set_num_threads(1)
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="splitstage-memory-table-") as workdir:
        for model in models:
            found = build_rows(model, Path(workdir))
            if args.write:
                write_rows(model, found)
            rows += found
    if args.write:
        print(f"wrote {PAGE}")
        return 0
    differences = stale(models, rows, PAGE.read_text())
    for line in differences:
        print(line)
    if differences:
        print("stale: run .venv/bin/python bench/memory_table.py --write")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
